"""passes.formats.ggml: the table of ggml types agrees with the gguf package, and the decoders read raw blocks into
values equal to the gguf package's dequantization bit for bit (tests.ggml_encode writes the blocks)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from passes.formats.ggml import GGML_TYPES, KEPT_TYPES, LEGACY_TYPES, decode, decode_legacy
from passes.kernels.kquant import KBlocks
from runtime.dtypes import ROUNDABLE_FORMATS, WEIGHT_FORMATS
from tests.ggml_encode import encode, encode_blocks, encode_legacy

# where each type's fp16 fields lie in its block (random bytes there could be NaN or infinity)
FP16_AT = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q4_K": [0, 2], "Q5_K": [0, 2],
           "Q6_K": [208]}
SHAPES = [(1, 1), (3, 4), (7, 2)]  # (rows, blocks per row)


def _qtype(name: str) -> gguf.GGMLQuantizationType:
    return getattr(gguf.GGMLQuantizationType, name)


def _random_raw(name: str, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """Random raw rows of `name`: random bytes, with finite fp16 fields of varied sign and size, some zero (never the
    first block's)."""
    rng = np.random.default_rng(seed)
    t = GGML_TYPES[name]
    raw = rng.integers(0, 256, (rows, blocks, t.type_size), dtype=np.uint8)
    for at in FP16_AT[name]:
        field = (rng.standard_normal((rows, blocks)) * 10.0 ** rng.uniform(-4, 0, (rows, blocks)))
        field[rng.random((rows, blocks)) < 0.15] = 0.0
        field[0, 0] = 0.01  # the first block is never all zeros
        raw[..., at: at + 2] = field.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, blocks * t.type_size)


def _bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, np.float32).view(np.uint32)


def test_table_agrees_with_gguf_sizes():
    sizes = {t.name: size for t, size in gguf.GGML_QUANT_SIZES.items()}
    assert set(GGML_TYPES) == set(sizes)
    for name, t in GGML_TYPES.items():
        assert t.name == name
        assert (t.block, t.type_size) == sizes[name], name
        assert t.bytes_per_weight == t.type_size / t.block


def test_formats_exist_and_price_the_files_bytes():
    for name, t in GGML_TYPES.items():
        if t.format is None:
            assert not t.exact and t.kept_format() is None, name
            continue
        fmt = t.kept_format()
        assert fmt is WEIGHT_FORMATS[t.format]
        if t.exact:
            assert abs(fmt.bytes_per_weight - t.bytes_per_weight) <= 0.05 * t.bytes_per_weight, name
    assert GGML_TYPES["BF16"].format is None and not GGML_TYPES["BF16"].exact
    assert GGML_TYPES["Q2_K"].format is None and GGML_TYPES["Q3_K"].format is None
    for name in KEPT_TYPES:
        fmt = GGML_TYPES[name].kept_format()
        assert GGML_TYPES[name].exact and fmt.kept_from_file and fmt.block * (fmt.super_block or 1) > 0
    for name in LEGACY_TYPES:
        assert GGML_TYPES[name].exact and not GGML_TYPES[name].kept_format().kept_from_file


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", KEPT_TYPES)
def test_decode_equals_gguf_bit_for_bit(name, shape):
    rows, blocks = shape
    columns = blocks * GGML_TYPES[name].block
    raw = _random_raw(name, rows, blocks, seed=rows * 10 + blocks)
    kb = decode(name, raw, columns)
    ref = gguf.quants.dequantize(raw, _qtype(name))
    assert kb.shape == (rows, columns) == ref.shape and kb.axis == 1
    assert np.count_nonzero(ref) > ref.size // 4  # the comparison is not of zeros
    assert np.array_equal(_bits(kb.dequantize()), _bits(ref))
    assert np.array_equal(encode_blocks(kb), raw)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", LEGACY_TYPES)
def test_decode_legacy_equals_gguf_bit_for_bit(name, shape):
    rows, blocks = shape
    raw = _random_raw(name, rows, blocks, seed=rows * 10 + blocks)
    q, scales, mins = decode_legacy(name, raw, blocks * 32)
    fmt = GGML_TYPES[name].kept_format()
    lo, hi = fmt.levels
    assert q.dtype == np.int8 and lo <= q.min() and q.max() <= hi
    assert scales.dtype == np.float16 and scales.shape == (rows, blocks)
    assert (mins is not None) == fmt.has_min
    ref = gguf.quants.dequantize(raw, _qtype(name))
    assert np.count_nonzero(ref) > ref.size // 4
    assert np.array_equal(_bits(fmt.dequantize(q, scales, 1, mins)), _bits(ref))
    assert np.array_equal(encode_legacy(name, q, scales, mins), raw)


@pytest.mark.parametrize("name", KEPT_TYPES + LEGACY_TYPES)
def test_decoding_in_chunks_equals_gguf_bit_for_bit(name, monkeypatch):
    """The decoders and KBlocks.dequantize work a chunk of rows (lines) at a time: chunks that split a matrix
    unevenly, along either axis, change no value."""
    from passes.formats import ggml
    from passes.kernels import kquant

    rows, blocks = 7, 3
    columns = blocks * GGML_TYPES[name].block
    monkeypatch.setattr(ggml, "CHUNK_VALUES", 2 * columns)  # chunks of 2, 2, 2 and 1 rows
    monkeypatch.setattr(kquant, "DEQUANTIZE_CHUNK", 2 * columns)
    raw = _random_raw(name, rows, blocks, seed=5)
    ref = _bits(gguf.quants.dequantize(raw, _qtype(name)))
    if name in LEGACY_TYPES:
        q, scales, mins = decode_legacy(name, raw, columns)
        fmt = GGML_TYPES[name].kept_format()
        assert np.array_equal(_bits(fmt.dequantize(q, scales, 1, mins)), ref)
        codes = q.view(np.uint8) + np.uint8(fmt.offset)
        kb = KBlocks(fmt, 1, codes, scales, mins)
    else:
        kb = decode(name, raw, columns)
        assert np.array_equal(encode_blocks(kb), raw)
    assert np.array_equal(_bits(kb.dequantize()), ref)
    monkeypatch.setattr(kquant, "DEQUANTIZE_CHUNK", 1)  # axis 0 blocked: a (super-)block of lines at a time
    assert np.array_equal(_bits(kb.T.dequantize()), ref.T)
    out = np.full(kb.shape, np.nan, np.float32)
    assert kb.dequantize(out=out) is out and np.array_equal(_bits(out), ref)


def test_decoded_fields_follow_kblocks():
    rows, blocks = 2, 3
    q50 = decode("Q5_0", _random_raw("Q5_0", rows, blocks), blocks * 32)
    assert q50.scales.dtype == np.float16 and q50.scales.shape == (rows, blocks) and q50.mins is None
    assert q50.codes.dtype == np.uint8 and q50.codes.max() <= 31
    q4k = decode("Q4_K", _random_raw("Q4_K", rows, blocks), blocks * 256)
    assert q4k.scales.dtype == np.uint8 and q4k.scales.shape == (rows, blocks * 8) and q4k.scales.max() <= 63
    assert q4k.mins.shape == (rows, blocks * 8) and q4k.super_mins.shape == (rows, blocks)
    assert q4k.super_scales.dtype == np.float16 and q4k.codes.max() <= 15
    q6k = decode("Q6_K", _random_raw("Q6_K", rows, blocks), blocks * 256)
    assert q6k.scales.dtype == np.int8 and q6k.scales.shape == (rows, blocks * 16) and q6k.scales.min() < 0
    assert q6k.super_scales.shape == (rows, blocks) and q6k.codes.max() <= 63 and q6k.mins is None


def _random_kblocks(name: str, rows: int, blocks: int, rng) -> KBlocks:
    """Random KBlocks of a kept type: any codes and sub-scales (Q6_K's negative too), fp16 scales with zeros."""
    fmt = GGML_TYPES[name].kept_format()
    columns = blocks * GGML_TYPES[name].block

    def fp16(n):
        v = rng.standard_normal((rows, n)) * 0.01
        v[rng.random((rows, n)) < 0.2] = 0.0
        return v.astype(np.float16)

    codes = rng.integers(0, 1 << fmt.bits, (rows, columns), dtype=np.uint8)
    if not fmt.super_block:
        return KBlocks(fmt, 1, codes, fp16(columns // 32), fp16(columns // 32) if fmt.has_min else None)
    subs = columns // fmt.block
    if fmt.sub_scale == "int8":
        return KBlocks(fmt, 1, codes, rng.integers(-128, 128, (rows, subs)).astype(np.int8), None, fp16(blocks))
    sub = lambda: rng.integers(0, 64, (rows, subs)).astype(np.uint8)  # noqa: E731
    return KBlocks(fmt, 1, codes, sub(), sub(), fp16(blocks), fp16(blocks))


@pytest.mark.parametrize("name", KEPT_TYPES)
def test_kblocks_round_trip_through_raw(name):
    rng = np.random.default_rng(7)
    kb = _random_kblocks(name, 4, 3, rng)
    raw = encode_blocks(kb)
    assert raw.shape == (4, 3 * GGML_TYPES[name].type_size) and raw.dtype == np.uint8
    back = decode(name, raw, kb.shape[1])
    for field in ("codes", "scales", "mins", "super_scales", "super_mins"):
        a, b = getattr(kb, field), getattr(back, field)
        assert (a is None) == (b is None), field
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8)), field
    assert np.array_equal(_bits(back.dequantize()), _bits(gguf.quants.dequantize(raw, _qtype(name))))


ERROR_BOUND = {"Q4_K": 0.08, "Q5_K": 0.04, "Q6_K": 0.02, "Q5_0": 0.05, "Q5_1": 0.045, "Q8_0": 0.01, "Q4_0": 0.1,
               "Q4_1": 0.09}


@pytest.mark.parametrize("name", list(ERROR_BOUND))
def test_encoders_error_is_small(name):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((32, 1024)).astype(np.float32) * 0.02
    raw = encode(name, w)
    assert raw.shape == (32, 1024 // GGML_TYPES[name].block * GGML_TYPES[name].type_size)
    if name in KEPT_TYPES:
        x = decode(name, raw, 1024).dequantize()
    else:
        q, scales, mins = decode_legacy(name, raw, 1024)
        x = GGML_TYPES[name].kept_format().dequantize(q, scales, 1, mins)
    assert np.array_equal(_bits(x), _bits(gguf.quants.dequantize(raw, _qtype(name))))
    error = np.linalg.norm(x - w) / np.linalg.norm(w)
    assert error < ERROR_BOUND[name], error


def test_k_encoder_keeps_zero_rows_zero():
    w = np.zeros((2, 512), np.float32)
    w[1, 256:] = np.linspace(-1, 1, 256)
    for name in ("Q4_K", "Q5_K", "Q6_K"):
        x = decode(name, encode(name, w), 512).dequantize()
        assert np.array_equal(x[:, :256], w[:, :256]) and np.all(np.isfinite(x)), name
        assert np.abs(x[1, 256:] - w[1, 256:]).max() < 0.05, name


def test_decoders_refuse_what_they_do_not_read():
    raw = np.zeros((2, 144), np.uint8)
    with pytest.raises(ValueError, match="decode_legacy"):
        decode("Q8_0", np.zeros((2, 34), np.uint8), 32)
    with pytest.raises(ValueError, match="no picompile format"):
        decode("Q2_K", np.zeros((2, 84), np.uint8), 256)
    with pytest.raises(ValueError, match="take 288 bytes"):
        decode("Q4_K", raw, 512)
    with pytest.raises(ValueError, match="whole blocks"):
        decode("Q4_K", raw, 200)
    with pytest.raises(ValueError):
        decode_legacy("Q4_K", raw, 256)


def test_the_table_reads_what_the_gguf_package_dequantizes():
    """A type picompile reads (fp32 keeps its values) is a float type, one a picompile format keeps, or one the gguf
    package dequantizes; every other is refused. What auto stores a type in is a format picompile has."""
    for name, t in GGML_TYPES.items():
        dequantized = _qtype(name) in gguf.quants._type_traits
        assert t.read == (name in ("F32", "F16", "BF16") or t.kept_in_blocks or dequantized), name
        assert set(t.exact_in) <= set(ROUNDABLE_FORMATS), name  # --weight-dtype's values
        assert t.auto_format is None or t.auto_format in WEIGHT_FORMATS, name
        if t.kept_in_blocks:
            assert t.auto_format == t.format, name
