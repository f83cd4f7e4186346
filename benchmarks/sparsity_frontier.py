"""Quality cost and weight bytes skipped of TEAL, WINA and CATS at equal input sparsity, on a qwen2 GGUF file.

    python benchmarks/sparsity_frontier.py FILE.gguf --tokenizer TOKENIZER.json --text HELDOUT.txt [--sequences 12]
        [--length 256] [--score-from 64] [--calibration 4] [--parts verify,main,mixed,layers]
        [--configs METHOD|SITES|SPARSITY,...] [--threads 2] [--json PATH]

Why: a sparse kernel gains by not reading the weight columns whose inputs are zero. TEAL, WINA and CATS are the
anchor ways of choosing which inputs of the linear layers to zero; at equal sparsity of those inputs this measures
what each costs in quality (perplexity change and KL from the dense model) and what it could save: the share of a
token's weight bytes it skips, the bound any sparse kernel could reach (the skipped bytes at the dense kernel's
speed: not read, the rest read as fast as the dense kernel reads them).

- TEAL: |x|, the input's magnitude.
- WINA: |x| * ||W[:, i]||, the magnitude times the norm of the weight column it multiplies.
- CATS: |silu(gate)|, at the FFN down projection only; it is known before the up projection, so the up rows of
  the zeroed neurons are skipped too.

Sites, per layer: qkv (the attention input), o (the attention output projection's input), in (the FFN input: gate
and up), down (the down projection's input); "all" is the four.

It is a reference measurement, not picompile's engine: a plain fp32 torch forward of the file's weights,
dequantized in memory with the gguf package. Every dimension comes from the file's metadata; a file of another
architecture than qwen2 is refused.

Thresholds: one per layer, site and method, the quantile at the target sparsity of that method's scores over every
position and input of --calibration sequences cut from the text after the scored ones (disjoint from them), each
up to --length tokens. Scored: --sequences sequences of --length tokens from the text's start, each token from
position --score-from on (so each has a context of at least that many tokens); perplexity against the dense
model's on the same tokens, and KL(dense || sparse) of the next-token distribution, averaged over those positions.

Parts (--parts): verify (greedy continuation of a code prompt: checks the forward), main (the anchor configurations
at the down, in and all sites), mixed (TEAL or WINA at every site but CATS at down), layers (50% sparsity at the
down projection of one layer at a time, each method, on the first 4 scored sequences: where the KL comes from).
--configs scores only the named configurations instead of those of main and mixed.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ARCHITECTURE = "qwen2"
SITES = ("qkv", "o", "in", "down")
PARTS = ("verify", "main", "mixed", "layers")
METHODS = ("teal", "wina", "cats")
# the GGUF tensor of each linear layer in a block, and the site whose input it reads
SITE_OF_TENSOR = {"attn_q": "qkv", "attn_k": "qkv", "attn_v": "qkv", "attn_output": "o",
                  "ffn_gate": "in", "ffn_up": "in", "ffn_down": "down"}
BATCH = 4  # sequences per forward: bounds the memory of the [batch, positions, vocabulary] log-probabilities
VERIFY_PROMPT, VERIFY_TOKENS = "def fibonacci(n):", 40
LAYER_SPARSITY = 0.5
LAYER_SEQUENCES = BATCH  # the per-layer part reuses the first batch's dense log-probabilities
MIN_CALIBRATION_LENGTH = 64


class Refusal(Exception):
    """An input this script cannot measure: reported as one `error:` line, exit code 2."""


def log(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ---------------------------------------------------------------- configurations

def parse_config(name: str) -> dict[str, tuple[str, float]]:
    """`METHOD|SITES|SPARSITY` (e.g. `wina|all|0.25`, `teal+cats_down|all|0.4`) as {site: (method, sparsity)}.

    SITES is `all` or sites joined by `+`; CATS scores only the down projection's input, so `cats` goes with
    `down` alone and `teal+cats_down` / `wina+cats_down` put CATS at down and the other method elsewhere.
    """
    try:
        method, sites_text, level_text = name.split("|")
        level = float(level_text)
    except ValueError:
        raise ValueError(f"configuration {name!r} is not METHOD|SITES|SPARSITY") from None
    if not 0.0 < level < 1.0:
        raise ValueError(f"configuration {name!r}: sparsity must be in (0, 1)")
    sites = SITES if sites_text == "all" else tuple(sites_text.split("+"))
    if any(site not in SITES for site in sites):
        raise ValueError(f"configuration {name!r}: sites are 'all' or some of {'+'.join(SITES)}")
    base, _, extra = method.partition("+")
    if base not in METHODS or extra not in ("", "cats_down") or (extra and base == "cats"):
        raise ValueError(f"configuration {name!r}: method is one of {', '.join(METHODS)}, or teal or wina "
                         "followed by +cats_down")
    if base == "cats" and sites != ("down",):
        raise ValueError(f"configuration {name!r}: CATS scores only the down projection's input")
    if extra and "down" not in sites:
        raise ValueError(f"configuration {name!r}: +cats_down needs the down site")
    config = {site: (base, level) for site in sites}
    if extra:
        config["down"] = ("cats", level)
    return config


def default_config_names(parts: list[str]) -> list[str]:
    """The configurations of the main and mixed parts: equal target sparsities, so the methods compare directly."""
    names = []
    if "main" in parts:
        names += [f"{m}|down|{level}" for level in (0.3, 0.5, 0.7) for m in ("teal", "wina", "cats")]
        names += [f"{m}|in|{level}" for level in (0.2, 0.4) for m in ("teal", "wina")]
        names += [f"{m}|all|{level}" for level in (0.25, 0.4) for m in ("teal", "wina")]
    if "mixed" in parts:
        names += [f"{m}+cats_down|all|{level}" for level in (0.25, 0.4) for m in ("teal", "wina")]
    return names


# ---------------------------------------------------------------- the GGUF file

@dataclass(frozen=True)
class Dimensions:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_base: float
    rms_eps: float


def field(reader, key: str):
    """A metadata value of the file (number or string); Refusal when it is missing."""
    if key not in reader.fields:
        raise Refusal(f"the file has no metadata {key}")
    return reader.fields[key].contents()


def read_dimensions(reader) -> Dimensions:
    """The model's dimensions from the file's metadata; Refusal for any architecture but qwen2."""
    architecture = field(reader, "general.architecture")
    if architecture != ARCHITECTURE:
        raise Refusal(f"the file's architecture is {architecture!r}: this script reads only {ARCHITECTURE}")
    a = ARCHITECTURE
    hidden, heads = int(field(reader, f"{a}.embedding_length")), int(field(reader, f"{a}.attention.head_count"))
    return Dimensions(layers=int(field(reader, f"{a}.block_count")), hidden=hidden, heads=heads,
                      kv_heads=int(field(reader, f"{a}.attention.head_count_kv")), head_dim=hidden // heads,
                      ffn=int(field(reader, f"{a}.feed_forward_length")),
                      rope_base=float(field(reader, f"{a}.rope.freq_base")),
                      rms_eps=float(field(reader, f"{a}.attention.layer_norm_rms_epsilon")))


def output_tensor_name(reader) -> str:
    """The LM head's tensor: output.weight, or the token embedding when the file ties them."""
    names = {t.name for t in reader.tensors}
    return "output.weight" if "output.weight" in names else "token_embd.weight"


def weight_bytes(reader) -> dict[str, float]:
    """Bytes read per token by the linear layers of each site, the LM head ('output') and the up projections
    alone ('up'), from the file's types and the gguf package's own block sizes."""
    from gguf.constants import GGML_QUANT_SIZES

    def nbytes(tensor) -> float:
        block_size, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        return tensor.n_elements * type_size / block_size

    per = {site: 0.0 for site in SITES} | {"up": 0.0}
    head = output_tensor_name(reader)
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.name == head:
            per["output"] = nbytes(tensor)
        elif parts[0] == "blk" and parts[-1] == "weight" and parts[2] in SITE_OF_TENSOR:
            per[SITE_OF_TENSOR[parts[2]]] += nbytes(tensor)
            if parts[2] == "ffn_up":
                per["up"] += nbytes(tensor)
    return per


def byte_shares(per: dict[str, float]) -> tuple[dict[str, float], float]:
    """Each site's share of a token's weight bytes (linear layers and LM head; the embedding row and the norms
    are too small to count), and the total."""
    total = sum(per[site] for site in SITES) + per["output"]
    shares = {site: per[site] / total for site in SITES}
    shares["output"] = per["output"] / total
    shares["up_only(part of in)"] = per["up"] / total
    return shares, total


def dequantize(reader) -> dict[str, torch.Tensor]:
    """Every tensor of the file as fp32, [out, in] for the linear layers (in memory: nothing is cached on disk)."""
    from gguf.quants import dequantize as gguf_dequantize

    weights = {}
    for tensor in reader.tensors:
        array = gguf_dequantize(tensor.data, tensor.tensor_type)
        # an F32 tensor comes back as a read-only view of the mapped file: copied into memory, writable
        weights[tensor.name] = torch.from_numpy(np.require(array, np.float32, ["C", "W"]))
    return weights


# ---------------------------------------------------------------- the model

class Calibrator:
    """Thresholds from the calibration forward: per (layer, site, method), the quantiles of the scores at the
    target sparsities. Computed as the scores come (one call per key), so they are never all held at once."""

    def __init__(self, levels: list[float]):
        self.levels = sorted(levels)
        self.thresholds: dict[tuple[int, str, str], dict[float, float]] = {}

    def observe(self, layer: int, site: str, method: str, scores: torch.Tensor) -> None:
        values = np.quantile(scores.reshape(-1).numpy(), self.levels)
        self.thresholds[(layer, site, method)] = {level: float(v) for level, v in zip(self.levels, values, strict=True)}

    def plan(self, config: dict[str, tuple[str, float]], n_layers: int, layers=None) -> list[dict]:
        """Per layer, {site: (method, threshold)} for the configuration (in the given layers only, or all)."""
        return [{site: (method, self.thresholds[(layer, site, method)][level])
                 for site, (method, level) in config.items()} if layers is None or layer in layers else {}
                for layer in range(n_layers)]


class Model:
    """Qwen2 decoder in fp32 torch; each linear layer's input may be thinned by a threshold on a method's score."""

    def __init__(self, weights: dict[str, torch.Tensor], dims: Dimensions, head_name: str, max_positions: int):
        self.dims = dims
        inv = 1.0 / (dims.rope_base ** (torch.arange(0, dims.head_dim, 2, dtype=torch.float64) / dims.head_dim))
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), inv)
        angles = torch.cat([angles, angles], -1)
        self.cos, self.sin = angles.cos().float(), angles.sin().float()
        self.mask = torch.full((max_positions, max_positions), float("-inf")).triu(1)
        self.layers = [self._layer_weights(weights, i) for i in range(dims.layers)]
        self.embedding = weights["token_embd.weight"]
        self.output_norm = weights["output_norm.weight"]
        self.head = weights[head_name]

    @staticmethod
    def _layer_weights(weights: dict[str, torch.Tensor], index: int) -> dict:
        """One block's weights, q/k/v and gate/up fused (one matmul each), with the column norms WINA scores by.
        The unfused tensors are dropped from `weights` so the fp32 model is held once."""
        def take(name):
            return weights.pop(f"blk.{index}.{name}")
        wqkv = torch.cat([take("attn_q.weight"), take("attn_k.weight"), take("attn_v.weight")], 0)
        bqkv = torch.cat([take("attn_q.bias"), take("attn_k.bias"), take("attn_v.bias")], 0)
        wgu = torch.cat([take("ffn_gate.weight"), take("ffn_up.weight")], 0)
        wo, wd = take("attn_output.weight"), take("ffn_down.weight")
        return {"attn_norm": take("attn_norm.weight"), "ffn_norm": take("ffn_norm.weight"),
                "wqkv": wqkv, "bqkv": bqkv, "wo": wo, "wgu": wgu, "wd": wd,
                "column_norms": {"qkv": wqkv.norm(dim=0), "o": wo.norm(dim=0), "in": wgu.norm(dim=0),
                                 "down": wd.norm(dim=0)}}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.dims.rms_eps) * weight

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """RoPE, NeoX layout (the halves of each head rotated together), as llama.cpp runs qwen2."""
        half = self.dims.head_dim // 2
        positions = x.shape[-2]
        x1, x2 = x[..., :half], x[..., half:]
        return x * self.cos[:positions] + torch.cat([-x2, x1], -1) * self.sin[:positions]

    def layer(self, index: int, h: torch.Tensor, plan: dict | None = None, calibrator: Calibrator | None = None):
        """One block on the residual h [batch, positions, hidden]. plan: {site: (method, threshold)}: at each named
        site the inputs scoring below the threshold are zeroed. Returns the new residual and {site: share zeroed}."""
        d, w = self.dims, self.layers[index]
        batch, positions, _ = h.shape
        zeroed = {}

        def thin(site: str, x: torch.Tensor, gate_act: torch.Tensor | None = None) -> torch.Tensor:
            scores = {"teal": lambda: x.abs(), "wina": lambda: x.abs() * w["column_norms"][site]}
            if gate_act is not None:
                scores["cats"] = lambda: gate_act.abs()
            if calibrator is not None:
                for method, score in scores.items():
                    calibrator.observe(index, site, method, score())
            if not plan or site not in plan:
                return x
            method, threshold = plan[site]
            keep = scores[method]() >= threshold
            zeroed[site] = 1.0 - keep.float().mean().item()
            return x * keep

        x = thin("qkv", self.rms_norm(h, w["attn_norm"]))
        q, k, v = F.linear(x, w["wqkv"], w["bqkv"]).split(
            [d.heads * d.head_dim, d.kv_heads * d.head_dim, d.kv_heads * d.head_dim], -1)
        q = self.rotate(q.view(batch, positions, d.heads, d.head_dim).transpose(1, 2))
        k = self.rotate(k.view(batch, positions, d.kv_heads, d.head_dim).transpose(1, 2))
        v = v.view(batch, positions, d.kv_heads, d.head_dim).transpose(1, 2)
        k = k.repeat_interleave(d.heads // d.kv_heads, 1)  # grouped-query attention: kv heads shared
        v = v.repeat_interleave(d.heads // d.kv_heads, 1)
        attention = (q @ k.transpose(-1, -2)) / math.sqrt(d.head_dim) + self.mask[:positions, :positions]
        a = (attention.softmax(-1) @ v).transpose(1, 2).reshape(batch, positions, d.heads * d.head_dim)
        h = h + F.linear(thin("o", a), w["wo"])
        x = thin("in", self.rms_norm(h, w["ffn_norm"]))
        gate, up = F.linear(x, w["wgu"]).split([d.ffn, d.ffn], -1)
        gate_act = F.silu(gate)
        # zeroing silu(gate) * up where |silu(gate)| is small is CATS; TEAL and WINA score the product itself
        h = h + F.linear(thin("down", gate_act * up, gate_act), w["wd"])
        return h, zeroed

    def hidden(self, ids: torch.Tensor | None = None, plans: list | None = None, calibrator: Calibrator | None = None,
               start: int = 0, h0: torch.Tensor | None = None, keep_residuals: bool = False):
        """The blocks from `start` on, from the embedding of ids (or the residual h0 entering block `start`).
        Returns the final residual, each block's {site: share zeroed}, and (keep_residuals) each block's input."""
        h = self.embedding[ids] if h0 is None else h0
        zeroed, residuals = [], []
        for index in range(start, self.dims.layers):
            if keep_residuals:
                residuals.append(h)
            h, z = self.layer(index, h, None if plans is None else plans[index], calibrator)
            zeroed.append(z)
        return h, zeroed, residuals

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(self.rms_norm(h, self.output_norm), self.head)

    def log_probs(self, h: torch.Tensor, score_from: int) -> torch.Tensor:
        """Next-token log-probabilities predicting the tokens at positions score_from .. end."""
        return self.logits(h[:, score_from - 1:-1]).log_softmax(-1)


# ---------------------------------------------------------------- data and measurements

def load_tokens(tokenizer_path: Path, text_path: Path, sequences: int, length: int, calibration: int):
    """The tokenizer, the scored sequences [sequences, length] from the text's start, the calibration sequences
    from the tokens after them, and the text's token count; Refusal when the text is too short."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path))
    ids = tokenizer.encode(text_path.read_text()).ids
    scored_tokens = sequences * length
    # calibration sequences are as long as the scored ones when the text allows, shorter (but not too short) if not
    calibration_length = min(length, (len(ids) - scored_tokens) // calibration)
    needed = scored_tokens + calibration * min(length, MIN_CALIBRATION_LENGTH)
    if calibration_length < min(length, MIN_CALIBRATION_LENGTH):
        raise Refusal(f"{text_path} has {len(ids)} tokens: {sequences} sequences of {length} and {calibration} "
                      f"calibration sequences of at least {min(length, MIN_CALIBRATION_LENGTH)} need {needed}")
    scored = torch.tensor(ids[:scored_tokens]).view(sequences, length)
    rest = ids[scored_tokens:scored_tokens + calibration * calibration_length]
    return tokenizer, scored, torch.tensor(rest).view(calibration, calibration_length), len(ids)


def greedy(model: Model, tokenizer, prompt: str, tokens: int) -> str:
    """The prompt and its greedy continuation (full recompute per token: short, and checks the plain forward)."""
    ids = torch.tensor([tokenizer.encode(prompt).ids])
    for _ in range(tokens):
        h, _, _ = model.hidden(ids)
        ids = torch.cat([ids, model.logits(h[:, -1]).argmax(-1)[:, None]], 1)
    return tokenizer.decode(ids[0].tolist())


def dense_log_probs(model: Model, scored: torch.Tensor, score_from: int) -> list[torch.Tensor]:
    """The dense model's log-probabilities at the scored positions, per batch of BATCH sequences."""
    return [model.log_probs(model.hidden(scored[i:i + BATCH])[0], score_from) for i in range(0, len(scored), BATCH)]


def perplexity(log_probs: list[torch.Tensor], scored: torch.Tensor, score_from: int) -> float:
    """Perplexity of per-batch log-probabilities on the scored tokens."""
    nll = sum(-lp.gather(-1, scored[i:i + BATCH, score_from:, None]).sum().item()
              for i, lp in zip(range(0, len(scored), BATCH), log_probs, strict=True))
    return math.exp(nll / scored[:, score_from:].numel())


def mean_nll(log_probs: torch.Tensor, targets: torch.Tensor) -> float:
    return -log_probs.gather(-1, targets[..., None]).mean().item()


def evaluate(model: Model, scored: torch.Tensor, dense: list[torch.Tensor], plans: list, score_from: int) -> dict:
    """Perplexity of the thinned model against the dense one on the scored tokens, KL(dense || thinned) per
    position, and the share of inputs actually zeroed per site (mean over layers and batches)."""
    nll_dense = nll_sparse = kl = 0.0
    positions = 0
    zeroed: dict[str, list[float]] = {}
    for batch, dense_lp in zip(range(0, len(scored), BATCH), dense, strict=True):
        ids = scored[batch:batch + BATCH]
        targets = ids[:, score_from:, None]
        h, layer_zeroed, _ = model.hidden(ids, plans)
        lp = model.log_probs(h, score_from)
        nll_sparse += -lp.gather(-1, targets).sum().item()
        nll_dense += -dense_lp.gather(-1, targets).sum().item()
        kl += (dense_lp.exp() * (dense_lp - lp)).sum().item()
        positions += targets.numel()
        for z in layer_zeroed:
            for site, share in z.items():
                zeroed.setdefault(site, []).append(share)
        del lp
    ppl_dense, ppl = math.exp(nll_dense / positions), math.exp(nll_sparse / positions)
    return {"ppl": ppl, "ppl_dense": ppl_dense, "dppl_pct": 100 * (ppl / ppl_dense - 1), "kl": kl / positions,
            "realized": {site: float(np.mean(v)) for site, v in zeroed.items()}}


def bytes_skipped(config: dict[str, tuple[str, float]], realized: dict[str, float], shares: dict[str, float]):
    """Share of a token's weight bytes whose columns the zeroed inputs let a kernel skip. CATS at down also skips
    the up rows of the zeroed neurons (its score, silu(gate), comes before up), except where a thinned FFN input
    already skipped those bytes' columns."""
    skipped = 0.0
    for site, (method, level) in config.items():
        share_zeroed = realized.get(site, level)
        skipped += shares[site] * share_zeroed
        if method == "cats":
            skipped += shares["up_only(part of in)"] * share_zeroed * (1 - realized.get("in", 0.0))
    return skipped


def per_layer(model: Model, calibrator: Calibrator, scored: torch.Tensor, dense: torch.Tensor, score_from: int):
    """For each method and layer: KL and perplexity change with LAYER_SPARSITY at that layer's down projection
    only, the other layers dense (each run starts from the dense residual entering that layer), on the first
    LAYER_SEQUENCES scored sequences; dense: the dense log-probabilities of those (the first batch)."""
    ids = scored[:LAYER_SEQUENCES]
    targets = ids[:, score_from:]
    nll_dense = mean_nll(dense, targets)
    _, _, residuals = model.hidden(ids, keep_residuals=True)
    results = {}
    for method in METHODS:
        started = time.time()
        kls, dppl = [], []
        for layer in range(model.dims.layers):
            plans = calibrator.plan({"down": (method, LAYER_SPARSITY)}, model.dims.layers, layers={layer})
            h, _, _ = model.hidden(plans=plans, start=layer, h0=residuals[layer])
            lp = model.log_probs(h, score_from)
            kls.append((dense.exp() * (dense - lp)).sum(-1).mean().item())
            dppl.append(100 * (math.exp(mean_nll(lp, targets) - nll_dense) - 1))
        results[method] = {"kl": kls, "dppl_pct": dppl}
        log(f"per-layer {method} ({time.time() - started:.0f}s) KL:", " ".join(f"{k:.4f}" for k in kls))
    return results


def table(runs: dict) -> str:
    """The scored configurations as a markdown table."""
    rows = ["| method | sites | sparsity (realized) | ppl change % | KL | share of bytes skipped |",
            "|---|---|---|---|---|---|"]
    for name, r in runs.items():
        method, sites, level = name.split("|")
        realized = float(np.mean(list(r["realized"].values()))) if r["realized"] else float("nan")
        rows.append(f"| {method} | {sites} | {float(level):.2f} ({realized:.3f}) | {r['dppl_pct']:+.2f} | "
                    f"{r['kl']:.4f} | {100 * r['bytes_skipped_frac']:.1f}% |")
    return "\n".join(rows)


# ---------------------------------------------------------------- main

def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", type=Path, help="GGUF file of the qwen2 architecture")
    parser.add_argument("--tokenizer", type=Path, required=True, help="the model's tokenizer.json")
    parser.add_argument("--text", type=Path, required=True, help="held-out text: scored, then calibration")
    parser.add_argument("--sequences", type=int, default=12, help="scored sequences (default 12)")
    parser.add_argument("--length", type=int, default=256, help="tokens per sequence (default 256)")
    parser.add_argument("--score-from", type=int, default=64, help="first scored position (default 64)")
    parser.add_argument("--calibration", type=int, default=4, help="calibration sequences (default 4)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {','.join(PARTS)} (default all)")
    parser.add_argument("--configs", help="comma-separated METHOD|SITES|SPARSITY to score instead of the main and "
                                          "mixed lists, e.g. 'teal|down|0.5,wina|down|0.5'")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--json", type=Path, help="write the results here (default: print only)")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    if any(p not in PARTS for p in args.parts):
        parser.error(f"--parts: expected some of {','.join(PARTS)}, got {','.join(args.parts)!r}")
    if min(args.sequences, args.calibration, args.threads) < 1:
        parser.error("--sequences, --calibration and --threads must be at least 1")
    if not 1 <= args.score_from < args.length:
        parser.error("--score-from must be at least 1 and below --length")
    names = args.configs.split(",") if args.configs else default_config_names(args.parts)
    try:
        args.configs = {name: parse_config(name) for name in names}
    except ValueError as e:
        parser.error(str(e))
    return args


def run(args) -> dict:
    import gguf

    started = time.time()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    try:
        reader = gguf.GGUFReader(args.gguf)
    except (OSError, ValueError) as e:
        raise Refusal(f"cannot read {args.gguf} as GGUF: {e}") from None
    dims = read_dimensions(reader)  # before anything heavy: refuse a wrong file at once
    tokenizer, scored, calibration, text_tokens = load_tokens(args.tokenizer, args.text, args.sequences,
                                                              args.length, args.calibration)
    shares, total = byte_shares(weight_bytes(reader))
    results = {"config": {"file": str(args.gguf), "tokenizer": str(args.tokenizer), "text": str(args.text),
                          "sequences": args.sequences, "length": args.length, "score_from": args.score_from,
                          "calibration": args.calibration, "parts": args.parts, "threads": args.threads,
                          "dimensions": asdict(dims)},
               "byte_shares": shares, "bytes_per_token_weights_MB": total / 1e6,
               "data": {"text_tokens": text_tokens, "scored": list(scored.shape), "calib": list(calibration.shape),
                        "note": f"calibration = {calibration.shape[0]} sequences of {calibration.shape[1]} tokens "
                                f"from the text after the {scored.shape[0]} scored sequences"}}

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))

    weights = dequantize(reader)
    log("weights loaded", len(weights), "tensors;", dims)
    model = Model(weights, dims, output_tensor_name(reader),
                  max_positions=max(args.length, len(tokenizer.encode(VERIFY_PROMPT).ids) + VERIFY_TOKENS))
    del weights, reader
    log("byte shares", shares)

    if "verify" in args.parts:
        results["greedy_fibonacci"] = greedy(model, tokenizer, VERIFY_PROMPT, VERIFY_TOKENS)
        log("greedy:\n" + results["greedy_fibonacci"])
        save()

    t = time.time()
    dense = dense_log_probs(model, scored, args.score_from)
    results["dense_ppl"] = perplexity(dense, scored, args.score_from)
    log(f"dense ppl {results['dense_ppl']:.3f}  ({time.time() - t:.1f}s for {len(scored)} seqs)")
    save()

    levels = {level for config in args.configs.values() for _, level in config.values()} | {LAYER_SPARSITY}
    log("calibrating on", tuple(calibration.shape))
    calibrator = Calibrator(sorted(levels))
    model.hidden(calibration, calibrator=calibrator)

    if args.configs:
        results["runs"] = {}
        for name, config in args.configs.items():
            t = time.time()
            r = evaluate(model, scored, dense, calibrator.plan(config, dims.layers), args.score_from)
            r["cfg"] = {site: list(v) for site, v in config.items()}
            r["bytes_skipped_frac"] = bytes_skipped(config, r["realized"], shares)
            results["runs"][name] = r
            save()
            log(f"{name:28s} dppl {r['dppl_pct']:+7.3f}%  KL {r['kl']:.5f}  realized {r['realized']}  "
                f"bytes_skipped {r['bytes_skipped_frac']:.3f}  "
                f"({time.time() - t:.0f}s, total {time.time() - started:.0f}s)")

    if "layers" in args.parts:
        results["per_layer_down50"] = per_layer(model, calibrator, scored, dense[0], args.score_from)
        save()
    log(f"done in {time.time() - started:.0f}s")
    return results


def main(argv=None) -> int:
    args = parse_arguments(argv)
    try:
        results = run(args)
    except Refusal as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print()
    print(f"dense ppl {results['dense_ppl']:.3f} on {results['data']['scored'][0]} sequences; "
          f"weight bytes per token {results['bytes_per_token_weights_MB']:.1f} MB")
    if results.get("runs"):
        print(table(results["runs"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
