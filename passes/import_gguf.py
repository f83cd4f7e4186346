"""import (GGUF): a llama.cpp model file in, the same ONNX decoder the ONNX front end imports out.

Reads: a GGUF file (`gguf.GGUFReader`: the header parsed, tensors memory-mapped, never read whole). `load`
builds from it an ordinary ONNX decoder in optimum's KV-cache convention (inputs `input_ids`, `attention_mask`,
`position_ids`, `past_key_values.{i}.key/.value`; outputs `logits`, `present.{i}.key/.value`), from standard ONNX
ops the way transformers' exports compute the architecture (`passes.gguf_graph`), and hands it to the ONNX front
end's import pass, so every later pass, `--dump-ir`, `inspect` and `eval --reference model.gguf` see what an ONNX
model gives them. Written once per file (cached by its path, size and modification time under
`$PICOMPILE_CACHE/gguf-onnx/`): the model's tokenizer (`passes.gguf_tokenizer`: `tokenizer.json` built with the
`tokenizers` library, `tokenizer_config.json`, `generation_config.json`), never the weights.

Weights keep the file's values, and a quantized matrix its blocks:
- F32, F16 and BF16 tensors are read as they are (half matrices behind a Cast).
- A block type some picompile format holds exactly (`passes.formats.ggml`: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the
  K-quants Q4_K, Q5_K, Q6_K) is a `FileTensor` over the file's memory-mapped blocks: a float tensor to a pass
  that computes with it (dequantized when read, a matrix at a time), its blocks themselves to the passes that
  store it (quantize, select-kernels).
- Any other type the `gguf.quants` module dequantizes (Q2_K, Q3_K, ...) is dequantized to float32 when read
  (`onnx_ir.LazyTensor`), and rounded by --weight-dtype like a float matrix.
What each tensor was in the file is a fact on the model (`GGUFSource`, `metadata_props["picompile.gguf"]`),
which recognise keeps and the build reads to say which tensors a `--weight-dtype` re-rounds.

What a file of each architecture holds is its module in `passes.architectures` (the registry): the metadata keys
`hyper` reads, the tensors and shapes `tensors` checks, and the features the graph is built from (LLaMA's
converter permutes the rows of attn_q / attn_k for llama.cpp's adjacent-pair RoPE; the graph puts them back,
whole rows, and computes transformers' rotate-half; Phi-3's fused attn_qkv and ffn_up are taken apart into their
matrices' rows).
Refuses, in one line naming it: a file that is not GGUF (wrong magic), truncated or unreadable, an unknown
version or tensor type, tensor data past the end of the file, an architecture the registry does not hold,
missing metadata or tensors, tensors the architecture does not have, shapes that disagree with the metadata, a
feature the graph does not compute (LongRoPE's factors, rope.scaling.attn_factor other than 1).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import numpy as np
import onnx_ir as ir

from onnx_ir.passes import PassResult

from .cache import cache_dir
from .errors import UserError
from .facts import ModelFact
from .pipeline import Context

from .architectures import Architecture, Rope, architecture_of
from .formats import ggml
from .gguf_graph import FLOAT_TYPES, Hyper, build_graph
from .import_onnx import Import, check_memory

GGUF_MAGIC = b"GGUF"
CONVERTER_VERSION = 3  # part of the cache key: a change to what is written here invalidates old conversions
GGUF_KEY = "picompile.gguf"  # the metadata_props entry of the fact


def is_gguf(path: Path) -> bool:
    """Whether `path` is a GGUF file (by its magic; a .gguf suffix with another magic is refused by `read`)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with open(path, "rb") as file:
            return file.read(4) == GGUF_MAGIC
    except OSError:
        return False


# ---------------------------------------------------------------- facts


@dataclass(frozen=True)
class GGUFTensor:
    """One tensor of the file: its GGUF name, type (ggml's name: Q4_0, F16, ...), numpy-order shape, and
    whether it is a weight matrix (linear layer or embedding table) rather than a norm or bias."""

    name: str
    format: str
    shape: tuple[int, ...]
    matrix: bool


@dataclass(frozen=True)
class GGUFSource(ModelFact):
    """The fact that the model came from a GGUF file, and each tensor's format there (`of`: None where the model
    came from elsewhere)."""

    KEY: ClassVar[str] = GGUF_KEY
    file: str
    architecture: str
    tensors: tuple[GGUFTensor, ...]
    notes: tuple[str, ...] = ()  # what the user should know (no tokenizer, an unknown pre-tokenizer)

    @classmethod
    def from_json(cls, data: dict) -> "GGUFSource":
        fields = dict(data)
        tensors = tuple(GGUFTensor(**{**t, "shape": tuple(t["shape"])}) for t in fields.pop("tensors"))
        return cls(tensors=tensors, notes=tuple(fields.pop("notes", ())), **fields)

    def matrices(self) -> list[GGUFTensor]:
        return [t for t in self.tensors if t.matrix]

    def quantized(self) -> bool:
        """Whether some of its matrices came block-quantized."""
        return any(t.format not in FLOAT_TYPES for t in self.matrices())

    def main_format(self) -> str:
        """The format of most of its matrix weights (by count of weights)."""
        by_format: dict[str, int] = {}
        for t in self.matrices():
            by_format[t.format] = by_format.get(t.format, 0) + int(np.prod(t.shape))
        return max(by_format, key=by_format.get) if by_format else "F32"

    def weight_dtype(self) -> str:
        """`--weight-dtype auto` for this file: its main format's (`passes.formats.ggml`)."""
        return ggml.type_named(self.main_format()).auto_format or ggml.AUTO_FALLBACK

    def auto_reason(self) -> str:
        """Why `weight_dtype` chose what it did, for -v."""
        most = self.main_format()
        if ggml.type_named(most).auto_format:
            return f"most of the file's weights are {most}; every matrix keeps the file's own blocks"
        return (f"most of the file's weights are {most}, which no picompile format holds exactly: "
                f"{ggml.AUTO_FALLBACK} keeps them closest at its size")

    def changed(self, weight_dtype: str, keep_source_blocks: bool = False) -> dict[str, int]:
        """Source format -> how many matrices a build storing weights in `weight_dtype` re-rounds (values no
        longer the file's); with `keep_source_blocks` (auto's build) a matrix in blocks another format holds
        exactly is stored in that one (passes.quantize)."""
        counts: dict[str, int] = {}
        for t in self.matrices():
            kind = ggml.type_named(t.format)
            if weight_dtype in kind.exact_in or (keep_source_blocks and kind.kept_in_blocks):
                continue
            counts[t.format] = counts.get(t.format, 0) + 1
        return counts

    def describe(self) -> str:
        formats: dict[str, int] = {}
        for t in self.matrices():
            formats[t.format] = formats.get(t.format, 0) + 1
        listed = ", ".join(f"{count} {name}" for name, count in sorted(formats.items(), key=lambda kv: -kv[1]))
        return f"GGUF {self.architecture} ({Path(self.file).name}): weight matrices {listed}"


def rerounding_warning(source: GGUFSource, weight_dtype: str, target_has_gpu: bool = False,
                       keep_source_blocks: bool = False) -> str | None:
    """The one line a build prints where storing the file's matrices in `weight_dtype` changes some of their
    values (None where every value is kept)."""
    changed = source.changed(weight_dtype, keep_source_blocks)
    if not changed:
        return None
    parts = ", ".join(f"{count} {name}" for name, count in sorted(changed.items(), key=lambda kv: -kv[1]))
    total = sum(changed.values())
    gpu = " (GPU-resident ones are stored fp16 whatever --weight-dtype says)" if target_has_gpu else ""
    unheld = sorted(name for name in changed if ggml.type_named(name).auto_format is None)
    why = (f" (no picompile format holds {'/'.join(unheld)} blocks exactly yet)" if unheld else "")
    return (f"{total} of the file's weight matrices ({parts}) are re-rounded to {weight_dtype}{why}: their values "
            f"are no longer the file's{gpu}; --weight-dtype fp32 keeps every value")


# ---------------------------------------------------------------- reading the file


def _refuse(path: Path, reason: str) -> UserError:
    return UserError(f"{path}: {reason}")


def read(path: Path):
    """The file's GGUFReader (one per process for an unchanged file: parsing a 150k-token vocabulary's metadata
    takes seconds), every failure worded as one UserError."""
    path = Path(path)
    if path.is_file():
        return _read_once(str(path.resolve()), _key(path))
    return _read(path)


@lru_cache(maxsize=2)
def _read_once(path: str, key: str):
    return _read(Path(path))


def _read(path: Path):
    import gguf

    path = Path(path)
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if path.is_dir() or path.stat().st_size == 0:
        raise _refuse(path, "not a GGUF file (empty or a directory)")
    with open(path, "rb") as file:
        head = file.read(8)
    if head[:4] != GGUF_MAGIC:
        raise _refuse(path, f"not a GGUF file (it starts with {head[:4]!r}, not {GGUF_MAGIC!r})")
    if len(head) < 8:
        raise _refuse(path, "the GGUF file is truncated (it ends inside its header)")
    version = struct.unpack("<I", head[4:8])[0]
    if version & 0xFFFF == 0:  # a big-endian file, as the reader tells them apart
        version = struct.unpack(">I", head[4:8])[0]
    if version not in gguf.gguf_reader.READER_SUPPORTED_VERSIONS:
        raise _refuse(path, f"GGUF version {version} is not supported (the gguf reader knows versions "
                            f"{', '.join(map(str, gguf.gguf_reader.READER_SUPPORTED_VERSIONS))})")
    try:
        return _reader_class()(str(path))
    except _Refused as refused:
        raise _refuse(path, str(refused)) from None
    except ValueError as error:
        text = str(error)
        if "is not a valid GGMLQuantizationType" in text:
            code = text.split()[0]
            raise _refuse(path, f"a tensor has unknown GGML type {code} (a newer llama.cpp's format?)") from None
        if "cannot reshape" in text or "buffer is smaller" in text or "mmap length" in text:
            raise _refuse(path, f"the GGUF file is truncated: tensor data or header reaches past its end "
                                f"({path.stat().st_size} bytes)") from None
        raise _refuse(path, f"not a readable GGUF file ({text})") from None
    except (struct.error, IndexError, KeyError, OverflowError, UnicodeDecodeError, TypeError, MemoryError) as error:
        raise _refuse(path, f"the GGUF header is truncated or damaged: it ends or breaks off before all its "
                            f"metadata and tensor entries ({type(error).__name__}: {error})") from None


class _Refused(Exception):
    """What the reader found wrong with a tensor's header entry, worded for the user."""


@lru_cache(maxsize=1)
def _reader_class():
    """GGUFReader, checking each tensor's header entry (type, where its data ends) before the reader builds its
    view, so that the refusal names the tensor (the reader's own error is numpy's failed reshape)."""
    import gguf

    class Reader(gguf.GGUFReader):
        def _get_field_parts(self, orig_offs, raw_type):
            """An array of strings or numbers as the reader's own parts (a part an element), read in one pass over
            a plain view of the file: the reader's recursion reads a 150k-token vocabulary's strings and scores
            in seconds (a memmap slice a value), this in a fraction of one. Other fields (and a file of the other
            byte order) as the reader reads them."""
            if raw_type != gguf.GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw = self.data.view(np.ndarray)
            item_type = raw[orig_offs: orig_offs + 4].view(np.uint32)
            count = raw[orig_offs + 4: orig_offs + 12].view(np.uint64)
            item = gguf.GGUFValueType(int(item_type[0]))
            parts, offs = [item_type, count], orig_offs + 12
            if item == gguf.GGUFValueType.STRING:
                buffer = memoryview(raw)
                for _ in range(int(count[0])):
                    length = int.from_bytes(buffer[offs: offs + 8], "little")
                    if offs + 8 + length > len(raw):
                        raise IndexError("a string array runs past the end of the file")
                    parts += (raw[offs: offs + 8].view(np.uint64), raw[offs + 8: offs + 8 + length])
                    offs += 8 + length
                return offs - orig_offs, parts, list(range(3, len(parts), 2)), [gguf.GGUFValueType.ARRAY, item]
            numbers = self.gguf_scalar_to_np.get(item)
            if numbers is None:  # (arrays of arrays)
                return super()._get_field_parts(orig_offs, raw_type)
            size = np.dtype(numbers).itemsize
            values = raw[offs: offs + int(count[0]) * size].view(numbers)
            if len(values) != int(count[0]):
                raise IndexError("a number array runs past the end of the file")
            parts += [values[i: i + 1] for i in range(len(values))]
            return 12 + values.nbytes, parts, list(range(2, len(parts))), [gguf.GGUFValueType.ARRAY, item]

        def _build_tensors(self, start_offs, fields):
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                try:
                    kind = gguf.GGMLQuantizationType(int(raw_dtype[0]))
                except ValueError:
                    raise _Refused(f"tensor {name} has unknown GGML type {int(raw_dtype[0])} (a newer llama.cpp's "
                                   "format?)") from None
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
                end = start_offs + int(offset[0]) + int(np.prod(dims.astype(np.int64))) * type_size // block
                if end > len(self.data):
                    raise _Refused(f"the data of tensor {name} ends at byte {end}, past the end of the file "
                                   f"({len(self.data)} bytes): the file is truncated or damaged")
            super()._build_tensors(start_offs, fields)

    return Reader


def _field(reader, key: str, path: Path, default=None):
    """Metadata `key`'s value; `default` where it is absent, or an error where there is no default."""
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise _refuse(path, f"metadata {key} is missing, and picompile needs it")
        return default
    try:
        return field.contents()
    except Exception as error:  # the reader's own view of a damaged value
        raise _refuse(path, f"metadata {key} cannot be read ({type(error).__name__}: {error})") from None


def _int(value, key: str, path: Path, minimum: int = 1) -> int:
    if isinstance(value, list):
        values = set(value)
        if len(values) != 1:
            raise _refuse(path, f"metadata {key} differs between layers ({sorted(values)[:4]}...), which picompile "
                                "does not compile")
        value = values.pop()
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < minimum:
        raise _refuse(path, f"metadata {key} is {value!r}, not " +
                      ("a positive integer" if minimum == 1 else f"an integer of at least {minimum}"))
    return int(value)


def _architecture(reader, path: Path) -> Architecture:
    try:
        return architecture_of(_field(reader, "general.architecture", path))
    except UserError as error:
        raise _refuse(path, str(error)) from None


def hyper(reader, path: Path) -> Hyper:
    """The architecture's numbers (its `params`: llama.cpp's defaults where a key is optional), checked against
    what the graph computes, and the file's features the graph does not compute refused (`Architecture.refused`)."""
    arch = _architecture(reader, path)
    got: dict = {}
    for param in arch.params:
        key = f"{arch.name}.{param.key}"
        default = param.default(got) if callable(param.default) else param.default
        value = _field(reader, key, path, default)
        got[param.name] = _int(value, key, path, param.minimum) if param.kind is int else param.kind(value)
    heads, kv_heads, head_dim = got["heads"], got["kv_heads"], got["head_dim"]
    if heads % kv_heads:
        raise _refuse(path, f"{heads} attention heads cannot share {kv_heads} kv heads evenly")
    if got["value_dim"] != head_dim or head_dim % 2:
        raise _refuse(path, f"key length {head_dim} and value length {got['value_dim']}: picompile needs them equal "
                            "and even")
    if got["rope_dims"] != head_dim:
        raise _refuse(path, f"rope.dimension_count {got['rope_dims']} is not the head size {head_dim} (partial rotary "
                            "embeddings are not supported for GGUF files yet)")
    scaling, factor = got["rope_scaling"], got["rope_factor"] or 1.0
    scalings = ("none", Rope.LINEAR.value) if Rope.LINEAR in arch.rope else ("none",)
    if scaling not in scalings and factor != 1.0:
        raise _refuse(path, f"rope scaling {scaling!r} is not supported ({' and '.join(scalings)} are)")
    names = {t.name for t in reader.tensors}
    for refused in arch.refused:  # (first: a feature's tensor says more than the metadata that comes with it)
        if refused.tensor in names:
            raise _refuse(path, f"tensor {refused.tensor} is {refused.why}")
    if got["rope_attn_factor"] != 1.0:
        raise _refuse(path, f"rope.scaling.attn_factor {got['rope_attn_factor']:g} is not supported (llama.cpp scales "
                            "RoPE's cos and sin by it; picompile's RoPE has no such factor)")
    extra = {name: got[name] for name in ("attn_softcap", "final_softcap", "rope_base_swa")
             if name in got}
    if arch.sliding_window is not None:
        extra["window"], extra["sliding"] = _sliding_window(reader, path, arch, got["layers"])
        if not arch.sliding_window.scaled:
            extra["rope_scale_swa"] = 1.0
    return Hyper(arch, got["layers"], got["d_model"], got["ffn"], heads, kv_heads, head_dim, got["eps"],
                 got["rope_base"], factor if scaling == Rope.LINEAR.value else 1.0, **extra)


def _sliding_window(reader, path: Path, arch: Architecture, layers: int) -> tuple[int, tuple[bool, ...]]:
    """(the window, which layers slide), as llama.cpp reads them: attention.sliding_window (the architecture's
    window where absent), attention.sliding_window_pattern as one bool per layer or a period."""
    sliding = arch.sliding_window
    key = f"{arch.name}.attention.sliding_window"
    window = _field(reader, key, path, sliding.window)
    if not isinstance(window, (int, np.integer)) or isinstance(window, bool) or window < 0:
        raise _refuse(path, f"metadata {key} is {window!r}, not a window of positions")
    key = f"{arch.name}.attention.sliding_window_pattern"
    pattern = _field(reader, key, path, sliding.period)
    if isinstance(pattern, list):
        if len(pattern) != layers or not all(isinstance(v, (bool, np.bool_)) for v in pattern):
            raise _refuse(path, f"metadata {key} is not one bool per layer ({layers} layers)")
        return int(window), tuple(bool(v) for v in pattern)
    if not isinstance(pattern, (int, np.integer)) or isinstance(pattern, bool) or pattern < 0:
        raise _refuse(path, f"metadata {key} is {pattern!r}, not a period of layers")
    return int(window), sliding.layers(int(pattern), layers)


def context_length(path: Path) -> int | None:
    """The context the file's model was trained for (`<general.architecture>.context_length`), None where the file
    does not say (or says something that is not a positive integer)."""
    reader = read(path)
    arch = _field(reader, "general.architecture", path)
    value = _field(reader, f"{arch}.context_length", path, default=0)
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value > 0:
        return int(value)
    return None


def _expected_shapes(h: Hyper, vocab: int) -> dict[str, tuple[tuple[int, ...], bool, bool]]:
    """GGUF tensor name -> (numpy-order shape, whether a weight matrix, whether required): the architecture's
    tensors, a block's once per layer."""
    specs = h.architecture.tensors
    named = [(spec.name, spec) for spec in specs if not spec.per_block]
    named += [(f"blk.{i}.{spec.name}", spec) for i in range(h.layers) for spec in specs if spec.per_block]
    return {name: (spec.size(h, vocab), spec.matrix, spec.required) for name, spec in named}


def tensors(reader, h: Hyper, path: Path) -> tuple[dict, int]:
    """GGUF name -> ReaderTensor, checked against the architecture (names, shapes, types, the file's end);
    and the vocabulary size."""
    found = {t.name: t for t in reader.tensors}
    embed = found.get("token_embd.weight")
    if embed is None:
        raise _refuse(path, "tensor token_embd.weight (the token embedding) is missing")
    vocab = int(embed.shape[-1]) if len(embed.shape) == 2 else 0
    expected = _expected_shapes(h, vocab)
    name = h.architecture.name
    unknown = sorted(set(found) - set(expected), key=lambda n: (len(n), n))
    if unknown:
        hint = (" (a mixture of experts?)" if any("exps" in n or "ffn_gate_inp" in n for n in unknown) else
                " (PowerInfer's predictor weights? picompile trains its own, and reads ReLU LLaMA files not yet)"
                if any(".fc1." in n or ".fc2." in n for n in unknown) else "")
        raise _refuse(path, f"tensor {unknown[0]} is not part of a {name} model as picompile compiles "
                            f"it{hint}" + (f" ({len(unknown) - 1} more)" if len(unknown) > 1 else ""))
    missing = [name for name, (_, _, required) in expected.items() if required and name not in found]
    if missing:
        more = f" ({len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _refuse(path, f"tensor {missing[0]} is missing{more}")
    size = path.stat().st_size
    for tensor_name, tensor in found.items():
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        want = expected[tensor_name][0]
        if shape != want:
            raise _refuse(path, f"tensor {tensor_name} has shape {list(shape)} but {name}'s metadata "
                                f"(embedding_length {h.d_model}, feed_forward_length {h.ffn}, head_count {h.heads}, "
                                f"head_count_kv {h.kv_heads}) makes it {list(want)}")
        if tensor.data_offset + tensor.n_bytes > size:
            raise _refuse(path, f"the data of tensor {tensor_name} ends at byte {tensor.data_offset + tensor.n_bytes}, "
                                f"past the end of the file ({size} bytes): the file is truncated")
        kind = tensor.tensor_type.name
        if not ggml.type_named(kind).read:
            raise _refuse(path, f"tensor {tensor_name} is stored as {kind}, which the gguf package cannot dequantize")
    return found, vocab


# ---------------------------------------------------------------- conversion, cached


def cache_root() -> Path:
    return cache_dir("gguf-onnx")


@dataclass(frozen=True)
class Converted:
    """What is kept of a GGUF file beside it: its tokenizer's directory (if the file had one) and the facts read."""

    directory: Path
    tokenizer: Path | None
    source: GGUFSource


def _key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _source(path: Path, h: Hyper, found: dict, vocab: int) -> GGUFSource:
    expected = _expected_shapes(h, vocab)
    return GGUFSource(str(path.resolve()), h.architecture.name, tuple(
        GGUFTensor(name, t.tensor_type.name, tuple(int(d) for d in reversed(t.shape.tolist())), expected[name][1])
        for name, t in found.items()))


def _staged(directory: Path, write) -> None:
    """`write(staging)` into a new directory renamed to `directory` when complete (another process's is as good)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    umask = os.umask(0)
    os.umask(umask)
    staging.chmod(0o777 & ~umask)  # mkdtemp's 0700 would hide the conversion from the cache's other users
    try:
        write(staging)
        try:
            staging.rename(directory)
        except OSError:  # another process wrote the same meanwhile
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def convert(path: Path, log=lambda message: None) -> Converted:
    """The GGUF file's tokenizer (and the conversion's notes), written once beside nothing else: the model itself
    is read from the file at each load (`load`), its blocks never copied."""
    path = Path(path)
    reader = read(path)
    h = hyper(reader, path)
    found, vocab = tensors(reader, h, path)
    source = _source(path, h, found, vocab)
    directory = cache_root() / f"{path.stem}-{_key(path)}"
    notes_path = directory / "notes.json"
    if not notes_path.is_file():
        def write(staging: Path) -> None:
            from .gguf_tokenizer import write_tokenizer

            notes = write_tokenizer(reader, path, staging, vocab, log)
            (staging / "notes.json").write_text(json.dumps(notes))

        _staged(directory, write)
    tokenizer = directory if (directory / "tokenizer.json").is_file() else None
    notes = tuple(json.loads(notes_path.read_text())) if notes_path.is_file() else ()
    return Converted(directory, tokenizer, replace(source, notes=notes))


@lru_cache(maxsize=8)
def _converted(path: str, key: str) -> Converted:
    return convert(Path(path))


def converted(path: Path) -> Converted:
    """`convert`, once per process for an unchanged file."""
    path = Path(path)
    if not path.is_file():
        return convert(path)  # its refusal
    return _converted(str(path.resolve()), _key(path))


def load(path: Path, for_build: bool = True) -> ir.Model:
    """The GGUF file's decoder, built from the memory-mapped file (block-quantized matrices as `FileTensor`s over
    its blocks), carrying its `GGUFSource`. A build first checks the machine's memory against the file's size
    (what the build holds of the weights: their blocks, one matrix's floats at a time)."""
    path = Path(path)
    made = converted(path)
    if for_build:
        check_memory(str(path), path.stat().st_size)
    reader = read(path)
    h = hyper(reader, path)
    found, vocab = tensors(reader, h, path)
    model = build_graph(h, found, vocab)
    made.source.attach(model)
    # the graph holds views of the file's mapping; the parsed metadata (a 150k-token vocabulary's fields: hundreds
    # of MiB) goes with the reader
    _read_once.cache_clear()
    return model


def reference_onnx(path: Path) -> Path:
    """An ONNX file of the GGUF file's decoder with every weight in float32 (the file's values): what onnxruntime
    runs as a reference or a baseline (eval, benchmarks, tests), never what a build reads. Written once per file
    into the cache, tensor by tensor."""
    path = Path(path)
    directory = cache_root() / f"{path.stem}-{_key(path)}-onnx"
    onnx_path = directory / "model.onnx"
    if not onnx_path.is_file():
        model = load(path, for_build=False)
        _staged(directory, lambda staging: ir.save(model, staging / "model.onnx", external_data="model.onnx.data"))
    return onnx_path


@dataclass
class ImportGGUF(Import):
    """The import pass of a model that came from a GGUF file (`load` converted it): the ONNX front end's import,
    after saying what the file held and passing on the conversion's notes."""

    name = "import"
    fold_constants: bool = False  # gguf_graph writes nothing to fold (onnxscript's optimizer took 90% of the import of
    # a 46-layer file and changed no node)

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        source = GGUFSource.of(model)
        if source is not None:
            ctx.log(f"import: {source.describe()}")
            for note in source.notes:
                ctx.warn(note)
        return super().apply(model, ctx)
