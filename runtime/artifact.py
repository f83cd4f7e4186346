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


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def load_manifest(directory: Path, check_hashes: bool = True) -> dict:
    directory = Path(directory)
    path = directory / "manifest.json"
    if not path.is_file():
        raise ArtifactError(f"{directory} is not a picompile artifact (no manifest.json)")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path} is not valid JSON: {error}") from None
    if manifest.get("format") != FORMAT:
        raise ArtifactError(f"{path} is not a picompile manifest")
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(f"artifact format version {version} is not supported by this runtime (it reads {FORMAT_VERSION}); rebuild it")
    for relative, expected in manifest.get("files", {}).items():
        file = directory / relative
        if not file.is_file():
            raise ArtifactError(f"artifact file missing: {relative}")
        if check_hashes and sha256(file) != expected:
            raise ArtifactError(f"artifact file {relative} is damaged (sha256 mismatch)")
    return manifest


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
