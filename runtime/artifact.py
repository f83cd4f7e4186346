"""Reading an artifact: the manifest, its checks, and the weights (safetensors, read into aligned memory)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import mmap
import struct
from pathlib import Path

import numpy as np

from . import dtypes
from .manifest import Header, Manifest, structure_problem

FORMAT = "picompile-artifact"
# 2: the manifest carries its own digest (`manifest_sha256`) and kernels/signatures.json lists each kernel's
# argument shapes; the runtime checks the manifest's buffers against the weight files and the kernels.
FORMAT_VERSION = 2
ALIGNMENT = 64  # TVM's kernels assume 64-byte aligned buffers (vector loads); unaligned ones crash
DIGEST_KEY = "manifest_sha256"


class ArtifactError(Exception):
    """The artifact is missing, damaged, or not for this runtime."""


HUGE_PAGE = 2 << 20  # x86-64 transparent huge page
HUGE_MIN_BYTES = 4 * HUGE_PAGE  # arrays at least this large go on huge pages when asked (weights)


def aligned_empty(shape, dtype=np.float32, *, huge: bool = False) -> np.ndarray:
    """An uninitialised 64-byte aligned array. With `huge` (weights), an array of HUGE_MIN_BYTES or more is
    placed in its own anonymous mapping, 2 MiB aligned and advised MADV_HUGEPAGE before it is first touched,
    so that the kernel backs it with transparent huge pages even where THP is `madvise` only (the default of
    many distributions): a decode step reads each layer's weights once, and gathered rows spread over 4 KiB
    pages would cost a page walk for most rows (the page tables of GBs of weights are far larger than the
    TLBs and L2). Where THP is off or the kernel has no huge page to spare it is ordinary memory."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if huge and nbytes >= HUGE_MIN_BYTES and hasattr(mmap, "MADV_HUGEPAGE"):
        region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # refused (THP compiled out): 4 KiB pages, same semantics
            region.madvise(mmap.MADV_HUGEPAGE)
        raw = np.frombuffer(region, np.uint8)
        offset = (-raw.ctypes.data) % HUGE_PAGE
        return raw[offset: offset + nbytes].view(dtype).reshape(shape)
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset: offset + nbytes].view(dtype).reshape(shape)


def aligned_copy(array: np.ndarray) -> np.ndarray:
    """A 64-byte aligned copy of `array`, placed as the runtime places weights where it is large
    (`aligned_empty(huge=True)`): the buffers of a kernel timed outside an artifact."""
    out = aligned_empty(array.shape, array.dtype, huge=True)
    out[...] = array
    return out


def huge_pages_in(array: np.ndarray) -> int:
    """MiB of `array`'s mapping that are backed by transparent huge pages (/proc/self/smaps AnonHugePages;
    0 where unknown): what shows whether `aligned_empty(huge=True)` got them."""
    address = array.ctypes.data
    try:
        with open("/proc/self/smaps") as f:
            inside = False
            for line in f:
                head = line.split(" ", 1)[0]
                if "-" in head and ":" not in head:
                    begin, end = (int(part, 16) for part in head.split("-"))
                    inside = begin <= address < end
                elif inside and line.startswith("AnonHugePages:"):
                    return int(line.split()[1]) // 1024
    except (OSError, ValueError):
        return 0
    return 0


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    """A 64-byte aligned array of zeros. numpy takes zeroed memory from calloc, whose large blocks are fresh
    anonymous mappings: their pages cost memory only once written (a KV cache for a long context is resident as
    far as a sequence has filled it, not at load)."""
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.zeros(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset: offset + nbytes].view(dtype).reshape(shape)


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def first_line(error: BaseException, default: str = "") -> str:
    """The first non-blank line of an exception's message (libraries put tracebacks and notes below it),
    or `default` when it has none: what a one-line `error:` message quotes."""
    return next((line.strip() for line in str(error).splitlines() if line.strip()), default)


def format_size(n: float) -> str:
    """Bytes as the largest binary unit that keeps the number >= 1: '1.50 GiB', '300.00 KiB', '12 B'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def host_bytes(manifest: Manifest, slots: int = 1, used=None) -> int:
    """Host memory an engine allocates for the artifact: every buffer of the manifest (or of `used`, one stage's),
    weights included, with the KV cache (buffers of kind "cache") once per slot."""
    sizes = [(info.kind, dtypes.nbytes(info.shape, info.dtype)) for name, info in manifest.buffers.items()
             if used is None or name in used]
    return sum(size * (slots if kind == "cache" else 1) for kind, size in sizes)


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def manifest_digest(manifest: dict) -> str:
    """The sha256 of the manifest's canonical JSON (sorted keys, no spaces) without its own digest: what
    `manifest_sha256` holds. The writer adds it; `load_manifest` recomputes it."""
    body = {key: value for key, value in manifest.items() if key != DIGEST_KEY}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def seal_manifest(manifest: dict) -> dict:
    """`manifest` with its digest set (the writer's last step before writing manifest.json)."""
    return {**{key: value for key, value in manifest.items() if key != DIGEST_KEY}, DIGEST_KEY: manifest_digest(manifest)}


# Files every artifact has; the manifest must list them (with their hashes) or it is not trusted.
REQUIRED_FILES = ("schedule.json", "kernels/cpu.so", "kernels/signatures.json")


def load_manifest(directory: Path, check_hashes: bool = True, weights_later: bool = False) -> Manifest:
    """The artifact's manifest, after checking that it is one this runtime reads and that every file it
    lists is present, a plain file inside the artifact, and (unless `check_hashes` is off) has its sha256.
    Callers load only listed files, and only after this returns: a damaged kernel library is refused
    here, before anything dlopens it. `weights_later`: the weight files' hashes are left to the caller, who reads
    some of them only (one stage of a split model: `check_hash` each file it reads, before reading it)."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a picompile artifact (no manifest.json)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path} is damaged (not valid JSON: {error})") from None
    header = Header.of(data)
    if header is None or header.format != FORMAT:
        raise ArtifactError(f"{path} is not a picompile manifest")
    version = header.format_version
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArtifactError(f"{path} is damaged (format_version {version!r} is not an integer)")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} was built by a newer picompile "
                            f"(this runtime reads version {FORMAT_VERSION}): upgrade picompile")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is older than this runtime reads "
                            f"({FORMAT_VERSION}): rebuild it")
    try:
        intact = header.manifest_sha256 == manifest_digest(data)
    except (TypeError, ValueError):  # not JSON-serialisable back (NaN, ...): edited
        intact = False
    if not intact:  # edited by hand (or damaged in a way that still parses); the consistency checks come later
        raise ArtifactError("manifest.json was edited or damaged (sha256 mismatch): rebuild the artifact")
    problem = structure_problem(data)
    if problem is not None:
        raise ArtifactError(f"{path} is damaged: {problem}")
    try:
        manifest = Manifest.from_json(data)
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ArtifactError(f"{path} is damaged: {first_line(error, type(error).__name__)}") from None
    files = manifest.files
    for relative in REQUIRED_FILES:
        if relative not in files:
            raise ArtifactError(f"{path} is damaged: it does not list {relative}")
    root = directory.resolve()
    for relative, expected in files.items():
        file = directory / relative
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            raise ArtifactError(f"{path} is damaged: file {relative!r} lies outside the artifact")
        if file.is_symlink():
            raise ArtifactError(f"artifact file {relative} is a link; an artifact holds plain files only")
        if not file.is_file() or root not in file.resolve().parents:
            raise ArtifactError(f"artifact {directory} is incomplete: {relative} is missing")
        if check_hashes and not (weights_later and _is_weight_file(relative)):
            check_hash(directory, relative, expected)
    return manifest


def check_hash(directory: Path, relative: str, expected: str) -> None:
    """The artifact file has the sha256 its manifest lists, else an ArtifactError."""
    if sha256(Path(directory) / relative) != expected:
        raise ArtifactError(f"artifact file {relative} is damaged (sha256 mismatch): rebuild the artifact")


def _is_weight_file(relative: str) -> bool:
    return relative.startswith("weights/") and relative.endswith(".safetensors")


def read_json(directory: Path, relative: str):
    """A JSON file of the artifact (one `load_manifest` has checked): damaged content is an ArtifactError."""
    try:
        return json.loads((Path(directory) / relative).read_text())
    except (OSError, ValueError, UnicodeDecodeError) as error:
        raise ArtifactError(f"artifact file {relative} is damaged ({first_line(error, type(error).__name__)}): "
                            "rebuild the artifact") from None


def weight_files(directory: Path, manifest: Manifest) -> list[Path]:
    """The weight files the manifest lists (and `load_manifest` checked); stray files are never read."""
    return [Path(directory) / relative for relative in sorted(manifest.files) if _is_weight_file(relative)]


def _cpuinfo_field(name: str) -> str | None:
    """The first `name` line's value in Linux's /proc/cpuinfo, None where it cannot be read."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def cpu_flags() -> frozenset[str] | None:
    """This machine's CPU flags (Linux's /proc/cpuinfo), or None where they cannot be read."""
    flags = _cpuinfo_field("flags")
    return None if flags is None else frozenset(flags.split())


def cpu_model_name() -> str:
    """This machine's CPU model as /proc/cpuinfo names it ("unknown CPU" where it cannot be read)."""
    return _cpuinfo_field("model name") or "unknown CPU"


def missing_cpu_features(required) -> list[str]:
    """The flags of `required` this machine's CPU lacks (where its flags cannot be read, nothing is
    reported missing)."""
    flags = cpu_flags()
    return [] if flags is None else [flag for flag in required if flag not in flags]


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """The tensors a safetensors file holds, from its header alone (no data read): name -> {"shape",
    "dtype" (the manifest's spelling, e.g. float32), "data_offsets"}. Each entry is checked against the
    file: a known element type, offsets inside the data whose length is shape x element size, so that
    what is later read from the file is exactly what the header says."""
    path = Path(path)
    where = f"weights file {path.parent.name}/{path.name}"
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) != 8:
                raise ValueError("no header")
            (header_size,) = struct.unpack("<Q", raw)
            if header_size > size - 8:
                raise ValueError(f"its header claims {header_size} bytes")
            header = json.loads(f.read(header_size))
    except (OSError, ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise ArtifactError(f"{where} is damaged ({first_line(error, type(error).__name__)}): rebuild the artifact") from None
    if not isinstance(header, dict):
        raise ArtifactError(f"{where} is damaged (its header is not a table of tensors): rebuild the artifact")
    data_bytes = size - 8 - header_size
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ArtifactError(f"{where} is damaged (tensor {name} has no entry): rebuild the artifact")
        dtype = dtypes.BY_SAFETENSORS.get(info.get("dtype"))
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if dtype is None:
            raise ArtifactError(f"{where}: tensor {name} has element type {info.get('dtype')!r}, which this runtime "
                                f"does not read (it reads {', '.join(dtypes.BY_SAFETENSORS)})")
        if not (isinstance(shape, list) and all(map(_is_count, shape)) and isinstance(offsets, list)
                and len(offsets) == 2 and all(map(_is_count, offsets))
                and offsets[1] - offsets[0] == dtypes.nbytes(shape, dtype.name) and offsets[1] <= data_bytes):
            raise ArtifactError(f"{where} is damaged (tensor {name}: shape {shape}, bytes {offsets} do not fit the "
                                "file): rebuild the artifact")
        tensors[name] = {"shape": list(shape), "dtype": dtype.name, "data_offsets": list(offsets)}
    return tensors


def read_safetensors(path: Path, header: dict[str, dict] | None = None, names=None) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file (or those of `names` only: the rest of the file is never read) into
    its own 64-byte aligned array (shapes and types from its header, checked by `read_safetensors_header` unless the
    caller passes what that returned); the large ones on transparent huge pages where the system grants them
    (`aligned_empty(huge=True)`)."""
    path = Path(path)
    header = read_safetensors_header(path) if header is None else header
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        base = 8 + header_size
        tensors = {}
        for name, info in header.items():
            if names is not None and name not in names:
                continue
            begin, end = info["data_offsets"]
            array = aligned_empty(info["shape"], dtypes.get_dtype(info["dtype"]).numpy, huge=True)
            f.seek(base + begin)
            if f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != end - begin:
                raise ArtifactError(f"{path.name}: tensor {name} is truncated")
            tensors[name] = array
    return tensors
