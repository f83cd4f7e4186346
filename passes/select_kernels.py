"""select-kernels: lower each block of the IR to kernel calls (instruction selection).

Reads: the block IR after fuse and place (`picompile.Embed`, `Attention`, `FFN`, `Linear` (output layer),
norms; after lower `Predict` / `SparseFFN` / `MergePartial` (predictor mode) or `ThresholdFFN` /
`MergePartial` (threshold mode); Attention's `threshold_qkv` / `threshold_o` where set, each thresholded
projection lowered by `_Walker.thresholded_linear`), each node's `device` (from place) and fused `residual` input
(from fuse).
Adds: the kernel-call IR (`passes.kernel_ir`): one `runtime.calls.Call` per kernel call, saying what it
reads and how (whole, one row per token, the cached positions, only the selected rows), the buffers it
uses, the weights in the layout and precision their device reads (the CPU's matrices panel-packed and in
the build's weight format, `ctx.build`; the GPU's fp32 [K, N]) and, per kernel name, the spec the compile pass makes it from
(`decode` kernels for one token, `prefill` for a symbolic number of rows, `batch` for one token of each of
several sequences: the prefill kernel of a row-wise call, the decode kernel of a call run per sequence, a
kernel of its own for the predictor, select (the union of the sequences' neurons) and the CPU's fused sparse
FFN; a program with a GPU call, or a decode call without a batch kernel, gets no batch phase). Activation
buffers are shared by role across layers (layers run one after another); plan-buffers then gives each device
its instances.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field, replace
from typing import ClassVar

import numpy as np
import onnx_ir as ir
from onnx_ir.passes import PassResult

from . import ir as pir
from .errors import UserError
from .facts import ValueFact
from .pipeline import Context, Options
from .sizes import KV_CACHE_DTYPE, float_format, prefill_rows, weight_format
from runtime.calls import START, Access, Arg, Call, Role, Selection
from runtime.dtypes import WEIGHT_FORMATS, WeightFormat, itemsize

from .fuse import FUSED
from .kernel_ir import KERNEL_CALLS, KernelProgram, KernelSpec, carried_metadata
from .file_blocks import FileMatrix
from .kernels import cpu, kquant, kquant_columns, kquant_ops, neuron, ops, quant
from .place import PLACED, device_of
from .quantize import QuantizedMatrix, dequantizes_weight, kept_blocks
from .handover import HANDOVER, stage_of_node
from .ops import (Attention, Embed, FFN, Handover as HandoverOp, Linear, PostNorm, Softcap, SparseFFN, ThresholdFFN,
                  view as op_view)


@dataclass(frozen=True)
class BatchPhase(ValueFact):
    """How many sequences the program's batch step holds (0: it has no batch phase), for the manifest."""

    KEY: ClassVar[str] = "picompile.max_batch"
    max_batch: int

    @classmethod
    def missing(cls) -> "BatchPhase":
        return cls(0)


def read(buffer: str) -> Arg:
    return Arg(buffer)


def write(buffer: str) -> Arg:
    return Arg(buffer, Access.WRITE)


@dataclass
class Lowering:
    """Collects kernels (deduplicated by name), calls, weights and buffers while walking the block IR."""

    max_context: int  # the KV caches' length (and of the position tables)
    prefill_rows: int = 0  # rows of a row buffer: the most tokens one step computes (0: max_context)
    cpu_format: WeightFormat = WEIGHT_FORMATS["fp32"]  # --weight-dtype: storage of the CPU's large weights
    gemm_panels: int = 1  # weight panels per prefill GEMM register tile (from the CPU instruction set)
    int8_dot: str | None = None  # quantized decode GEMVs: the ISA's integer dot product over int8 activations, or None
    program: KernelProgram = field(default_factory=KernelProgram)
    # the quantize pass's matrices, by the name of their values' buffer (packed into a layout on first use)
    quantized: dict[str, QuantizedMatrix] = field(default_factory=dict)
    # matrices kept in a model file's own blocks (q4_k, ...: passes.file_blocks), packed from the file on first use
    kept: dict[str, FileMatrix] = field(default_factory=dict)
    device: str = "cpu"  # the device of the block being lowered
    layer: int | None = None  # ... and its layer
    stage: int = 0  # ... and its stage (a model split across machines: passes/handover.py)
    max_batch: int = 0  # sequences a batch step may hold (0: no batch phase)
    batch_rows: set[str] = field(default_factory=set)  # buffers of `max_batch` rows (step_rows)
    batch_widths: dict[str, int] = field(default_factory=dict)  # scratch sized per sequence (batch_scratch)
    # a linear whose batch step (its prefill GEMM over the batch's rows) costs more than a decode step per
    # sequence: a file's blocks with fp32 activations (the GEMM dequantizes every weight to fp32; Qwen2.5-0.5B
    # Q4_K_M on Zen 3, 2 / 4 sequences: a batch step 197 / 164 ms, decode steps 62 / 124 ms): the program then
    # gets no batch phase
    slow_batch: str | None = None

    @property
    def buffers(self) -> dict[str, dict]:
        return self.program.buffers

    @property
    def weights(self) -> dict[str, np.ndarray]:
        return self.program.weights

    def kernel(self, op: ops.KernelOp, base: str, *args, phases=("decode", "prefill"), batch: dict | None = None,
               **kwargs) -> tuple[str, str, str]:
        """The kernel's variants: (decode name, prefill name, batch name), "" for a phase it does not run in.

        A batch step (one token of each of several sequences) runs a kernel that runs in both decode and prefill
        as its prefill variant: row-wise, over symbolic rows, the same compiled code. `batch` asks for a batch
        variant of a decode-only kernel: the op's maker over symbolic rows, given these extra arguments."""
        names = []
        for rows, phase in ((1, "decode"), (None, "prefill")):
            name = f"{base}_{phase}" if phase in phases else ""
            if name and name not in self.program.kernels:
                self.program.kernels[name] = KernelSpec(op.name, rows, args, kwargs)
            names.append(name)
        if batch is not None:
            names.append(f"{base}_batch")
            self.program.kernels.setdefault(names[-1], KernelSpec(op.name, None, args, {**kwargs, **batch}))
        else:
            names.append(names[1] if names[0] else "")
        return names[0], names[1], names[2]

    def activation(self, name: str, width: int, dtype: str = "float32", rows: int | None = None) -> str:
        """A buffer of one row per token (`rows` fixes the row count, e.g. 1 for decode-only scratch)."""
        shape = [rows or self.prefill_rows or self.max_context, width]
        self.buffers.setdefault(name, {"kind": "activation", "shape": shape, "dtype": dtype})
        return name

    def step_rows(self, name: str, width: int, dtype: str = "float32") -> str:
        """A buffer of the one-token steps only (decode, and batch: a row per sequence of the batch), never
        prefill's: `max_batch` rows (cut to one by `drop_batch` where the program gets no batch phase)."""
        self.batch_rows.add(name)
        return self.activation(name, width, dtype, rows=max(1, self.max_batch))

    def scratch(self, name: str, shape: list[int], dtype: str = "float32") -> str:
        """A kernel's private work area: fixed shape (not one row per token), never copied between devices."""
        self.buffers.setdefault(name, {"kind": "scratch", "shape": list(shape), "dtype": dtype})
        return name

    def weight(self, name: str, array: np.ndarray, dtype: str = "float32", layout: str = "") -> str:
        """Store a weight (`layout` "panels" when panel-packed; the manifest shows it)."""
        self.weights[name] = np.ascontiguousarray(array, dtype=dtype)
        self.buffers[name] = {"kind": "weight", "shape": list(array.shape), "dtype": dtype}
        if layout:
            self.buffers[name]["layout"] = layout
        return name

    def stored_for(self, name: str, device: str) -> str:
        """A large float weight in its device's storage type (done once; later calls see it converted): the
        weight format's, or for a quantized build's matrices the quantize pass left in floats, fp16."""
        if name in self.quantized:
            return name
        if name in self.kept:  # read in no kq layout: its values in floats
            return self.as_floats(name)
        dtype = float_format(weight_format(device, self.cpu_format)).storage
        if self.buffers[name]["dtype"] != dtype:
            self.weight(name, self.weights[name], dtype, self.buffers[name].get("layout", ""))
        return name

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape of a weight (a matrix's [rows, columns]), however it is packed or quantized."""
        if name in self.quantized:
            return self.quantized[name].shape
        if name in self.kept:
            return self.kept[name].shape
        return self.matrix_shape(name) if self.buffers[name].get("layout") == "panels" else self.weights[name].shape

    def quantized_in(self, name: str, layout: str) -> tuple[str, str, QuantizedMatrix]:
        """A quantized matrix packed in `layout` ("quant_rows": blocks along each row, the rows a kernel gathers
        or a row-major GEMM reads; "quant_panels": a [K, N] linear's panels, blocks along K), stored once as
        two weights: its values and its scales (int4a: the scales and the mins together, as the layouts keep
        them). Returns (values, scales, matrix)."""
        matrix = self.quantized[name]
        axis, pack = {"quant_rows": (1, quant.pack_rows), "quant_panels": (0, quant.pack_panels)}[layout]
        if matrix.axis != axis:
            raise ValueError(f"{name} is blocked along axis {matrix.axis}; the {layout} layout needs axis {axis}")
        scales = f"{name}.scales"
        if name not in self.buffers:
            values, scale_array = pack(matrix.values, matrix.scales, matrix.fmt, matrix.mins)
            self.weight(name, values, values.dtype.name, layout)
            self.weight(scales, scale_array, scale_array.dtype.name, layout)
            for buffer in (name, scales):
                self.buffers[buffer].update(format=matrix.fmt.name, matrix=list(matrix.shape))
        elif self.buffers[name].get("layout") != layout:
            raise ValueError(f"{name} is read in two layouts ({self.buffers[name].get('layout')} and {layout})")
        return name, scales, matrix

    def kept_in(self, name: str, layout: str) -> tuple[str, str, WeightFormat]:
        """A matrix kept in the file's blocks packed in `layout` ("kq_panels": a [K, N] linear's panels;
        "kq_rows": a table's rows; "kq_columns": a thresholded [K, N]'s rows, one per input; `passes.kernels.kquant`),
        stored once as its values and its scales, straight
        from the file's bytes. Returns (values, scales, format)."""
        matrix = self.kept[name]
        fmt = matrix.stored_format()
        scales = f"{name}.scales"
        if name not in self.buffers:
            if layout == "kq_columns":  # (whole: its rows are the file's columns, packed across every file row)
                values, scale_bytes = kquant.pack_columns(matrix.blocks())
            else:
                values, scale_bytes = _packed(matrix, kquant.pack_panels if layout == "kq_panels" else kquant.pack_rows)
            self.weight(name, values, "uint8", layout)
            self.weight(scales, scale_bytes, "uint8", layout)
            for buffer in (name, scales):
                self.buffers[buffer].update(format=fmt.name, matrix=list(matrix.shape))
        elif self.buffers[name].get("layout") != layout:
            raise ValueError(f"{name} is read in two layouts ({self.buffers[name].get('layout')} and {layout})")
        return name, scales, fmt

    @staticmethod
    def quant_tag(matrix: QuantizedMatrix) -> tuple[str, dict]:
        """A quantized kernel's name suffix and its format arguments (int4a's: has_min)."""
        fmt = matrix.fmt
        tag = f"_q{fmt.bits}{'a' if fmt.has_min else ''}{'' if fmt.scale_dtype == 'float16' else '_s32'}"
        return tag, {"bits": fmt.bits, "sdtype": fmt.scale_dtype, **({"has_min": True} if fmt.has_min else {})}

    def row_bytes(self, name: str) -> int:
        """Bytes of one row of a row-major weight (its last axis)."""
        info = self.buffers[name]
        return info["shape"][-1] * itemsize(info["dtype"])

    def matrix_shape(self, name: str) -> tuple[int, int]:
        """[K, N] of a linear layer's weight, whether stored as [K, N] or panel-packed."""
        info = self.buffers[name]
        return (info["shape"][1], info["logical_columns"]) if info.get("layout") == "panels" else tuple(info["shape"])

    def pack(self, name: str) -> str:
        """Panel-pack a [K, N] weight for the CPU's linear kernels (once)."""
        info = self.buffers[name]
        if info.get("layout") != "panels":
            columns = info["shape"][1]
            self.weight(name, cpu.pack_panels(self.weights[name]), info["dtype"], "panels")
            self.buffers[name]["logical_columns"] = columns
        return name

    def call(self, label: str, kernels: tuple[str, str, str], args: list[Arg], role: Role, device: str | None = None,
             selection: Selection | None = None) -> None:
        call = Call(label, device or self.device, role, kernels[0], kernels[1], tuple(args), self.layer, selection,
                    kernels[2], self.stage)
        if call.per_sequence and call.decode:  # a batch step runs it per sequence: its decode kernel per row
            call = replace(call, batch=call.decode)
        self.program.calls.append(call)

    def batch_scratch(self, name: str, tasks: int, width: int) -> str:
        """A kernel's scratch of a `width` row per task and sequence of a batch step: [tasks, max_batch * width]
        (one sequence's where the program has no batch phase, or gets none: `drop_batch`)."""
        self.batch_widths[name] = width
        return self.scratch(name, [tasks, max(1, self.max_batch) * width])

    def drop_batch(self) -> None:
        """No batch phase (a call runs on the GPU, or a decode call has no batch kernel, or max_batch < 2): the
        calls lose their batch kernels, the kernels only they named go, and the step buffers keep one row."""
        self.program.calls[:] = [replace(call, batch="") for call in self.program.calls]
        named = {name for call in self.program.calls for name in (call.decode, call.prefill) if name}
        for name in [name for name in self.program.kernels if name not in named]:
            del self.program.kernels[name]
        for spec in self.program.kernels.values():  # (kernels sized for a batch's scratch: batch_scratch)
            spec.kwargs.pop("max_batch", None)
        for name in self.batch_rows:
            self.buffers[name]["shape"][0] = 1
        for name, width in self.batch_widths.items():
            self.buffers[name]["shape"][1] = width
        self.max_batch = 0

    def has_batch_phase(self) -> bool:
        """Every call runs on the CPU, every decode call has a batch kernel, and none is slower in a batch step
        than in a decode step per sequence (`slow_batch`)."""
        calls = self.program.calls
        return (self.max_batch > 1 and self.slow_batch is None and all(call.device == "cpu" for call in calls)
                and all(call.batch for call in calls if call.decode))

    def linear(self, x: str, weight: str, bias: str | None, out: str, label: str, role: Role,
               act: str = "none", residual: str | None = None, phases=("decode", "prefill"), device: str | None = None,
               packed: bool | None = None, skip_zero_rows: bool = False, batch: bool = False) -> None:
        """y = act(x @ W + b) + residual for W given in [K, N] layout (`batch`: a decode-only linear also runs in
        batch steps, over symbolic rows). On the CPU W is panel-packed (unless
        `packed` is False: rows a sparse kernel also gathers keep their layout) and stored in the weight dtype;
        the GPU reads [K, N] fp32. `skip_zero_rows` (CPU, [K, N] prefill only): x is a ReLU's output, and the
        rows of W that only its zeros multiply are not read (cpu.gemm_kn)."""
        device = device or self.device
        packed = device == "cpu" if packed is None else packed
        skip_zero_rows = skip_zero_rows and device == "cpu" and not packed and phases == ("prefill",)
        if weight in self.quantized:
            self.linear_quantized(x, weight, bias, out, label, role, act, residual, phases, device, packed,
                                  skip_zero_rows, batch)
            return
        if weight in self.kept:
            if packed is False or device != "cpu":
                self.as_floats(weight)
            elif self.kept[weight].stored_format() is None:
                self.linear_runs(x, weight, bias, out, label, role, act, residual, phases, batch)
                return
            else:
                self.linear_kept(x, weight, bias, out, label, role, act, residual, phases, batch)
                return
        self.stored_for(weight, device)
        if packed:
            self.pack(weight)
        k, n = self.matrix_shape(weight)
        dtype = self.buffers[weight]["dtype"]
        tags = (f"{'_panels' if packed else ''}{'_f16' if dtype == 'float16' else ''}{'_b' if bias else ''}"
                f"{'' if act == 'none' else '_' + act}{'_res' if residual else ''}")
        flags = dict(bias=bias is not None, act=act, residual=residual is not None)
        if dtype != "float32":
            flags["wdtype"] = dtype
        if skip_zero_rows:
            flags["skip_zero_rows"] = True
            tags += "_skip0"
        kernels = self.kernel(ops.linear_panels if packed else ops.linear, f"linear_k{k}_n{n}{tags}", k, n,
                              phases=phases, batch={} if batch else None, **flags, **self.gemm_tile(device))
        args = [read(x), read(weight)] + ([read(bias)] if bias else []) + ([read(residual)] if residual else []) + [write(out)]
        self.call(label, kernels, args, role, device)

    def linear_quantized(self, x: str, weight: str, bias: str | None, out: str, label: str, role: Role, act: str,
                         residual: str | None, phases, device: str, packed: bool, skip_zero_rows: bool,
                         batch: bool = False) -> None:
        """`linear` over a quantized matrix: panels blocked along K (decode GEMV, prefill GEMM), or, for rows a
        sparse kernel also gathers (`packed` False: the FFN parts' down rows), a prefill GEMM over the rows."""
        if device != "cpu":
            raise ValueError(f"{weight}: quantized weights are CPU-only for now")
        values, scales, matrix = self.quantized_in(weight, "quant_panels" if packed else "quant_rows")
        k, n = matrix.shape
        tag, fmt_args = self.quant_tag(matrix)
        if packed:
            if any(quant.int8_activations(matrix.fmt, self.int8_dot, self.gemm_panels, prompt=prompt)
                   for prompt in (False, True)):
                # decode quantizes x per block, and prefill each row of x, where the ISA has the kernel's form
                tag, fmt_args = f"{tag}_x8", {**fmt_args, "int8_dot": self.int8_dot}
            tags = f"{tag}{'_b' if bias else ''}{'' if act == 'none' else '_' + act}{'_res' if residual else ''}"
            kernels = self.kernel(ops.linear_panels_q, f"linear_q_k{k}_n{n}{tags}", k, n, phases=phases,
                                  batch={} if batch else None, bias=bias is not None, act=act,
                                  residual=residual is not None, **fmt_args,
                                  **self.gemm_tile(device))
        else:
            if "decode" in phases:
                raise ValueError(f"{weight}: the quantized rows GEMM is prefill-only")
            skip = {"skip_zero_rows": True} if skip_zero_rows else {}
            tags = (f"{tag}{'_b' if bias else ''}{'' if act == 'none' else '_' + act}{'_res' if residual else ''}"
                    f"{'_skip0' if skip else ''}")
            kernels = self.kernel(ops.linear_kn_q, f"linear_kn_q_k{k}_n{n}{tags}", k, n, phases=phases,
                                  bias=bias is not None, act=act, residual=residual is not None, **fmt_args, **skip,
                                  **self.gemm_tile(device))
        args = ([read(x), read(values), read(scales)] + ([read(bias)] if bias else [])
                + ([read(residual)] if residual else []) + [write(out)])
        self.call(label, kernels, args, role, device)

    def linear_kept(self, x: str, weight: str, bias: str | None, out: str, label: str, role: Role, act: str,
                    residual: str | None, phases, batch: bool = False) -> None:
        """`linear` over a matrix in a file's own blocks: the kq panels (decode GEMV and prefill GEMM, with int8
        activations where the ISA has an integer dot product: `kquant_ops.linear_panels_kq`)."""
        values, scales, fmt = self.kept_in(weight, "kq_panels")
        k, n = self.kept[weight].shape
        dot = {"int8_dot": self.int8_dot} if self.int8_dot else {}
        if "decode" in phases and not self.int8_dot:
            self.slow_batch = f"{fmt.name} weights with fp32 activations (their GEMM dequantizes every weight)"
        tags = (f"_{fmt.name}{'_x8' if dot else ''}{'_b' if bias else ''}{'' if act == 'none' else '_' + act}"
                f"{'_res' if residual else ''}")
        kernels = self.kernel(ops.linear_panels_kq, f"linear_kq_k{k}_n{n}{tags}", k, n, phases=phases,
                              batch={} if batch else None, fmt=fmt.name, bias=bias is not None, act=act,
                              residual=residual is not None, **dot, **self.gemm_tile("cpu"))
        args = ([read(x), read(values), read(scales)] + ([read(bias)] if bias else [])
                + ([read(residual)] if residual else []) + [write(out)])
        self.call(label, kernels, args, role, "cpu")

    def linear_columns(self, x: str, weight: str, bias: str | None, out: str, label: str, role: Role, act: str,
                       residual: str | None) -> None:
        """The prefill `linear` of a thresholded matrix kept in the file's blocks: a GEMM over the rows its decode
        gathers (`kquant_columns.linear_columns_kq`), so that the matrix is stored once."""
        values, scales, fmt = self.kept_in(weight, "kq_columns")
        k, n = self.kept[weight].shape
        tags = f"_{fmt.name}{'_b' if bias else ''}{'' if act == 'none' else '_' + act}{'_res' if residual else ''}"
        kernels = self.kernel(ops.linear_columns_kq, f"linear_columns_kq_k{k}_n{n}{tags}", k, n, phases=("prefill",),
                              fmt=fmt.name, bias=bias is not None, act=act, residual=residual is not None)
        args = ([read(x), read(values), read(scales)] + ([read(bias)] if bias else [])
                + ([read(residual)] if residual else []) + [write(out)])
        self.call(label, kernels, args, role, "cpu")

    def linear_runs(self, x: str, weight: str, bias: str | None, out: str, label: str, role: Role, act: str,
                    residual: str | None, phases, batch: bool = False) -> None:
        """`linear` over a file matrix stored run by run (q and k in Q4_K, v in Q6_K): each run's columns by the
        kernels of its own format into a buffer of their own, then side by side into `out` (concat_columns)."""
        matrix = self.kept.pop(weight)
        if act != "none" or residual is not None:
            raise ValueError(f"{weight}: a linear stored in runs takes no activation or residual")
        parts, start = [], 0
        for index, run in enumerate(matrix.runs()):
            name, width = f"{weight}.run{index}", run.shape[1]
            part_bias = None
            if bias is not None:  # each run adds its slice of the bias (the whole one is dropped below)
                part_bias = self.weight(f"{bias}.run{index}", self.weights[bias][start: start + width])
            if run.stored_format().kept_from_file:
                self.kept[name] = run
            else:  # int8 / int4 / int4a: the quant kernels over the run's blocks
                blocks = run.blocks()
                self.quantized[name] = QuantizedMatrix(blocks.values(), blocks.scales, 0, run.stored_format(),
                                                       blocks.mins)
            parts.append(self.activation(f"{out}.run{index}", width))
            self.linear(x, name, part_bias, parts[-1], f"{label}.run{index}", role, phases=phases, batch=batch)
            start += width
        if bias is not None:
            del self.weights[bias], self.buffers[bias]
        widths = [self.buffers[p]["shape"][-1] for p in parts]
        kernels = self.kernel(ops.concat_columns, f"concat_{'_'.join(map(str, widths))}", widths, phases=phases,
                              batch={} if batch else None)
        self.call(f"{label}.concat", kernels, [*map(read, parts), write(out)], role, "cpu")

    def as_floats(self, name: str) -> str:
        """A kept matrix where a kernel reads it in no kq layout (a GPU's, a sparse kernel's rows): its values, in
        floats, as any float weight (the build's float format)."""
        self.weight(name, self.kept.pop(name).dequantize(), "float32")
        return self.stored_for(name, self.device)

    def gemm_tile(self, device: str) -> dict:
        """The prefill GEMMs' register tile for `device`: wider on CPUs whose instruction set allows it."""
        return {"tile_panels": self.gemm_panels} if device == "cpu" and self.gemm_panels != 1 else {}

    def glu(self, pre: str, hidden: str, neurons: int, activation: str, label: str, device: str | None = None,
            phases=("decode", "prefill")) -> None:
        """A gated FFN's hidden = act(gate) * up, from `pre` holding the gate and up halves side by side."""
        kernels = self.kernel(ops.glu, f"glu_f{neurons}_{activation}", neurons, act=activation, phases=phases)
        self.call(label, kernels, [read(pre), write(hidden)], Role.FFN_UP, device)

    def zeros(self, name: str, size: int) -> str:
        """A zero bias, so that biased and bias-free models share one kernel shape."""
        return self.weight(name, np.zeros(size, np.float32))


PACK_LINES = 8192  # file rows decoded and packed at a time (a multiple of the panels' 16): bounds the transients


def _packed(matrix: FileMatrix, pack) -> tuple[np.ndarray, np.ndarray]:
    """`pack`'s (values, scales) of a file matrix, decoded and packed PACK_LINES of its file rows at a time (a
    vocabulary-wide table's decoding would otherwise hold several times its packed size at once)."""
    lines = matrix.shape[1] if matrix.transposed else matrix.shape[0]
    chunks = [pack(matrix.take(np.arange(begin, min(begin + PACK_LINES, lines))).blocks())
              for begin in range(0, lines, PACK_LINES)]
    return tuple(np.ascontiguousarray(np.concatenate(arrays)) if len(arrays) > 1 else arrays[0]
                 for arrays in zip(*chunks))


def _tag(value: float) -> str:
    """A float in a kernel's name (a C identifier): 0.25 -> 0p25, 1e-05 -> 1em05."""
    return f"{value:.9g}".replace(".", "p").replace("-", "m").replace("+", "")


def _residual(node: ir.Node) -> ir.Value | None:
    """The skip connection fuse folded into the block (its last input), or None."""
    return node.inputs[-1] if op_view(node).residual else None


class _Walker:
    """Lowers the block IR node by node, tracking which buffer holds each block-IR value."""

    def __init__(self, lowering: Lowering):
        self.low = lowering
        self.location: dict[str, str] = {}  # block-IR value name -> buffer name
        self.residual_turn = 0

    def weight_of(self, value: ir.Value | None) -> str | None:
        """The buffer of a weight input: a constant's own name, or for the quantize pass's DequantizeLinear
        the name of its values (the matrix is packed when a kernel first reads it)."""
        if value is None:
            return None
        matrix = QuantizedMatrix.of(value)
        if matrix is not None:
            name = value.producer().inputs[0].name
            self.low.quantized.setdefault(name, matrix)
            return name
        if value.name in self.low.weights or value.name in self.low.kept:
            return value.name
        held = kept_blocks(value)
        if held is not None:  # the quantize pass stores it in the file's own blocks
            self.low.kept[value.name] = held
            value.const_value = None
            return value.name
        array = pir.const_array(value)
        if array is None:
            raise UserError(f"{value.name} must be a constant weight")
        # an fp16 matrix stays fp16 until `stored_for` gives it its device's format (never a widened copy)
        self.low.weight(value.name, array, "float16" if array.dtype == np.float16 else "float32")
        if value.is_initializer():  # the kernel program holds it now: a packed copy may replace it, not join it
            value.const_value = None
        return value.name

    def next_residual(self, width: int) -> str:
        """The residual stream alternates between two buffers (a linear reads one and writes the other)."""
        self.residual_turn ^= 1
        return self.low.activation(f"act.residual{self.residual_turn}", width)

    def output_for(self, node: ir.Node, width: int) -> tuple[str, str | None]:
        """Where a block writes, and the residual its epilogue adds (fuse folded it in)."""
        skip = _residual(node)
        if skip is None:
            return self.low.activation(f"act.{node.name}", width), None
        return self.next_residual(width), self.location[skip.name]

    def lower(self, node: ir.Node, layer: int | None) -> None:
        if dequantizes_weight(node):  # the quantize pass's weights: no call; the blocks that read one store it
            return
        handler = getattr(self, f"lower_{node.op_type}", None)
        if handler is None:
            raise UserError(f"select-kernels: no kernel for {node.domain or 'onnx'}.{node.op_type} ({node.name})")
        self.low.device = device_of(node)
        self.low.layer = layer
        self.low.stage = stage_of_node(node)
        handler(node)

    def lower_Embed(self, node: ir.Node) -> None:
        table = self.weight_of(node.inputs[2])
        if not (table in self.low.kept and not self.low.kept[table].transposed):  # else the file's rows
            table = self.low.stored_for(table, self.low.device)
        positions = self.weight_of(node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] is not None else None
        vocab, width = self.low.shape(table)
        out = self.next_residual(width)
        scale = float(Embed(node).scale)
        scaled = {"scale": scale} if scale != 1.0 else {}  # (Gemma's sqrt(d_model): the kernel's name says it)
        base = f"embed_v{vocab}_d{width}{'_pos' if positions else ''}{f'_x{_tag(scale)}' if scaled else ''}"
        pos_args = self.low.max_context if positions else None
        if table in self.low.kept and not self.low.kept[table].transposed:  # the file's rows, in its blocks
            values, scales, fmt = self.low.kept_in(table, "kq_rows")
            kernels = self.low.kernel(ops.embed_kq, f"{base}_{fmt.name}", vocab, width, positions=pos_args,
                                      fmt=fmt.name, **scaled)
            tables = [values, scales]
        elif table in self.low.quantized:  # the table's rows, blocked along each row, and their scales
            values, scales, matrix = self.low.quantized_in(table, "quant_rows")
            tag, fmt_args = self.low.quant_tag(matrix)
            kernels = self.low.kernel(ops.embed_q, base + tag, vocab, width, positions=pos_args, **fmt_args, **scaled)
            tables = [values, scales]
        else:
            dtype = self.low.buffers[table]["dtype"]
            kernels = self.low.kernel(ops.embed, base + ("_f16" if dtype == "float16" else ""), vocab, width,
                                      positions=pos_args, **({"wdtype": dtype} if dtype != "float32" else {}),
                                      **scaled)
            tables = [table]
        if positions:  # the kernel indexes positions up to max_context: store exactly that many rows
            self.low.weight(positions, self.low.weights[positions][: self.low.max_context])
        gathered = [Arg(t, Access.GATHER, row_bytes=self.low.row_bytes(t)) for t in tables]
        if positions:
            gathered += [Arg(positions, Access.GATHER, row_bytes=self.low.row_bytes(positions)), Arg(START)]
        self.low.call(node.name, kernels, [read("input_ids"), *gathered, write(out)], Role.EMBED)
        self.location[node.outputs[0].name] = out

    def _norm(self, node: ir.Node, kind: str) -> None:
        scale = self.weight_of(node.inputs[1])
        bias = self.weight_of(node.inputs[2]) if kind == "layer" else None
        width = self.low.weights[scale].shape[0]
        eps = float(pir.attr(node, "epsilon", 1e-5))
        out = self.low.activation("act.norm", width)
        op = ops.layer_norm if kind == "layer" else ops.rms_norm
        kernels = self.low.kernel(op, f"{kind}_norm_d{width}_eps{eps:.0e}".replace("-", "m"), width, eps)
        args = [read(self.location[node.inputs[0].name]), read(scale)] + ([read(bias)] if bias else []) + [write(out)]
        self.low.call(node.name, kernels, args, Role.NORM)
        self.location[node.outputs[0].name] = out

    def lower_PostNorm(self, node: ir.Node) -> None:
        """A norm of a block's output with the residual Add fuse folded in (Gemma's post-norms): one rms_norm call
        that adds the skip, writing the residual stream's next buffer."""
        scale = self.weight_of(node.inputs[1])
        width = self.low.weights[scale].shape[0]
        eps = float(PostNorm(node).epsilon)
        out, residual = self.output_for(node, width)
        kernels = self.low.kernel(ops.rms_norm, f"rms_norm_d{width}_eps{eps:.0e}_res".replace("-", "m"), width, eps,
                                  residual=residual is not None)
        args = [read(self.location[node.inputs[0].name]), read(scale)] + ([read(residual)] if residual else []) + [write(out)]
        self.low.call(node.name, kernels, args, Role.NORM)
        self.location[node.outputs[0].name] = out

    def lower_Softcap(self, node: ir.Node) -> None:
        """The logits' soft-cap (Gemma 2), from the output layer's buffer into the logits."""
        x = self.location[node.inputs[0].name]
        width = self.low.buffers[x]["shape"][1]
        cap = float(Softcap(node).cap)
        out = self.low.activation("logits", width)
        kernels = self.low.kernel(ops.softcap, f"softcap_n{width}_c{_tag(cap)}", width, cap)
        self.low.call(node.name, kernels, [read(x), write(out)], Role.HEAD)
        self.location[node.outputs[0].name] = out

    def lower_LayerNormalization(self, node: ir.Node) -> None:
        self._norm(node, "layer")

    def lower_RMSNormalization(self, node: ir.Node) -> None:
        self._norm(node, "rms")

    def lower_Attention(self, node: ir.Node) -> None:
        attention = Attention(node)
        layer = attention.layer
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        scale = attention.scale
        x = self.location[node.inputs[0].name]
        w_qkv, b_qkv = self.weight_of(node.inputs[4]), self.weight_of(node.inputs[5])
        w_o, b_o = self.weight_of(node.inputs[6]), self.weight_of(node.inputs[7])
        inv_freq = pir.const_array(attention.input("inv_freq")) if attention.input("inv_freq") is not None else None
        # each head's query and key RMS-normed before RoPE (Qwen3): in the same kernel, which reads each head once
        norms = [self.weight_of(attention.input(name)) for name in ("q_norm", "k_norm")
                 if attention.input(name) is not None]
        if len(norms) not in (0, 2) or bool(norms) != (attention.qk_norm_eps is not None):
            raise ValueError(f"{node.name}: a per-head q / k norm needs both weights and qk_norm_eps")
        norm_eps = {"qk_norm_eps": float(attention.qk_norm_eps)} if norms else {}
        ctx = self.low.max_context
        qkv = self.low.activation("act.qkv", (heads + 2 * kv_heads) * head_dim)
        q = self.low.activation("act.q", heads * head_dim)
        attn = self.low.activation("act.attn", heads * head_dim)
        key_cache, value_cache = f"cache.{layer}.key", f"cache.{layer}.value"
        for name in (key_cache, value_cache):
            self.low.buffers[name] = {"kind": "cache", "shape": [kv_heads, ctx, head_dim], "dtype": KV_CACHE_DTYPE}
        p = node.name
        t_qkv, t_o = float(attention.threshold_qkv), float(attention.threshold_o)
        if t_qkv >= 0:  # decode reads only the rows of the normed x's kept channels
            self.thresholded_linear(p, "qkv", x, w_qkv, b_qkv, qkv, t_qkv, Role.ATTENTION)
        else:
            self.low.linear(x, w_qkv, b_qkv, qkv, f"{p}.qkv", Role.ATTENTION)
        rope_args = []
        if inv_freq is not None:
            angles = np.arange(ctx, dtype=np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
            rope_args = [self.shared_table("rope.cos", np.cos(angles)), self.shared_table("rope.sin", np.sin(angles))]
        # the kernel holds eps as a float32 constant: 9 digits name that exactly (kernels are shared by name)
        norm_tag = (f"_qknorm_eps{np.float32(attention.qk_norm_eps):.9g}".replace("-", "m").replace(".", "p")
                    if norms else "")
        kernels = self.low.kernel(ops.rope_kv_write,
                                  f"rope_kv_h{heads}_kv{kv_heads}_d{head_dim}{'_rope' if rope_args else ''}{norm_tag}",
                                  heads, kv_heads, head_dim, ctx, rope=bool(rope_args), **norm_eps)
        tables = [Arg(table, Access.GATHER, row_bytes=self.low.row_bytes(table)) for table in rope_args]
        self.low.call(f"{p}.rope_kv", kernels, [read(qkv), *tables, *(read(w) for w in norms),
                                                Arg(key_cache, Access.UPDATE), Arg(value_cache, Access.UPDATE),
                                                write(q), Arg(START)], Role.ATTENTION)
        softcap, window = float(attention.softcap), int(attention.window)
        shaped = {**({"softcap": softcap} if softcap else {}), **({"window": window} if window else {})}
        # (a kernel's name is its spec: the scale is named where it is not 1/sqrt(head_dim), the default of every
        # model before Gemma's, or where the scores are capped or windowed)
        plain = abs(scale - float(head_dim) ** -0.5) <= 1e-6 * scale and not shaped
        tags = (f"{f'_cap{_tag(softcap)}' if softcap else ''}{f'_w{window}' if window else ''}"
                f"{'' if plain else f'_s{_tag(scale)}'}")
        kernels = self.low.kernel(ops.attention, f"attention_h{heads}_kv{kv_heads}_d{head_dim}{tags}", heads,
                                  kv_heads, head_dim, ctx, scale, **shaped)
        self.low.call(f"{p}.attention", kernels, [read(q), Arg(key_cache, Access.CONTEXT),
                                                  Arg(value_cache, Access.CONTEXT), write(attn), Arg(START)],
                      Role.ATTENTION)
        out, residual = self.output_for(node, self.low.shape(w_o)[1])
        if t_o >= 0:  # ... of the attention output's kept channels, the residual added in the epilogue
            self.thresholded_linear(p, "o", attn, w_o, b_o, out, t_o, Role.ATTENTION, residual=residual)
        else:
            self.low.linear(attn, w_o, b_o, out, f"{p}.o", Role.ATTENTION, residual=residual)
        self.location[node.outputs[0].name] = out
        self.location[node.outputs[1].name], self.location[node.outputs[2].name] = key_cache, value_cache

    def shared_table(self, name: str, table: np.ndarray) -> str:
        """RoPE tables are the same for every layer of most models: store one copy of each distinct table (Gemma's
        sliding and global layers have a base each, so two), shared by the layers computing it."""
        stored = table.astype(np.float32)
        for other in [name, *(n for n in self.low.weights if n.startswith(name + "."))]:
            existing = self.low.weights.get(other)
            if existing is not None and np.array_equal(existing, stored):
                return other
        if name in self.low.weights:
            name = f"{name}.{len(self.low.weights)}"
        return self.low.weight(name, table)

    def lower_FFN(self, node: ir.Node) -> None:
        ffn = FFN(node)
        activation, gated = ffn.activation, bool(ffn.gated)
        x = self.location[node.inputs[0].name]
        w_up, b_up = self.weight_of(node.inputs[1]), self.weight_of(node.inputs[2])
        w_down, b_down = self.weight_of(node.inputs[3]), self.weight_of(node.inputs[4])
        width_up = self.low.shape(w_up)[1]
        ffn_width = width_up // 2 if gated else width_up
        p = node.name
        if gated:
            pre = self.low.activation("act.ffn_pre", width_up)
            self.low.linear(x, w_up, b_up, pre, f"{p}.up", Role.FFN_UP)
            hidden = self.low.activation("act.ffn_hidden", ffn_width)
            self.low.glu(pre, hidden, ffn_width, activation, f"{p}.glu")
        else:
            hidden = self.low.activation("act.ffn_hidden", ffn_width)
            self.low.linear(x, w_up, b_up, hidden, f"{p}.up", Role.FFN_UP, act=activation)
        out, residual = self.output_for(node, self.low.shape(w_down)[1])
        self.low.linear(hidden, w_down, b_down, out, f"{p}.down", Role.FFN_DOWN, residual=residual)
        self.location[node.outputs[0].name] = out

    def lower_Predict(self, node: ir.Node) -> None:
        """The predictor runs for one-token steps only (decode, batch): prompts compute every neuron."""
        x, w1 = self.location[node.inputs[0].name], self.weight_of(node.inputs[1])
        rank = self.low.shape(w1)[1]
        hidden = self.low.step_rows(f"act.predictor_hidden.r{rank}", rank)
        self.low.linear(x, w1, None, hidden, f"{node.name}.fc1", Role.PREDICTOR, act="relu", phases=("decode",),
                        batch=True)
        for w2_value, scores in zip(node.inputs[2:], node.outputs):
            w2 = self.weight_of(w2_value)
            width = self.low.shape(w2)[1]
            out = self.low.step_rows(f"act.scores.n{width}", width)
            self.low.linear(hidden, w2, None, out, f"{scores.name}.fc2", Role.PREDICTOR, phases=("decode",),
                            batch=True)
            self.location[scores.name] = out

    def lower_SparseFFN(self, node: ir.Node) -> None:
        sparse = SparseFFN(node)
        part, neurons = sparse.part, sparse.neurons
        device = self.low.device
        activation, gated = sparse.activation, bool(sparse.gated)
        x, scores = self.location[node.inputs[0].name], self.location[node.inputs[1].name]
        up_rows, up_bias = self.weight_of(node.inputs[2]), self.weight_of(node.inputs[3])
        down_rows = self.weight_of(node.inputs[4])
        width = self.low.shape(down_rows)[1]
        d_in = self.low.shape(up_rows)[1]
        p, tag = node.name, f"{part}.n{neurons}"
        partial = self.low.activation(f"act.partial.{part}", width)
        # one-token steps: predicted neurons only
        threshold = self.low.weight(f"{p}.threshold", np.array([sparse.threshold], np.float32))
        index = self.low.activation(f"act.ffn_index.{tag}", neurons, dtype="int32", rows=1)
        count = self.low.activation(f"act.ffn_count.{part}", 1, dtype="int32", rows=1)
        hidden = self.low.step_rows(f"act.ffn_sparse_hidden.{tag}", neurons)  # a row per sequence of a batch
        up_width = self.low.shape(up_rows)[0]
        up_bias = up_bias or self.low.zeros(f"{p}.up_bias", up_width)
        gate_tag = "_gated" if gated else ""
        quantized = up_rows in self.low.quantized
        if quantized != (down_rows in self.low.quantized) or (
                quantized and self.low.quantized[up_rows].fmt != self.low.quantized[down_rows].fmt):
            raise ValueError(f"{p}: the fused sparse FFN reads its up and down rows in one format")
        if quantized:  # each row's values and its scales, blocked along the row
            *up_parts, matrix = self.low.quantized_in(up_rows, "quant_rows")
            *down_parts, _ = self.low.quantized_in(down_rows, "quant_rows")
            dtype_tag, dtype_arg = self.low.quant_tag(matrix)
            tile = self.low.gemm_tile(device).get("tile_panels", 1)
            dot = self.low.int8_dot
            if device == "cpu" and dot and neuron.int8_dot_fits(d_in, matrix.fmt.bits, dot, tile):
                # the up rows' dots over int8-quantized x (decode only: the prefill GEMMs stay fp32)
                decode_tag, decode_arg = f"{dtype_tag}_x8", {**dtype_arg, "int8_dot": dot, "tile_panels": tile}
            else:
                decode_tag, decode_arg = dtype_tag, dtype_arg
        else:
            up_parts, down_parts = [self.low.stored_for(up_rows, device)], [self.low.stored_for(down_rows, device)]
            dtype = self.low.buffers[up_rows]["dtype"]
            dtype_tag, dtype_arg = ("_f16", {"wdtype": dtype}) if dtype != "float32" else ("", {})
            decode_tag, decode_arg = dtype_tag, dtype_arg
        halves = 2 if gated else 1  # up rows per neuron: gate and up when gated
        bias_row = halves * itemsize(self.low.buffers[up_bias]["dtype"])
        # a batch step selects the union: the neurons any of its sequences' scores let through
        kernels = self.low.kernel(ops.select, f"select_n{neurons}", neurons, phases=("decode",), batch={})
        self.low.call(f"{p}.select", kernels, [read(scores), read(threshold), write(index), write(count)], Role.PREDICTOR)
        selected = [read(x), read(index), read(count)]
        if device == "cpu":  # up and down in one pass over the rows
            # a batch step's kernel holds a scratch row per task and sequence (so decode's, sharing the buffer,
            # takes its [tasks, max_batch * width] shape too and uses the first width columns)
            batch = self.low.max_batch > 1
            scratch = self.low.batch_scratch(f"scratch.ffn.d{width}", neuron.FFN_TASKS, width)
            fired = self.low.scratch(f"scratch.ffn_fired.n{neurons}", [1, neurons], "int32")
            # batch steps: each selected neuron's rows read once for all the sequences of the batch, their dot
            # products in fp32 (int8_dot quantizes one x per call), as prefill's GEMMs take them
            batch_args = {"max_batch": self.low.max_batch} if batch else {}
            kernels = self.low.kernel(ops.sparse_ffn_q if quantized else ops.sparse_ffn,
                                      f"sparse_ffn_d{d_in}_n{neurons}{gate_tag}_{activation}{decode_tag}",
                                      d_in, neurons, gated=gated, act=activation, phases=("decode",),
                                      batch=({"int8_dot": None} if "int8_dot" in decode_arg else {}) if batch else None,
                                      **decode_arg, **batch_args)
            # With ReLU a neuron whose first row (the gate's when gated) gives 0 is done: its other rows are not read.
            skips = activation == "relu"

            def up_read(buffer: str) -> Arg:
                row = self.low.row_bytes(buffer)
                return Arg(buffer, Access.SELECTED_ROWS, row_bytes=row if skips else halves * row,
                           nonzero_row_bytes=(halves - 1) * row if skips else 0)

            def down_read(buffer: str) -> Arg:
                row = self.low.row_bytes(buffer)
                return Arg(buffer, Access.SELECTED_ROWS, row_bytes=0 if skips else row, nonzero_row_bytes=row if skips else 0)

            reads = [*map(up_read, up_parts), Arg(up_bias, Access.SELECTED_ROWS, row_bytes=bias_row),
                     *map(down_read, down_parts)]
            self.low.call(f"{p}.up_down", kernels, [*selected, *reads, write(hidden), write(fired), write(scratch),
                                                    write(partial)], Role.FFN,
                          selection=Selection("predictor", part, count, neurons, hidden if skips else None))
        else:
            row = self.low.row_bytes(up_rows)
            kernels = self.low.kernel(ops.sparse_up, f"sparse_up_d{d_in}_n{neurons}{gate_tag}_{activation}{dtype_tag}",
                                      d_in, neurons, gated=gated, act=activation, phases=("decode",), **dtype_arg)
            self.low.call(f"{p}.up", kernels, [*selected, Arg(up_rows, Access.SELECTED_ROWS, row_bytes=halves * row),
                                               Arg(up_bias, Access.SELECTED_ROWS, row_bytes=bias_row), write(hidden)],
                          Role.FFN_UP, selection=Selection("predictor", part, count, neurons))
            kernels = self.low.kernel(ops.sparse_down, f"sparse_down_n{neurons}_d{width}{dtype_tag}", neurons, width,
                                      phases=("decode",), **dtype_arg)
            self.low.call(f"{p}.down", kernels, [read(hidden), read(index), read(count),
                                                 Arg(down_rows, Access.SELECTED_ROWS, row_bytes=self.low.row_bytes(down_rows)),
                                                 write(partial)],
                          Role.FFN_DOWN, selection=Selection("predictor", part, count, neurons))
        # multi-token steps: every neuron of the part, as dense GEMMs over the same row-major weights
        pre = self.low.activation(f"act.ffn_pre.{tag}", up_width)
        up_act = "none" if gated else activation
        kernels = self.low.kernel(ops.linear_rows_q if quantized else ops.linear_rows,
                                  f"linear_rows_k{d_in}_n{up_width}_{up_act}{dtype_tag}", d_in, up_width, act=up_act,
                                  phases=("prefill",), **dtype_arg, **self.low.gemm_tile(device))
        self.low.call(f"{p}.up_dense", kernels, [read(x), *map(read, up_parts), read(up_bias), write(pre)], Role.FFN_UP)
        if gated:
            dense_hidden = self.low.activation(f"act.ffn_dense_hidden.{tag}", neurons)
            self.low.glu(pre, dense_hidden, neurons, activation, f"{p}.glu", phases=("prefill",))
            pre = dense_hidden
        # with ReLU most hidden values are exact zeros, and a neuron no token of the prompt fired needs no down row
        self.low.linear(pre, down_rows, None, partial, f"{p}.down_dense", Role.FFN_DOWN, phases=("prefill",),
                        packed=False, skip_zero_rows=activation == "relu")
        self.location[node.outputs[0].name] = partial

    def lower_ThresholdFFN(self, node: ir.Node) -> None:
        """Each projection whose threshold is >= 0 goes through `thresholded_linear` (decode: the kept input
        channels' rows of its [K, N] weight; gate and up in one column-sparse GEMV over w_up [D, 2F], the GLU on
        its sums); one whose threshold is < 0 (KEEP_ALL: the plan runs it dense) is a dense panel linear (the
        gated up's GLU after it) in both phases."""
        thresholded = ThresholdFFN(node)
        activation, gated = thresholded.activation, bool(thresholded.gated)
        x = self.location[node.inputs[0].name]
        w_up, b_up, w_down = self.weight_of(node.inputs[1]), self.weight_of(node.inputs[2]), self.weight_of(node.inputs[3])
        up_width = self.low.shape(w_up)[1]
        neurons, width = self.low.shape(w_down)
        p = node.name
        partial = self.low.activation("act.partial.cpu", width)
        hidden = self.low.activation(f"act.ffn_hidden.f{neurons}", neurons)
        t_in, t_down = float(thresholded.threshold_in), float(thresholded.threshold_down)
        if t_in >= 0:
            self.thresholded_linear(p, "up", x, w_up, b_up, hidden, t_in, Role.FFN_UP, glu=gated, act=activation)
        elif gated:
            pre = self.low.activation(f"act.ffn_pre.n{up_width}", up_width)
            self.low.linear(x, w_up, b_up, pre, f"{p}.up", Role.FFN_UP)
            self.low.glu(pre, hidden, neurons, activation, f"{p}.glu")
        else:
            self.low.linear(x, w_up, b_up, hidden, f"{p}.up", Role.FFN_UP, act=activation)
        if t_down >= 0:
            self.thresholded_linear(p, "down", hidden, w_down, None, partial, t_down, Role.FFN_DOWN)
        else:
            self.low.linear(hidden, w_down, None, partial, f"{p}.down", Role.FFN_DOWN)
        self.location[node.outputs[0].name] = partial

    def thresholded_linear(self, p: str, part: str, v: str, weight: str, bias: str | None, out: str, threshold: float,
                           role: Role, glu: bool = False, act: str = "none", residual: str | None = None,
                           kept: float | None = None) -> None:
        """out = act(v' @ W + b) (+ residual) for W [K, N] stored one row per input channel, v' = v with the
        entries |v| <= threshold zeroed (`glu`: W = [gate | up], out the GLU of the two halves' sums).
        Decode: select_abs keeps the channels, sparse_columns (sparse_columns_q over quantized rows: values and
        scales, blocked along each row) reads only their rows; a batch step the union of the sequences' kept
        channels, each row read once for all of them. Prompts: dense GEMMs over the same rows (a quantized
        matrix's: linear_kn_q), the GLU after. `kept`: the share of the inputs it is expected to keep where no layer
        report holds it (the output layer's)."""
        low = self.low
        rows, columns = low.shape(weight)
        threshold_buffer = low.weight(f"{p}.threshold_{part}", np.array([threshold], np.float32))
        index = low.activation(f"act.kept_index.n{rows}", rows, dtype="int32", rows=1)
        count = low.activation("act.kept_count", 1, dtype="int32", rows=1)
        batch = low.max_batch > 1
        kernels = low.kernel(ops.select, f"select_abs_n{rows}", rows, magnitude=True, phases=("decode",),
                             batch={} if batch else None)
        low.call(f"{p}.{part}_select", kernels, [read(v), read(threshold_buffer), write(index), write(count)], role)
        scratch_kind, scratch_width = "columns", columns  # (a task's partial sums, a row per sequence)
        flags = {"gated": glu, "act": act, "bias": bias is not None, "residual": residual is not None}
        tags = f"{'_gated' if glu else ''}_{act}{'_b' if bias else ''}{'_res' if residual else ''}"
        batch_args = {"max_batch": low.max_batch} if batch else {}
        whole = []  # buffers read whole (the kept blocks' scales: a block's record serves every kept input of it)
        if weight in low.quantized:  # each kept row's values and its scales (int4a: and mins)
            *parts, matrix = low.quantized_in(weight, "quant_rows")
            dtype_tag, dtype_arg = low.quant_tag(matrix)
            op, base = ops.sparse_columns_q, "sparse_columns_q"
        elif weight in low.kept:  # the file's own blocks along K: each kept input's codes (kquant's columns layout)
            values, scales, fmt = low.kept_in(weight, "kq_columns")
            parts, whole = [values], [scales]
            dtype_tag, dtype_arg = f"_{fmt.name}", {"fmt": fmt.name}
            op, base = ops.sparse_columns_kq, "sparse_columns_kq"
            scratch_kind, scratch_width = "kq_columns", kquant_columns.scratch_columns(columns)
        else:
            parts = [low.stored_for(weight, low.device)]
            dtype = low.buffers[weight]["dtype"]
            dtype_tag, dtype_arg = ("_f16", {"wdtype": dtype}) if dtype != "float32" else ("", {})
            op, base = ops.sparse_columns, "sparse_columns"
        kernels = low.kernel(op, f"{base}_k{rows}_n{columns}{tags}{dtype_tag}", rows, columns, phases=("decode",),
                             batch={} if batch else None, **flags, **dtype_arg, **batch_args)
        scratch = low.batch_scratch(f"scratch.{scratch_kind}.n{columns}", neuron.COLUMN_TASKS, scratch_width)
        # the kept input channels' rows of the [K, N] weight (and of its scales); bias and residual read whole
        args = [read(v), read(index), read(count),
                *(Arg(buffer, Access.SELECTED_ROWS, row_bytes=low.row_bytes(buffer)) for buffer in parts),
                *map(read, whole), *([read(bias)] if bias else []), *([read(residual)] if residual else []),
                write(scratch), write(out)]
        low.call(f"{p}.{part}", kernels, args, role, selection=Selection("threshold", part, count, rows, kept=kept))
        # multi-token steps: dense over the same rows
        def dense(target: str, act: str, residual: str | None) -> None:
            if weight in low.kept:
                low.linear_columns(v, weight, bias, target, f"{p}.{part}_dense", role, act, residual)
            else:
                low.linear(v, weight, bias, target, f"{p}.{part}_dense", role, act=act, residual=residual,
                           phases=("prefill",), packed=False)
        if glu:
            pre = low.activation(f"act.ffn_pre.n{columns}", columns)
            dense(pre, "none", None)
            low.glu(pre, out, columns // 2, act, f"{p}.glu", phases=("prefill",))
        else:
            dense(out, act, residual)

    def lower_MergePartial(self, node: ir.Node) -> None:
        inputs = list(node.inputs[:-1] if _residual(node) is not None else node.inputs)
        parts = [self.location[v.name] for v in inputs[:-1] if v is not None]
        bias = self.weight_of(inputs[-1])
        width = self.low.buffers[parts[0]]["shape"][1]
        out, residual = self.output_for(node, width)
        base = f"merge_d{width}_p{len(parts)}{'_b' if bias else ''}{'_res' if residual else ''}"
        kernels = self.low.kernel(ops.merge, base, width, len(parts), bias=bias is not None, residual=residual is not None)
        args = ([read(residual)] if residual else []) + [read(part) for part in parts] + ([read(bias)] if bias else []) + [write(out)]
        self.low.call(node.name, kernels, args, Role.MERGE)
        self.location[node.outputs[0].name] = out

    def lower_Linear(self, node: ir.Node) -> None:
        """The output layer (fuse made it a Linear, with its bias where the model has one; lower, where the quality
        plan thins its input: decode reads the rows of the channels above its threshold)."""
        weight, bias = self.weight_of(node.inputs[1]), self.weight_of(node.inputs[2] if len(node.inputs) > 2 else None)
        capped = any(Softcap.matches(user) for user in node.outputs[0].consumers())  # the soft-cap writes the logits
        out = self.low.activation("act.logits_uncapped" if capped else "logits", self.low.shape(weight)[1])
        linear = Linear(node)
        x = self.location[node.inputs[0].name]
        if float(linear.threshold) >= 0:
            self.thresholded_linear(node.name, "head", x, weight, bias, out, float(linear.threshold), Role.HEAD,
                                    kept=1.0 - float(linear.sparsity))
        else:
            self.low.linear(x, weight, bias, out, node.name, Role.HEAD)
        self.location[node.outputs[0].name] = out

    def lower_Handover(self, node: ir.Node) -> None:
        """The runtime's own transfer of the hidden rows from the sending stage's buffer to a buffer of the
        receiving stage's (distinct, so the DAG orders it): no kernel, a step in every phase (row-wise)."""
        handover = HandoverOp(node)
        source = self.location[node.inputs[0].name]
        target = self.low.activation(f"act.stage{handover.to_stage}.in", self.low.buffers[source]["shape"][1])
        self.low.layer = None  # between the layers
        self.low.call(node.name, (HANDOVER, HANDOVER, HANDOVER), [read(source), write(target)], Role.HANDOVER)
        self.location[node.outputs[0].name] = target

    def lower_Add(self, node: ir.Node) -> None:
        raise UserError(f"select-kernels: residual add {node.name} does not follow a block fuse folds it into")


@dataclass
class SelectKernels:
    name = "select-kernels"
    requires = (FUSED, PLACED)
    adds = (KERNEL_CALLS,)
    int8_activations: bool = Options.int8_activations  # int4 decode GEMVs over int8-quantized inputs
    max_batch: int = Options.max_batch  # --max-batch: sequences one batch step may hold (CPU artifacts)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        # the build's context, CPU format and instruction set (its register tile and integer dot product)
        build = ctx.build
        isa = build.cpu_isa
        # every row buffer holds prefill_rows rows, whatever the context: the runtime prefills longer prompts in steps
        rows = prefill_rows(build.max_context)
        lowering = Lowering(max_context=build.max_context, prefill_rows=rows, cpu_format=build.weight_format,
                            gemm_panels=isa.gemm_panels, int8_dot=isa.int8_dot if self.int8_activations else None,
                            max_batch=min(self.max_batch, rows))
        lowering.buffers["input_ids"] = {"kind": "input", "shape": [rows], "dtype": "int64"}
        walker = _Walker(lowering)
        nodes, layers = list(model.graph), pir.node_layers(model.graph)
        with ctx.progress("select-kernels: blocks", len(nodes)) as advance:
            for node in nodes:
                with ctx.layer(layers[node]) if layers[node] is not None else contextlib.nullcontext():
                    walker.lower(node, layers[node])
                advance()
        if not lowering.has_batch_phase():
            lowering.drop_batch()
        program = lowering.program
        ctx.log(f"select-kernels: {len(program.kernels)} kernels, {len(program.calls)} calls, "
                + (f"batch steps of up to {lowering.max_batch} sequences" if lowering.max_batch else "no batch phase"
                   + (f" ({lowering.slow_batch}: decode steps per sequence are faster)" if lowering.slow_batch else "")))
        result = program.to_model(carried_metadata(model))
        BatchPhase(lowering.max_batch).attach(result)
        return PassResult(result, modified=True)
