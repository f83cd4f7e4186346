"""numpy references shared by the CPU and CUDA kernel tests (the kernels of both share one contract)."""

from __future__ import annotations

import math
import struct

import numpy as np


def act_ref(v, act):
    if act == "relu":
        return np.maximum(v, 0)
    if act == "gelu":
        return 0.5 * v * (1 + np.vectorize(math.erf, otypes=[np.float64])(v / math.sqrt(2)))
    if act == "gelu_tanh":  # torch's approximate="tanh", as written
        return 0.5 * v * (1 + np.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3)))
    if act == "silu":
        return v / (1 + np.exp(-v))
    return v


def int8_blocks_ref(x, block=32):
    """x (float32 values) as the int8-activation kernels quantize it (quant.x_quantizer): per block of the last
    axis, scale max|x| / 127 (fp32), q = round(x * (127 / max|x|)); returns q * scale in float64."""
    blocks = np.asarray(x, np.float32).reshape(-1, block)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    xq = np.round(blocks * inv) * (amax / np.float32(127)).astype(np.float64)
    return xq.reshape(np.shape(x))


def close(got, ref, tol=1e-4):
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def kname(kind, cfg, variant):
    return f"{kind}_{cfg}_{variant}"


def attention_ref(q, kc, vc, start, H, KVH, hd, scale):
    m = q.shape[0]
    out = np.zeros((m, H * hd))
    for i in range(m):
        n = start + i + 1
        for h in range(H):
            g = h // (H // KVH)
            s = scale * (kc[g, :n].astype(np.float64) @ q[i, h * hd : (h + 1) * hd])
            p = np.exp(s - s.max())
            out[i, h * hd : (h + 1) * hd] = (p / p.sum()) @ vc[g, :n]
    return out


def rope_ref(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


# rope_kv_write's q / k norm in the kernel tests: (q_norm, k_norm) weights are drawn per test, with this eps
QK_NORM_EPS = 1e-6


def check_rope_kv_write(qkv, cos, sin, kc, vc, kc0, vc0, q, heads, start, rope, norms=None):
    """After rope_kv_write: q and the cache rows at start.. are the (RMS-normed, where `norms` gives the q and
    k weights; rotated, where `rope`) heads of qkv; every other cache position is as it was (kc0, vc0)."""
    H, KVH, hd = heads
    m, max_ctx = qkv.shape[0], kc.shape[1]
    pos = slice(start, start + m)
    qh = qkv[:, : H * hd].reshape(m, H, hd).astype(np.float64)
    kh = qkv[:, H * hd : (H + KVH) * hd].reshape(m, KVH, hd).astype(np.float64)
    vh = qkv[:, (H + KVH) * hd :].reshape(m, KVH, hd)
    if norms is not None:
        qh, kh = (x / np.sqrt((x * x).mean(-1, keepdims=True) + QK_NORM_EPS) * w for x, w in zip((qh, kh), norms))
    if rope:
        c, s = cos[pos][:, None, :], sin[pos][:, None, :]
        qh, kh = rope_ref(qh, c, s), rope_ref(kh, c, s)
    close(q, qh.reshape(m, H * hd), tol=1e-5)
    close(kc[:, pos], kh.transpose(1, 0, 2), tol=1e-5)
    np.testing.assert_array_equal(vc[:, pos], vh.transpose(1, 0, 2))
    untouched = np.ones(max_ctx, bool)
    untouched[pos] = False
    np.testing.assert_array_equal(kc[:, untouched], kc0[:, untouched])
    np.testing.assert_array_equal(vc[:, untouched], vc0[:, untouched])


def aligned(array: np.ndarray) -> np.ndarray:
    """A 64-byte aligned copy (TVM's kernels assume aligned buffers)."""
    from runtime.artifact import aligned_empty

    out = aligned_empty(array.shape, array.dtype)
    out[...] = array
    return out


def fatbin_entries(binary):
    """[(kind, sm, payload)] of a fatbin; kind 1 = PTX, 2 = ELF (SASS), sm e.g. 80.

    Container: u32 magic 0xBA55ED50, u16 version, u16 header size, u64 payload size; then entries,
    each: u16 kind, u16 version, u32 header size, u64 padded payload size, ..., u32 sm at +0x1c.
    """
    magic, _, header, size = struct.unpack_from("<IHHQ", binary, 0)
    assert magic == 0xBA55ED50, "not a fatbin"
    entries, pos = [], header
    while pos < header + size:
        kind, _, ehs, padded = struct.unpack_from("<HHIQ", binary, pos)
        sm = struct.unpack_from("<I", binary, pos + 0x1C)[0]
        entries.append((kind, sm, binary[pos + ehs : pos + ehs + padded]))
        pos += ehs + padded
    return entries
