"""Reading an artifact: the manifest, its checks, and the weights (safetensors, read into aligned memory)."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

FORMAT = "picompile-artifact"
FORMAT_VERSION = 1
ALIGNMENT = 64  # TVM's kernels assume 64-byte aligned buffers (vector loads); unaligned ones crash

_DTYPES = {"F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32}


class ArtifactError(Exception):
    """The artifact is missing, damaged, or not for this runtime."""


def aligned_empty(shape, dtype=np.float32) -> np.ndarray:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = np.empty(nbytes + ALIGNMENT, np.uint8)
    offset = (-raw.ctypes.data) % ALIGNMENT
    return raw[offset: offset + nbytes].view(dtype).reshape(shape)


def aligned_zeros(shape, dtype=np.float32) -> np.ndarray:
    array = aligned_empty(shape, dtype)
    array.fill(0)
    return array


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


def host_bytes(manifest: dict) -> int:
    """Host memory an engine allocates for the artifact: every buffer of the manifest, weights included."""
    return sum(int(np.prod(info["shape"])) * np.dtype(info["dtype"]).itemsize for info in manifest["buffers"].values())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# Files every artifact has; the manifest must list them (with their hashes) or it is not trusted.
REQUIRED_FILES = ("schedule.json", "kernels/cpu.so")


def load_manifest(directory: Path, check_hashes: bool = True) -> dict:
    """The artifact's manifest, after checking that it is one this runtime reads and that every file it
    lists is present, a plain file inside the artifact, and (unless `check_hashes` is off) has its sha256.
    Callers load only listed files, and only after this returns: a damaged kernel library is refused
    here, before anything dlopens it."""
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a picompile artifact (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path} is damaged (not valid JSON: {error})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a picompile manifest")
    version = manifest.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ArtifactError(f"{path} is damaged (format_version {version!r} is not an integer)")
    if version > FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} was built by a newer picompile "
                            f"(this runtime reads version {FORMAT_VERSION}): upgrade picompile")
    if version < FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is older than this runtime reads "
                            f"({FORMAT_VERSION}): rebuild it")
    _check_structure(manifest, path)
    files = manifest["files"]
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
        if check_hashes and sha256(file) != expected:
            raise ArtifactError(f"artifact file {relative} is damaged (sha256 mismatch): rebuild the artifact")
    return manifest


def _check_structure(manifest: dict, path: Path) -> None:
    """The fields the runtime reads, with their types: a hand-edited manifest fails here, not deep in the engine."""
    expected = {"files": dict, "model": dict, "buffers": dict, "target": dict}
    for key, kind in expected.items():
        if not isinstance(manifest.get(key), kind):
            raise ArtifactError(f"{path} is damaged: {key!r} is missing or not a {kind.__name__}")
    for key in ("max_context", "vocab_size"):
        if not isinstance(manifest["model"].get(key), int):
            raise ArtifactError(f"{path} is damaged: model.{key} is missing or not an integer")
    for relative, digest in manifest["files"].items():
        if not (isinstance(digest, str) and len(digest) == 64):
            raise ArtifactError(f"{path} is damaged: the sha256 of {relative} is malformed")


def weight_files(directory: Path, manifest: dict) -> list[Path]:
    """The weight files the manifest lists (and `load_manifest` checked); stray files are never read."""
    return [Path(directory) / relative for relative in sorted(manifest["files"])
            if relative.startswith("weights/") and relative.endswith(".safetensors")]


def missing_cpu_features(required) -> list[str]:
    """The flags of `required` this machine's CPU lacks (Linux's /proc/cpuinfo; where it cannot be read,
    nothing is reported missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return []
    return [] if flags is None else [flag for flag in required if flag not in flags]


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """Read every tensor of a safetensors file into its own 64-byte aligned array."""
    with open(path, "rb") as f:
        (header_size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_size))
        base = 8 + header_size
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            array = aligned_empty(info["shape"], _DTYPES[info["dtype"]])
            f.seek(base + begin)
            if f.readinto(memoryview(array.reshape(-1).view(np.uint8))) != end - begin:
                raise ArtifactError(f"{path.name}: tensor {name} is truncated")
            tensors[name] = array
    return tensors
