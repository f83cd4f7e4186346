"""Predictor methods measured: recall, precision, predicted-active share and decode-step bytes of each way of
training a layer's activation predictor, by how predictable the layer is and how many tokens calibrate it.

    python benchmarks/bench_predictors.py [--vars 0.9,0.8,0.7] [--tokens 1024,4096,16384] [--methods ...]
        [--hidden 768] [--ffn 3072] [--layers 2] [--test-tokens 4096] [--threads 1] [--json PATH]

Models: examples/models.py's OPT (`build_model("opt", "small", sparsity=0.9, lowrank_var=V)` with hidden /
ffn / layer overrides): synthetic 90% Zipf sparsity whose predictability `lowrank_var` sets (the share of
each pre-activation's variance in a rank-64 part; 0.95 is the easy default). Profiles come from forward
hooks on the torch model, as tests/test_predict.py's `torch_profiles` takes them: the FFN input after its
norm (what the profile pass records), the active neurons (fc2's input != 0) and the pre-activations
x @ w_up + b (what the pass's `_pre_activations` computes); tokens are random ids, sequences of 64.

Splits: each method trains on the first 80% of the calibration tokens and sets its threshold(s) on the
last 20% (whole sequences, as the pass does); every figure in the table is then measured on `--test-tokens`
other tokens (another seed) that neither saw. The rank of every method is the one `price_ranks` picks for
the layer (the pass's choice, before the parameter budget) with that method's own probe (old or new),
times the factor its name says (rank/2, rank*2). "train s" is that method's own seconds (one torch thread),
not counting pricing, which the '#' lines time.

Methods: "old" is the pass before issue 13 (probe from the pre-activations alone, w2 ridge 1e-3, BCE to the
end); "new" is the pass now (probe given the up weight: exact cross-covariance, Ledoit-Wolf shrunk input
covariance, w2 ridge 1e-5; BCE; the best of the start and 8 checkpoints on the threshold tokens); "-probe"
is a start alone, "new-bce-to-end" the new start then BCE keeping the last; "new+..." are candidates on the
new start: "density" weights the subspace fit per neuron by phi(Phi^-1(1 - p_j)), "neuron-thr" sets one
threshold per neuron (recall 0.99 on its own threshold-token positives), "hotK" always computes the K% most
often active neurons and thresholds the rest for the recall that brings the total to 0.99.

    # the unseen-model shape (h2048, ffn 8192), one layer; then the small preset's layer 1, 1k-16k tokens
    python benchmarks/bench_predictors.py --vars 0.9 --tokens 1024,4096 --hidden 2048 --ffn 8192 --layers 1
    python benchmarks/bench_predictors.py --vars 0.7 --tokens 1024,4096,16384 --only-layer 1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from passes import predict as P  # noqa: E402

SEQ_LEN = 64
TARGET = 0.99


def profiles(var: float, tokens: list[int], test_tokens: int, hidden: int, ffn: int, layers: int,
             seed: int = 0) -> tuple[dict, dict]:
    """{n_tokens: [(x, active, pre) per layer]} for each calibration size (nested: the first n of one draw),
    the test draw [(x, active, pre) per layer] and the up weights [d, ffn] per layer; cached under
    PICOMPILE_CACHE (the maker is deterministic)."""
    from examples.models import build_model, cache_dir, ffn_modules, random_tokens

    key = json.dumps(dict(v=var, n=max(tokens), t=test_tokens, h=hidden, f=ffn, l=layers, s=seed, version=2))
    path = cache_dir() / "bench_predictors" / (hashlib.sha256(key.encode()).hexdigest()[:16] + ".npz")
    if not path.exists():
        model, _ = build_model("opt", "small", sparsity=0.9, seed=seed, lowrank_var=var, hidden_size=hidden,
                               ffn_dim=ffn, num_hidden_layers=layers,
                               num_attention_heads=hidden // 64)
        modules = ffn_modules(model)
        arrays = {}
        for name, n, draw_seed in (("calib", max(tokens), 5001 + seed), ("test", test_tokens, 6001 + seed)):
            ids = random_tokens(model.config.vocab_size, n // SEQ_LEN, SEQ_LEN, draw_seed, [model.config.pad_token_id])
            xs = [[] for _ in modules]
            handles = [m["up"].register_forward_pre_hook(
                lambda mod, args, i=i: xs[i].append(args[0].reshape(-1, args[0].shape[-1]).clone()))
                for i, m in enumerate(modules)]
            try:
                with torch.no_grad():
                    for begin in range(0, len(ids), 32):
                        chunk = torch.from_numpy(ids[begin:begin + 32])
                        model(input_ids=chunk, attention_mask=torch.ones_like(chunk), use_cache=False)
            finally:
                for handle in handles:
                    handle.remove()
            for i, m in enumerate(modules):
                x = torch.cat(xs[i])
                with torch.no_grad():
                    pre = m["up"](x)  # x @ w_up + b: the pass's _pre_activations; active iff > 0 (ReLU)
                arrays[f"{name}_x{i}"] = x.numpy()
                arrays[f"up{i}"] = m["up"].weight.detach().numpy().T.copy()
                arrays[f"{name}_pre{i}"] = pre.numpy().astype(np.float32)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)
    data = np.load(path)
    n_layers = layers

    def layer(name, i, n=None):
        x, pre = data[f"{name}_x{i}"], data[f"{name}_pre{i}"]
        if n is not None:
            x, pre = x[:n], pre[:n]
        return x, pre > 0, pre

    return ({n: [layer("calib", i, n) for i in range(n_layers)] for n in tokens},
            [layer("test", i) for i in range(n_layers)], [data[f"up{i}"] for i in range(n_layers)])


# ---------------------------------------------------------------- methods: (x, active, pre, rank) -> scorer


OLD_W2_RIDGE = 1e-3  # the probe's w2 ridge before W2_RIDGE


def _result(p: P.Predictor) -> dict:
    return dict(predict=p.predict, rank=p.rank, seconds=p.train_seconds)


def method_old(x, active, pre, rank, up):
    """The method before: the probe from the pre-activations alone, then BCE to the end."""
    return _result(P.train_predictor(x, active, rank, target_recall=TARGET, pre_activations=pre, checkpoints=0,
                                     w2_ridge=OLD_W2_RIDGE))


def method_old_probe(x, active, pre, rank, up):
    """The old start alone (no BCE)."""
    return _result(P.train_predictor(x, active, rank, target_recall=TARGET, pre_activations=pre, epochs=0,
                                     w2_ridge=OLD_W2_RIDGE))


def trained(**kwargs):
    """train_predictor as the pass calls it now (the up weight given), with `kwargs` changed."""

    def method(x, active, pre, rank, up):
        return _result(P.train_predictor(x, active, rank, target_recall=TARGET, pre_activations=pre, up_weight=up,
                                         **kwargs))

    method.new = True
    return method


def _split(x, active, pre):
    n = P._training_tokens(len(x), P.HOLDOUT)
    return (x[:n], active[:n], pre[:n]), (x[n:], active[n:], pre[n:])


def _neuron_weights(active, kind):
    """Per-neuron weights of the probe's subspace fit from the training activation rates p_j: "density" is
    the standard normal density at the neuron's firing threshold phi(Phi^-1(1 - p_j)), how many tokens sit
    near its decision boundary per unit of fit error; "rate" is p_j."""
    from scipy.stats import norm

    p = np.clip(active.mean(0, dtype=np.float64), 0.5 / len(active), 1 - 0.5 / len(active))
    w = norm.pdf(norm.ppf(1 - p)) if kind == "density" else p
    return torch.from_numpy(w / w.max())


def probe_method(weights=None, rank_scale=1.0, thresholds="global", hot=0.0):
    """The new start (`_init_weights` with the up weight, no BCE) with subspace weights `weights` (None,
    "density", "rate"), at rank_scale x the priced rank, thresholds "global" (one, for recall TARGET on the
    threshold tokens) or "neuron" (each neuron at recall TARGET on its own threshold-token positives; the
    global one where it has fewer than 5); with `hot` > 0 that share of the neurons (the most often active
    in training) is always computed and the rest need only the recall that brings the total to TARGET."""

    def method(x, active, pre, rank, up):
        started = time.perf_counter()
        rank = max(8, int(round(rank * rank_scale)))
        (xt, yt, pt), (xh, yh, ph) = _split(x, active, pre)
        ffn = active.shape[1]
        order = np.argsort(-yt.mean(0), kind="stable")
        n_hot = int(round(hot * ffn))
        hot_set, rest = order[:n_hot], np.sort(order[n_hot:])
        w = None if weights is None else _neuron_weights(yt[:, rest], weights)
        w1, w2_rest = P._init_weights(xt, yt[:, rest], rank, pt[:, rest], weights=w, up=up[:, rest])
        w2 = np.zeros((w2_rest.shape[0], ffn), np.float32)
        w2[:, rest] = w2_rest
        logits = np.maximum(xh @ w1, 0) @ w2
        target = TARGET
        if n_hot:
            total, in_hot = yh.sum(), yh[:, hot_set].sum()
            target = max(0.0, (TARGET * total - in_hot) / max(1, total - in_hot))
        yr, lr = yh[:, rest], logits[:, rest]
        t = np.full(ffn, P._threshold_for_recall(lr, yr, target), np.float32)
        if thresholds == "neuron":
            for k, j in enumerate(rest):
                pos = np.sort(lr[:, k][yr[:, k]])
                if len(pos) >= 5:
                    misses = len(pos) - int(np.ceil(target * len(pos) - 1e-9))
                    t[j] = np.nextafter(pos[min(max(misses, 0), len(pos) - 1)], np.float32(-np.inf))
        t[hot_set] = -np.inf
        seconds = time.perf_counter() - started

        def predict(inputs):
            return (np.maximum(inputs @ w1, 0) @ w2) > t

        return dict(predict=predict, rank=rank, seconds=seconds)

    method.new = True
    return method


METHODS = {
    "old": method_old, "old-probe": method_old_probe,
    "new": trained(), "new-probe": trained(epochs=0), "new-bce-to-end": trained(checkpoints=0),
    "new+density": probe_method("density"), "new+neuron-thr": probe_method(thresholds="neuron"),
    "new+hot5": probe_method(hot=0.05), "new+hot10": probe_method(hot=0.10), "new+hot20": probe_method(hot=0.20),
    "new-rank/2": probe_method(rank_scale=0.5), "new-rank*2": probe_method(rank_scale=2.0),
}
DEFAULT_METHODS = "old,old-probe,new,new-probe,new-bce-to-end,new+neuron-thr,new+hot10,new-rank/2,new-rank*2"


def evaluate(result: dict, test) -> dict:
    x, active, _ = test
    scores = P._scores(result["predict"](x), active)
    return scores


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vars", default="0.9,0.8,0.7", help="lowrank_var values (lower: harder to predict)")
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--methods", default=DEFAULT_METHODS, help=f"of {', '.join(METHODS)}")
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--ffn", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--only-layer", type=int, default=None)
    parser.add_argument("--test-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    variances = [float(v) for v in args.vars.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    methods = args.methods.split(",")
    rows = []
    header = (f"{'var':>5} {'tokens':>6} {'layer':>5} {'sparsity':>8} {'method':<15} {'rank':>5} {'recall':>7} "
              f"{'precision':>9} {'active':>7} {'MiB/step':>8} {'train s':>7}")
    print(header, flush=True)
    for var in variances:
        calib, test, ups = profiles(var, tokens, args.test_tokens, args.hidden, args.ffn, args.layers)
        for n in tokens:
            for layer, (x, active, pre) in enumerate(calib[n]):
                if args.only_layer is not None and layer != args.only_layer:
                    continue
                d, ffn = x.shape[1], active.shape[1]
                # each method at the rank its own pricing picks: the old probe's, or the new one's (the pass's)
                ranks = {}
                for kind, kwargs in (("old", dict(w2_ridge=OLD_W2_RIDGE)), ("new", dict(up_weight=ups[layer]))):
                    started = time.perf_counter()
                    priced = P.price_ranks(x, active, d, False, target_recall=TARGET, pre_activations=pre, **kwargs)
                    ranks[kind] = min(priced, key=lambda r: (priced[r][1], r))
                    print(f"# var {var} tokens {n} layer {layer}: {kind} pricing: ranks {sorted(priced)} -> "
                          f"{ranks[kind]} in {time.perf_counter() - started:.1f}s", flush=True)
                for name in methods:
                    started = time.perf_counter()
                    chosen = ranks["new" if getattr(METHODS[name], "new", False) else "old"]
                    result = METHODS[name](x, active, pre, chosen, ups[layer])
                    seconds = result.get("seconds", time.perf_counter() - started)
                    s = evaluate(result, test[layer])
                    reads = P.step_reads(result["rank"], s["predicted_active"], d, ffn, False)
                    reads += result.get("extra_reads", 0)
                    row = dict(var=var, tokens=n, layer=layer, sparsity=float(1 - test[layer][1].mean()),
                               method=name, rank=result["rank"], **s, step_mib=reads / 2**20, train_s=seconds)
                    rows.append(row)
                    print(f"{var:>5} {n:>6} {layer:>5} {row['sparsity']:>8.3f} {name:<15} {row['rank']:>5} "
                          f"{s['recall']:>7.4f} {s['precision']:>9.3f} {s['predicted_active']:>7.4f} "
                          f"{row['step_mib']:>8.2f} {seconds:>7.1f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
