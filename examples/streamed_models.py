"""LLaMA ReGLU models too big to hold twice (the ``7b`` and ``13b`` presets), made layer by layer.

:mod:`examples.models` builds a whole transformers model in memory, sparsifies it with one forward pass and
exports it: a 7B model would need its fp32 weights, the exporter's copy and the fp16 file at once. Here:

1. **The graph** comes from torch's dynamo exporter run on the model built on the meta device (no weights):
   the same graph an export of the real model makes. The exporter's own optimizer would read the weights,
   so it runs on the graph with the weights hidden, after each weight's ``Transpose`` has been folded into
   the weight's layout (as the optimizer does: the file stores nn.Linear weights as [in, out]).
2. **The weights** are made one decoder layer at a time, in fp32 and rounded to the model's dtype before
   use, and written tensor by tensor into ``model.onnx.data``. Each layer runs (transformers' own
   ``LlamaDecoderLayer``) on the hidden states of the synthesis tokens and of the held-out tokens, so the
   synthetic sparsity is :func:`examples.models.synthesize_sparsity`'s, calibrated on the inputs each layer
   really sees: a forward pre-hook sets the gate and up weights from the FFN's input (low rank plus noise,
   thresholds through the bias channel), and a pre-hook on the down projection counts the active neurons
   on the held-out tokens. At most one layer (plus the embedding while the first hidden states are
   gathered) is in memory.

The files are :mod:`examples.models`' (``model.onnx`` + ``model.onnx.data``, calib / held-out tokens,
``config.json``, ``sparsity.npz``), so :class:`examples.models.ModelFiles` and :func:`cached_model` read them;
``cached_model("llama", "7b", sparsity=0.9)`` makes one through here.
"""

from __future__ import annotations

import contextlib
import io
import json
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import models as M

STREAMED_PRESETS = ("7b", "13b")
DTYPES = {"fp16": (torch.float16, np.float16), "fp32": (torch.float32, np.float32)}
DTYPES_NP = {torch_dtype: np_dtype for torch_dtype, np_dtype in DTYPES.values()}
# Token files of a streamed model: fewer than the small presets' (each layer runs on every synthesis and
# held-out token: 1,024 of each cost a 7B layer ~1 TFLOP on the CPU)
STREAMED_TOKENS: dict[str, Any] = dict(n_seqs=16, seq_len=64, calib_seqs=None)
DATA_ALIGNMENT = 64  # each tensor's offset in the data file (aligned loads for whoever maps it)


@dataclass(frozen=True)
class WeightSpec:
    """Where one initializer of the exported graph comes from: a parameter of the transformers model, stored
    as it is ([out, in] for nn.Linear) or transposed (the Linear's weight folded into its MatMul's layout)."""

    parameter: str  # the parameter's name in LlamaForCausalLM (model.layers.0.mlp.up_proj.weight)
    transposed: bool


def export_graph(config, dtype: torch.dtype) -> tuple[Any, dict[str, WeightSpec]]:
    """The dynamo export of LlamaForCausalLM(config) in `dtype` with optimum's KV-cache I/O, built on the meta
    device: an onnx_ir model whose weight initializers have no values yet, and what each one is."""
    import onnx_ir as ir
    import onnxscript.optimizer
    import transformers
    from torch.export import Dim

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).eval().to(dtype)
    layers, kv_heads, head_dim = M._kv_shape(config)
    wrapper = M._KVWrapper(model, layers, True).eval()
    batch, past, seq = 2, 3, 2
    meta = dict(device="meta")
    args = [torch.zeros(batch, seq, dtype=torch.long, **meta), torch.ones(batch, past + seq, dtype=torch.long, **meta),
            torch.arange(past, past + seq, **meta).repeat(batch, 1)]
    args += [torch.zeros(batch, kv_heads, past, head_dim, dtype=dtype, **meta) for _ in range(2 * layers)]
    positions = config.max_position_embeddings
    b, s = Dim("batch", min=1, max=256), Dim("seq", min=1, max=positions)
    p, t = Dim("past", min=1, max=positions), Dim("total", min=2, max=2 * positions)
    shapes = ({0: b, 1: s}, {0: b, 1: t}, tuple([{0: b, 1: s}] + [{0: b, 2: p}] * (2 * layers)))
    inputs, outputs = M.io_names(config)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), M._quiet_loggers("torch.onnx"):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(wrapper, tuple(args), None, input_names=inputs, output_names=outputs,
                                    dynamic_shapes=shapes, dynamo=True, opset_version=18, optimize=False,
                                    verbose=False)
    graph = program.model.graph
    specs: dict[str, WeightSpec] = {}
    buffers = dict(model.named_buffers())
    for name, value in list(graph.initializers.items()):
        parameter = name.removeprefix("m.")
        if parameter in buffers:  # rotary inv_freq: computed, small, inline
            value.const_value = ir.tensor(_rotary_inv_freq(config).astype(DTYPES_NP[dtype]), name=name)
            continue
        specs[name] = WeightSpec(parameter, transposed=False)
        transposes = [node for node, _ in value.uses() if node.op_type == "Transpose"]
        if transposes and len(transposes) == len(value.uses()) and len(value.shape) == 2:
            # fold Transpose(W): the transposed value becomes the initializer (what the exporter's optimizer does)
            shape = ir.Shape(list(reversed(list(value.shape))))
            # a stand-in value until the weights are written (nothing reads it: see below)
            folded = ir.Value(name=name, shape=shape, type=ir.TensorType(value.dtype),
                              const_value=ir.ExternalTensor("unwritten", 0, 0, value.dtype, shape=shape, name=name))
            graph.initializers.pop(name)
            for node in transposes:
                node.outputs[0].replace_all_uses_with(folded)
                graph.remove(node, safe=True)
            graph.register_initializer(folded)
            specs[name] = WeightSpec(parameter, transposed=True)
    for name in specs:  # no values: the optimizer cannot fold (read) a weight
        graph.initializers[name].const_value = None
    with M._quiet_loggers("onnx_ir", "onnxscript"):  # it says, per weight, that it cannot de-duplicate it
        onnxscript.optimizer.optimize_ir(program.model)
    return program.model, specs


def _rotary_inv_freq(config) -> np.ndarray:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(config).inv_freq.numpy()


class _WeightFile:
    """model.onnx.data written tensor by tensor: each in the model's dtype, in the graph's layout, its place kept."""

    def __init__(self, path: Path, specs: dict[str, WeightSpec], np_dtype):
        self.path, self.np_dtype = path, np_dtype
        self.by_parameter = {spec.parameter: (name, spec) for name, spec in specs.items()}
        self.placed: dict[str, tuple[int, int]] = {}  # initializer name -> (offset, length)
        self._file = open(path, "wb")

    def write(self, parameter: str, tensor: torch.Tensor) -> None:
        name, spec = self.by_parameter[parameter]
        array = tensor.detach().to(torch.float32).numpy().astype(self.np_dtype)
        if spec.transposed:
            array = np.ascontiguousarray(array.T)
        offset = -self._file.tell() % DATA_ALIGNMENT
        self._file.write(b"\0" * offset)
        self.placed[name] = (self._file.tell(), array.nbytes)
        self._file.write(array.tobytes())

    def attach(self, model, base_dir: Path) -> None:
        """Point each weight initializer at its bytes; refuses a model some weight was never written for."""
        import onnx_ir as ir

        self._file.close()
        missing = sorted(set(n for n, _ in self.by_parameter.values()) - set(self.placed))
        if missing:
            raise RuntimeError(f"weights never written: {missing[:5]}")
        for name, (offset, length) in self.placed.items():
            value = model.graph.initializers[name]
            value.const_value = ir.ExternalTensor(self.path.name, offset, length, value.dtype, shape=value.shape,
                                                  name=name, base_dir=base_dir)


def _normal(shape, std: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator) * std


def _norm_weight(size: int, generator: torch.Generator) -> torch.Tensor:
    return 1 + 0.1 * torch.randn(size, generator=generator)  # models._randomize_small's


def make_streamed_model(out_dir: Path, preset: str = "7b", sparsity: float | None = 0.9, skew: str | float = "zipf",
                        seed: int = 0, dtype: str = "fp16", log=lambda message: None,
                        **overrides) -> M.ModelFiles:
    """Make a LLaMA ReGLU model of `preset` into `out_dir` one layer at a time (see the module docstring)."""
    from transformers.masking_utils import create_causal_mask
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}")
    torch_dtype, np_dtype = DTYPES[dtype]
    arch, synth, token_over = M._split_overrides(overrides)
    synth = {**M.SYNTH_DEFAULTS, **synth}
    tok = {**STREAMED_TOKENS, **token_over}
    config = M.make_config("llama", preset, **arch)
    config.dtype = str(torch_dtype).removeprefix("torch.")
    if getattr(config, "hidden_act", "relu") != "relu" and sparsity is not None:
        raise ValueError(f"synthetic sparsity needs a ReLU FFN; hidden_act={config.hidden_act!r}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    graph_model, specs = export_graph(config, torch_dtype)
    exported = time.perf_counter()
    log(f"exported the {preset} graph (no weights) in {exported - started:.1f}s")

    d, ffn, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    std = float(config.initializer_range)
    avoid = M._avoid_ids(config)
    synth_ids = M.random_tokens(vocab, tok["n_seqs"], tok["seq_len"], seed + 1001, avoid)
    calib = M.random_tokens(vocab, tok["calib_seqs"] or tok["n_seqs"], tok["seq_len"], seed + 2001, avoid)
    heldout = M.random_tokens(vocab, tok["n_seqs"], tok["seq_len"], seed + 3001, avoid)
    calib_path = M.write_tokens(out_dir / "calib.npy", calib)
    heldout_path = M.write_tokens(out_dir / "heldout.npy", heldout)

    rng = np.random.default_rng(seed + 7)
    rank = int(synth["lowrank_rank"]) if synth["lowrank_rank"] else min(64, max(1, d // 4))
    target_p = (np.stack([M.activation_probs(ffn, 1 - sparsity, skew, synth["pmax"], rng)
                          for _ in range(config.num_hidden_layers)]) if sparsity is not None else None)
    bias_channel = int(rng.integers(d)) if sparsity is not None else None
    basis_dims = [i for i in range(d) if i != bias_channel]
    basis_generator = torch.Generator().manual_seed(seed + 2)
    rounded = lambda tensor: tensor.to(torch_dtype).to(torch.float32)  # the stored value, used from here on

    weights = _WeightFile(out_dir / "model.onnx.data", specs, np_dtype)
    generator = torch.Generator().manual_seed(seed)
    embedding = _normal((vocab, d), std, generator)
    if bias_channel is not None:  # the constant channel whose gate column acts as a bias (models.py's docstring)
        embedding[:, bias_channel] = 5.0 * std
    embedding = rounded(embedding)
    weights.write("model.embed_tokens.weight", embedding)
    states = {"synth": embedding[torch.as_tensor(synth_ids)], "heldout": embedding[torch.as_tensor(heldout)]}
    del embedding

    rotary = LlamaRotaryEmbedding(config)
    positions = torch.arange(tok["seq_len"])[None].expand(tok["n_seqs"], -1)
    position_embeddings = rotary(states["synth"], positions)
    mask = create_causal_mask(config=config, inputs_embeds=states["synth"],
                              attention_mask=torch.ones(tok["n_seqs"], tok["seq_len"], dtype=torch.long),
                              cache=None, position_ids=positions)
    achieved, active = [], []
    for index in range(config.num_hidden_layers):
        layer_started = time.perf_counter()
        layer = LlamaDecoderLayer(config, index).eval()
        prefix = f"model.layers.{index}."
        with torch.no_grad():
            for name, parameter in layer.named_parameters():
                parameter.copy_(_norm_weight(parameter.shape[0], generator) if name.endswith("layernorm.weight")
                                else _normal(parameter.shape, std, generator))
            if bias_channel is not None:
                layer.self_attn.o_proj.weight[bias_channel, :] = 0
                layer.mlp.down_proj.weight[bias_channel, :] = 0
                for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                    norm.weight[bias_channel] = norm.weight[bias_channel].abs().clamp_min(0.5)
            for parameter in layer.parameters():
                parameter.copy_(rounded(parameter))

        def calibrate(module, args, index=index, layer=layer):
            x = args[0].detach().reshape(-1, d).float()
            p = torch.from_numpy(target_p[index])
            basis = M._orthonormal_basis(d, rank, basis_dims, basis_generator)
            up = M._lowrank_plus_noise(x, basis, ffn, synth["predictability"], std, basis_generator, bias_channel)
            gate = M._lowrank_plus_noise(x, basis, ffn, synth["predictability"], std, basis_generator, bias_channel)
            gate[:, bias_channel] = M._bias_channel_column(x, gate, bias_channel, p)
            up[:, bias_channel] = std * torch.randn(ffn, generator=basis_generator)
            layer.mlp.gate_proj.weight.copy_(rounded(gate))
            layer.mlp.up_proj.weight.copy_(rounded(up))
            achieved.append(float((x @ layer.mlp.gate_proj.weight.T > 0).float().mean()))

        counts = []
        count = lambda module, args: counts.append((args[0].reshape(-1, ffn) != 0).sum(0).double())
        with torch.no_grad():
            hook = layer.mlp.register_forward_pre_hook(calibrate) if sparsity is not None else None
            states["synth"] = layer(states["synth"], attention_mask=mask, position_embeddings=position_embeddings,
                                    position_ids=positions)
            if hook is not None:
                hook.remove()
            hook = layer.mlp.down_proj.register_forward_pre_hook(count)
            states["heldout"] = layer(states["heldout"], attention_mask=mask, position_embeddings=position_embeddings,
                                      position_ids=positions)
            hook.remove()
        active.append((counts[0] / heldout.size).numpy())
        for name, parameter in layer.named_parameters():
            weights.write(prefix + name, parameter)
        del layer
        log(f"layer {index}: active {active[-1].mean():.4f} (held out) in {time.perf_counter() - layer_started:.1f}s")

    norm = _norm_weight(d, generator)
    if bias_channel is not None:
        norm[bias_channel] = norm[bias_channel].abs().clamp_min(0.5)
    weights.write("model.norm.weight", rounded(norm))
    weights.write("lm_head.weight", rounded(_normal((vocab, d), std, generator)))
    weights.attach(graph_model, out_dir)
    meta = {"picompile.exporter": "dynamo", "picompile.family": "llama", "picompile.preset": preset,
            "picompile.seed": str(seed), "picompile.maker_version": M.MAKER_VERSION, "picompile.streamed": "1",
            "picompile.synthetic_sparsity": "none" if sparsity is None else f"{sparsity} ({skew})"}
    if sparsity is not None:
        meta["picompile.predictability"] = str(synth["predictability"])
    graph_model.metadata_props.update(meta)
    _save_graph(graph_model, out_dir / "model.onnx")
    made = time.perf_counter()

    freq = np.stack(active)
    measured = M.summarise_activity(freq, int(heldout.size))
    stats_path = None
    report = None
    if sparsity is not None:
        stats_path = out_dir / "sparsity.npz"
        np.savez(stats_path, target_p=target_p.astype(np.float32), measured_freq=freq.astype(np.float32))
        report = dict(synthetic=True, sparsity=float(sparsity), skew=str(skew), alpha=M._parse_skew(skew),
                      pmax=synth["pmax"], lowrank_rank=rank, predictability=synth["predictability"],
                      bias_channel=bias_channel, calibration_tokens=int(synth_ids.size),
                      calibration_active_fraction=achieved, method="streamed: models.synthesize_sparsity's "
                      "llama method, layer by layer")
    layers, kv_heads, head_dim = M._kv_shape(config)
    inputs, outputs = M.io_names(config)
    n_params = sum(int(np.prod(graph_model.graph.initializers[name].shape)) for name in specs)
    config_json = dict(
        maker_version=M.MAKER_VERSION, family="llama", preset=preset, seed=seed, exporter="dynamo", opset=18,
        dtype=dtype, streamed=True, overrides=M._canonical(overrides), num_params=n_params,
        predictability=None if report is None else report["predictability"],
        calib_tokens=int(calib.size), synthetic_sparsity=report,
        measured_sparsity=dict(on="heldout.npy", **measured,
                               note=("synthetic sparsity designed by examples/streamed_models.py" if report else
                                     "dense-random model (no synthetic sparsity)")),
        onnx=dict(inputs=inputs, outputs=outputs, kv_heads=kv_heads, head_dim=head_dim, num_layers=layers,
                  position_ids=True, empty_past_ok=True),
        files=dict(onnx="model.onnx", calib=calib_path.name, heldout=heldout_path.name,
                   stats=stats_path.name if stats_path else None),
        # each weight initializer's transformers parameter, and whether it is stored transposed ([in, out])
        weights={name: dict(parameter=spec.parameter, transposed=spec.transposed) for name, spec in specs.items()},
        timing_s=dict(export=exported - started, weights=made - exported), hf_config=config.to_dict(),
    )
    (out_dir / "config.json").write_text(json.dumps(config_json, indent=1, default=M._json_default) + "\n")
    return M.ModelFiles.from_dir(out_dir)


def _save_graph(model, path: Path) -> None:
    """The graph with its weights left where they were written (onnx_ir keeps external tensors external)."""
    import onnx_ir as ir

    ir.save(model, path)
