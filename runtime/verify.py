"""The manifest's claims checked against the artifact's verified files, before anything is allocated or loaded.

The sha256 checks of `load_manifest` prove that the weight files, the schedule and the kernels are the
ones the build wrote; the manifest's own digest can be recomputed by whoever edits it. So the runtime
believes the files, not the manifest: every weight buffer's shape and type must be what its weight file's
header says, the vocabulary is the token embedding table's row count, the context length, the KV cache
lengths, the prefill rows, the logits and the layer counts must agree with the weights and the schedule, and every buffer a
call passes must have the shape and type its kernel was compiled for (kernels/signatures.json), which is
what TVM's generated code checks at call time. A disagreement is one `ArtifactError` naming the field;
nothing reaches a kernel that it would refuse, and no token id can index past the embedding table.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from . import dtypes
from .artifact import ArtifactError, read_json, read_safetensors_header, weight_files
from .calls import PHASES, START, Access, Call, Role, schedule_calls
from .manifest import Buffer, Manifest

KINDS = ("weight", "activation", "input", "cache", "scratch")
ROW_KINDS = ("activation", "input")  # one row per token: a step of `rows` tokens uses their first rows


@dataclass(frozen=True)
class Facts:
    """What the runtime may rely on, established from the verified files."""

    vocab_size: int  # rows of the token embedding table, from its weight file
    max_context: int  # KV cache length
    # rows of every row buffer (input_ids'): the most tokens one forward step takes; a longer prompt is prefilled in
    # steps of this many (Engine.forward). At most max_context (artifacts built before chunked prefill: equal to it)
    prefill_rows: int
    num_layers: int
    token_tables: tuple[str, ...]  # the embedding tables the embed calls index by token id


@dataclass(frozen=True)
class Checked:
    facts: Facts
    schedule: dict  # schedule.json
    calls: list[Call]  # its calls, in execution order
    headers: dict[Path, dict[str, dict]]  # each weight file -> its tensors (read_safetensors_header)


def check_files(directory: Path, manifest: Manifest) -> Checked:
    """Read what the checks need from an artifact `load_manifest` accepted (the schedule, the kernel
    signatures, the weight files' headers: no weights, no library) and check the manifest against it."""
    directory = Path(directory)
    schedule = read_json(directory, "schedule.json")
    headers = {path: read_safetensors_header(path) for path in weight_files(directory, manifest)}
    calls = _check_schedule(schedule)
    facts = check_artifact(manifest, calls, {str(path.relative_to(directory)): h for path, h in headers.items()},
                           read_json(directory, "kernels/signatures.json"))
    return Checked(facts, schedule, calls, headers)


def disagrees(message: str) -> ArtifactError:
    return ArtifactError(f"manifest.json disagrees with its files: {message}")


def check_artifact(manifest: Manifest, nodes: list[Call], headers: dict[str, dict[str, dict]],
                   signatures: dict) -> Facts:
    """Check the manifest (already structure-checked by `load_manifest`) against the weight files' headers
    (`headers`: relative path -> `read_safetensors_header`), the schedule's calls and the kernel signatures;
    return the facts the engine uses. Raises ArtifactError naming the first disagreement."""
    buffers = manifest.buffers
    _check_entries(buffers)
    files_of = _check_weights(buffers, headers)
    _check_call_buffers(nodes, buffers)
    max_context = manifest.model.max_context
    prefill_rows = _check_prefill_rows(manifest, buffers)
    max_batch = _check_max_batch(manifest, nodes, prefill_rows)
    vocab, tables = _check_vocabulary(manifest, buffers, nodes, headers, files_of)
    _check_context(manifest, buffers, nodes, headers, files_of, prefill_rows)
    layers = _check_layers(manifest, buffers, nodes)
    _check_signatures(buffers, nodes, signatures, prefill_rows, max_batch)
    return Facts(vocab_size=vocab, max_context=max_context, prefill_rows=prefill_rows, num_layers=layers,
                 token_tables=tables)


def _shape(info: Buffer) -> list[int]:
    return list(info.shape)


def _check_entries(buffers: dict[str, Buffer]) -> None:
    for name, info in buffers.items():
        if info.kind not in KINDS:
            raise disagrees(f"buffers.{name}.kind is {info.kind!r}, not one of {', '.join(KINDS)}")
        if info.dtype not in dtypes.DTYPES:
            raise disagrees(f"buffers.{name}.dtype is {info.dtype!r}, not one of {', '.join(dtypes.DTYPES)}")
        shape = info.shape
        if not (isinstance(shape, list) and shape and all(isinstance(d, int) and not isinstance(d, bool) and d > 0
                                                          for d in shape)):
            raise disagrees(f"buffers.{name}.shape is {shape!r}, not a list of positive integers")


def _check_weights(buffers: dict[str, Buffer], headers: dict[str, dict[str, dict]]) -> dict[str, list[str]]:
    """Every weight buffer is held by a weight file with the same shape and type, and every tensor of the
    weight files is a weight buffer. Returns weight name -> the files holding it."""
    files_of: dict[str, list[str]] = {}
    for relative, header in sorted(headers.items()):
        for name, tensor in header.items():
            info = buffers.get(name)
            if info is None:
                raise disagrees(f"{relative} holds {name}, which buffers does not list")
            if info.kind != "weight":
                raise disagrees(f"buffers.{name}.kind is {info.kind!r} but {relative} holds it as a weight")
            if _shape(info) != tensor["shape"]:
                raise disagrees(f"buffers.{name}.shape is {info.shape} but {relative} holds it as {tensor['shape']}")
            if info.dtype != tensor["dtype"]:
                raise disagrees(f"buffers.{name}.dtype is {info.dtype} but {relative} holds it as {tensor['dtype']}")
            files_of.setdefault(name, []).append(relative)
    for name, info in buffers.items():
        if info.kind == "weight" and name not in files_of:
            raise disagrees(f"buffers.{name} is a weight, but no weight file holds it")
    return files_of


def _check_schedule(schedule: dict) -> list[Call]:
    """The schedule's calls, their facts parsed."""
    nodes = schedule.get("nodes") if isinstance(schedule, dict) else None
    if not isinstance(nodes, list) or not nodes:
        raise ArtifactError("schedule.json is damaged: it has no calls; rebuild the artifact")
    try:
        calls = schedule_calls(schedule)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ArtifactError(f"schedule.json is damaged (a call's facts are malformed: {error!r}); "
                            "rebuild the artifact") from None
    return calls


def _check_call_buffers(calls: list[Call], buffers: dict[str, Buffer]) -> None:
    """Every buffer a call passes (or counts with) has a manifest entry."""
    for call in calls:
        for name in call.buffers() + ([] if call.selection is None else
                                      [b for b in (call.selection.count, call.selection.hidden) if b]):
            if name not in buffers:
                raise disagrees(f"buffers has no entry for {name}, which call {call.id} passes")
    for name in ("input_ids", "logits"):
        if name not in buffers:
            raise disagrees(f"buffers has no entry for {name}")


def _gathered(call: Call) -> list[str]:
    """The tables an embedding call gathers rows of: the token table, then the positions' where learned."""
    return [arg.buffer for arg in call.args if arg.access is Access.GATHER]


def _where(name: str, files_of: dict[str, list[str]]) -> str:
    return f"{name} ({files_of[name][0]})"


def _check_vocabulary(manifest, buffers, nodes, headers, files_of) -> tuple[int, tuple[str, ...]]:
    """vocab = the token embedding table's rows (from its weight file) = model.vocab_size = the logits' width."""
    tables = []
    for node in nodes:
        if node.role is Role.EMBED:
            table = (_gathered(node) or [None])[0]
            if table not in buffers or buffers[table].kind != "weight" or len(buffers[table].shape) != 2:
                raise ArtifactError(f"schedule.json is damaged: embedding call {node.id} reads no 2-D table; "
                                    "rebuild the artifact")
            tables.append(table)
    if not tables:
        raise ArtifactError("schedule.json is damaged: it has no embedding call; rebuild the artifact")
    rows = {table: headers[files_of[table][0]][table]["shape"][0] for table in tables}
    vocab = rows[tables[0]]
    for table, count in rows.items():
        if count != vocab:
            raise disagrees(f"the embedding tables {_where(tables[0], files_of)} and {_where(table, files_of)} have "
                            f"{vocab} and {count} rows")
    claimed = manifest.model.vocab_size
    if claimed != vocab:
        raise disagrees(f"model.vocab_size is {claimed} but the embedding table {_where(tables[0], files_of)} has "
                        f"{vocab} rows")
    logits = buffers["logits"]
    if logits.kind != "activation" or logits.dtype != "float32" or len(logits.shape) != 2 \
            or logits.shape[1] != vocab:
        raise disagrees(f"buffers.logits is {logits.kind} {logits.dtype} {logits.shape} but the logits are "
                        f"float32 [prefill rows, {vocab}], {vocab} being the vocabulary: the rows of the embedding "
                        f"table {_where(tables[0], files_of)}")
    return vocab, tuple(dict.fromkeys(tables))


def _check_prefill_rows(manifest, buffers) -> int:
    """The rows of a step: input_ids is int64 [rows], 1 <= rows <= model.max_context (a prompt longer than rows is
    prefilled in steps of rows tokens)."""
    max_context = manifest.model.max_context
    if max_context <= 0:
        raise disagrees(f"model.max_context is {max_context}, not a positive integer")
    ids = buffers["input_ids"]
    if ids.kind != "input" or ids.dtype != "int64" or len(ids.shape) != 1:
        raise disagrees(f"buffers.input_ids is {ids.kind} {ids.dtype} {ids.shape} but the token ids are "
                        "input int64 [prefill rows]")
    rows = ids.shape[0]
    if rows > max_context:
        raise disagrees(f"model.max_context is {max_context} but buffers.input_ids has {rows} rows: a step takes at "
                        "most model.max_context tokens")
    return rows


def _check_max_batch(manifest, nodes, prefill_rows: int) -> int:
    """model.max_batch (0 where absent: an artifact without a batch phase) is an integer, at least 2 and at most
    the prefill rows (input_ids') where a call has a batch kernel, and every decode call then has one."""
    max_batch = manifest.model.max_batch
    if not isinstance(max_batch, int) or isinstance(max_batch, bool) or max_batch < 0:
        raise disagrees(f"model.max_batch is {max_batch!r}, not a non-negative integer")
    batched = [node for node in nodes if node.batch]
    if batched and not 2 <= max_batch <= prefill_rows:
        raise disagrees(f"model.max_batch is {max_batch} but call {batched[0].id} has a batch kernel: a batch phase "
                        f"holds 2 to {prefill_rows} sequences (the rows of buffers.input_ids, at most "
                        "model.max_context)")
    missing = [node.id for node in nodes if node.decode and not node.batch]
    if batched and missing:
        raise ArtifactError(f"schedule.json is damaged: call {missing[0]} has no batch kernel but others do; "
                            "rebuild the artifact")
    return max_batch if batched else 0


def _check_context(manifest, buffers, nodes, headers, files_of, prefill_rows: int) -> None:
    """Every row buffer holds the prefill rows (input_ids': or 1, or model.max_batch: one-token steps only), each
    KV cache is [heads, max_context, head_dim], and learned position tables have a row for every position."""
    max_context = manifest.model.max_context
    if buffers["logits"].shape[0] != prefill_rows:
        raise disagrees(f"buffers.input_ids has {prefill_rows} rows but buffers.logits has "
                        f"{buffers['logits'].shape[0]}")
    step_rows = {1, manifest.model.max_batch or 1}
    for name, info in buffers.items():
        shape = info.shape
        if info.kind in ROW_KINDS and shape[0] != prefill_rows and shape[0] not in step_rows:
            raise disagrees(f"buffers.{name}.shape is {shape}: a row buffer holds the prefill rows of "
                            f"buffers.input_ids ({prefill_rows}) (or 1, or model.max_batch: one-token steps only)")
        if info.kind == "cache" and (len(shape) != 3 or shape[1] != max_context):
            raise disagrees(f"buffers.{name}.shape is {shape} but a KV cache is [heads, model.max_context "
                            f"({max_context}), head_dim]")
    for node in nodes:
        if node.role is not Role.EMBED:
            continue
        gathered = _gathered(node)
        for table in gathered[1:]:
            if buffers[table].kind != "weight":
                raise ArtifactError(f"schedule.json is damaged: embedding call {node.id} gathers rows of "
                                    f"{table}, not a weight; rebuild the artifact")
        rows_of = {table: headers[files_of[table][0]][table]["shape"][0] for table in gathered}
        # the token table's block scales have its rows; a gathered table of other rows is a learned position table
        for table in (t for t in gathered[1:] if rows_of[t] != rows_of[gathered[0]]):
            rows = rows_of[table]
            if rows < max_context:
                raise disagrees(f"model.max_context is {max_context} but the position table {_where(table, files_of)} "
                                f"has {rows} rows")
    options = manifest.options.max_context if manifest.options is not None else None
    if options is not None and options != max_context:
        raise disagrees(f"model.max_context is {max_context} but options.max_context is {options}")


def _check_layers(manifest, buffers, nodes) -> int:
    """Each layer the schedule calls writes a key and a value cache (its calls' facts say which buffers, and
    which layer), every KV cache buffer belongs to one, the layers are 0..n-1, and model.num_layers (and the
    per-layer report, where there is one) say n."""
    written: dict[int, set[str]] = {}
    for node in nodes:
        for arg in node.args:
            if arg.access is Access.UPDATE and buffers[arg.buffer].kind == "cache":
                if node.layer is None:
                    raise ArtifactError(f"schedule.json is damaged: call {node.id} writes a KV cache outside the "
                                        "layers; rebuild the artifact")
                written.setdefault(node.layer, set()).add(arg.buffer)
    scheduled = {node.layer for node in nodes if node.layer is not None}
    layers = len(scheduled)
    if scheduled != set(range(layers)) or set(written) != scheduled:
        raise disagrees(f"the schedule calls layers {sorted(scheduled)} but writes KV caches for layers "
                        f"{sorted(written)}: a key and a value for each layer 0..n-1 are expected")
    for layer, caches in written.items():
        if len(caches) % 2:
            raise disagrees(f"layer {layer} writes {len(caches)} KV cache buffers: a key and a value are expected")
    unwritten = {name for name, info in buffers.items() if info.kind == "cache"} - set().union(*written.values())
    if unwritten:
        raise disagrees(f"buffers lists KV caches no call writes: {', '.join(sorted(unwritten))}")
    claimed = manifest.model.num_layers
    if claimed != layers:
        raise disagrees(f"model.num_layers is {claimed} but the schedule and the KV caches have {layers} layers")
    report = manifest.layers
    if report:  # the per-layer build report (sparse builds)
        numbers = [entry.layer for entry in report]
        if numbers != list(range(layers)):
            raise disagrees(f"layers (the per-layer report) has {len(report)} entries but the schedule and the KV "
                            f"caches have {layers} layers")
    claimed_calls = manifest.model.num_calls
    if claimed_calls is not None and claimed_calls != len(nodes):
        raise disagrees(f"model.num_calls is {claimed_calls} but schedule.json has {len(nodes)} calls")
    return layers


def _dims(dims: list) -> str:
    return "[" + ", ".join(str(d) if isinstance(d, int) else "rows" for d in dims) + "]"


def _check_signatures(buffers: dict[str, Buffer], nodes: list[dict], signatures: dict, prefill_rows: int,
                      max_batch: int = 0) -> None:
    """Each call's buffers have the shape and type its kernels take (TVM's code checks them at call time: a
    mismatch would be an internal error mid-generation). A kernel's size variable is the step's row count:
    1 for decode, up to the prefill rows (input_ids') for prefill, up to max_batch for a batch step (1 for a call a batch step
    runs per sequence); row buffers are passed as their first `rows` rows."""
    if not isinstance(signatures, dict):
        raise ArtifactError("kernels/signatures.json is damaged; rebuild the artifact")
    for node in nodes:
        call, args = node.id, [arg.buffer for arg in node.args]
        for phase in PHASES:
            kernel = node.kernel(phase)
            if kernel and node.runtime_own:  # a copy or hand-over, the runtime's own: the same rows on both sides
                sources = [arg.buffer for arg in node.args if not arg.writes]
                targets = [arg.buffer for arg in node.args if arg.writes]
                if len(sources) != 1 or len(targets) != 1 or START in args:
                    raise ArtifactError(f"schedule.json is damaged: {node.role.value} {call} does not have a source "
                                        "and a target; rebuild the artifact")
                source, target = buffers[sources[0]], buffers[targets[0]]
                if (source.shape, source.dtype) != (target.shape, target.dtype):
                    raise disagrees(f"buffers.{sources[0]} is {source.dtype} {source.shape} but "
                                    f"buffers.{targets[0]}, which copy {call} copies it to, is {target.dtype} "
                                    f"{target.shape}")
                continue
            if not kernel:
                continue
            signature = signatures.get(kernel)
            if not isinstance(signature, list):
                raise ArtifactError(f"kernels/signatures.json does not describe kernel {kernel} (call {call}); "
                                    "rebuild the artifact")
            if len(signature) != len(args):
                raise ArtifactError(f"schedule.json passes {len(args)} arguments to kernel {kernel} (call {call}), "
                                    f"which takes {len(signature)}; rebuild the artifact")
            if phase == "decode" or (phase == "batch" and node.per_sequence):
                steps = (1,)
            elif phase == "batch":
                steps = sorted({2, max_batch})
            else:
                steps = sorted({min(2, prefill_rows), prefill_rows})
            for rows in steps:
                bound: dict[str, int] = {}
                for position, (arg, param) in enumerate(zip(args, signature)):
                    if (arg == START) != (param is None):
                        raise ArtifactError(f"schedule.json passes {arg} as argument {position} of kernel {kernel} "
                                            f"(call {call}), which takes {'a scalar' if param is None else 'a tensor'}"
                                            " there; rebuild the artifact")
                    if param is None:
                        continue
                    info = buffers[arg]
                    if info.dtype != param.get("dtype"):
                        raise disagrees(f"buffers.{arg}.dtype is {info.dtype} but kernel {kernel} (call {call}) "
                                        f"takes {param.get('dtype')}")
                    shape = _shape(info)
                    dims = param.get("shape")
                    # a batch step's one-row buffers where its kernel takes one row (select's union: one list)
                    whole = phase == "batch" and shape[0] == 1 and isinstance(dims, list) and dims[:1] == [1]
                    if info.kind in ROW_KINDS and not whole:
                        if phase == "batch" and node.per_sequence and shape[0] < max_batch:  # row b: the b-th sequence's
                            raise disagrees(f"buffers.{arg}.shape is {shape} but call {call} runs once per sequence "
                                            f"of batch steps of up to {max_batch} rows (model.max_batch)")
                        if shape[0] < rows:
                            limit = "model.max_batch" if phase == "batch" else "the rows of buffers.input_ids"
                            raise disagrees(f"buffers.{arg}.shape is {shape} but call {call} runs {phase} steps of "
                                            f"up to {rows} rows ({limit})")
                        shape[0] = rows
                    fits = isinstance(dims, list) and len(dims) == len(shape)
                    for want, have in zip(dims if fits else [], shape):
                        if isinstance(want, int):
                            fits = fits and want == have
                        elif re.fullmatch(r"[A-Za-z_]\w*", str(want)):  # a size variable: one value per call
                            fits = fits and bound.setdefault(str(want), have) == have
                    if not fits:
                        raise disagrees(f"buffers.{arg}.shape is {info.shape} but kernel {kernel} (call {call}) "
                                        f"takes {_dims(dims) if isinstance(dims, list) else dims} there")
