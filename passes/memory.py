"""The build process's own memory, as Linux reports it: resident now, and the peak since it was last reset.

The peak (VmHWM) can be reset by writing 5 to /proc/self/clear_refs (Linux >= 4.0), so each pass's peak is
its own, not the largest of the passes before it. The reset also lowers what getrusage and `time -v` report
as the process's maximum, so `process_peak_bytes` keeps the peaks that resets cleared. Elsewhere (no /proc)
every figure is None.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections import OrderedDict
from pathlib import Path

_STATUS = Path("/proc/self/status")
_cleared_peak = 0  # the largest peak a reset cleared


def _status_bytes(field: str) -> int | None:
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def resident_bytes() -> int | None:
    """The process's resident set now (VmRSS)."""
    return _status_bytes("VmRSS")


def peak_resident_bytes() -> int | None:
    """The largest resident set since the process started or `reset_peak` last ran (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_peak() -> bool:
    """Start a new peak from the resident set now; False where the kernel does not allow it."""
    global _cleared_peak
    _cleared_peak = max(_cleared_peak, peak_resident_bytes() or 0)
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def process_peak_bytes() -> int | None:
    """The largest resident set since the process started, across resets."""
    peak = peak_resident_bytes()
    return None if peak is None else max(peak, _cleared_peak)


def return_freed_memory() -> None:
    """Hand the memory freed so far back to the OS: Python's cycles collected, then glibc's malloc_trim, since
    a loop that makes and drops large buffers (onnxruntime sessions, protobufs) otherwise leaves them in the
    heap's free lists, where they still count as resident. A no-op where there is no glibc."""
    gc.collect()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _libc():
    """glibc's functions (malloc_trim, mallopt), or None where there are none."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None
    except (OSError, TypeError):
        return None


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BUFFER_BYTES = 1 << 20


def map_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Have glibc map every allocation of `threshold` bytes or more by itself and unmap it when freed. By default
    its threshold rises to 32 MiB as such buffers are freed, after which a build's transient arrays (a slice of
    logits, a dequantized matrix, a batch's activations) come from the heap and, freed, stay resident there: the
    quality pass of a 0.5B model peaked 0.9 GiB above what it held. Returns whether it was set (False where
    there is no glibc)."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))


class BoundedCache:
    """Values by key, the most recently read kept while their bytes (as `put` is told) fit `budget`; a value of
    no bytes (one that shares memory something else holds) costs nothing and stays."""

    def __init__(self, budget: int):
        self.budget = budget
        self._values: OrderedDict[object, tuple[object, int]] = OrderedDict()
        self._bytes = 0

    @property
    def bytes(self) -> int:
        """The bytes of what is kept now."""
        return self._bytes

    def get(self, key):
        held = self._values.get(key)
        if held is None:
            return None
        self._values.move_to_end(key)
        return held[0]

    def put(self, key, value, owned: int):
        """Keep `value` (`owned` bytes) where it fits, dropping the least recently read; returns `value`."""
        if owned > self.budget:
            return value
        while self._values and self._bytes + owned > self.budget:
            _, (_, freed) = self._values.popitem(last=False)
            self._bytes -= freed
        self._values[key] = (value, owned)
        self._bytes += owned
        return value
