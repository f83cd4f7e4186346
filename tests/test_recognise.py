"""The recognise pass lifts every exporter's graph to block ops that compute the same logits."""

from __future__ import annotations

import numpy as np
import pytest

from block_reference import run_blocks
from passes.import_onnx import Import
from passes.front_end import load
from passes.recognise import Recognise
from passes import ir as pir
from passes.pipeline import Context, run_passes, verify_onnx
from passes.reference import OrtDecoder
from passes.targets import get_target

CASES = [(family, exporter) for family in ("opt", "llama") for exporter in ("dynamo", "legacy")]


def lift(path):
    return run_passes(load(path), [Import(), Recognise()], Context(get_target("cpu")), [verify_onnx])


@pytest.mark.parametrize("family,exporter", CASES)
def test_lifted_blocks_compute_the_exported_model(tiny_models, family, exporter):
    files = tiny_models(family, exporter)
    model = lift(files.onnx)
    attention = pir.nodes_in_domain(model, "Attention")
    ffn = pir.nodes_in_domain(model, "FFN")
    assert len(attention) == len(ffn) == 2
    assert [pir.attr(n, "layer") for n in ffn] == [0, 1]
    assert all(pir.attr(n, "gated") == (family == "llama") for n in ffn)
    assert all(pir.attr(n, "activation") == "relu" for n in ffn)
    if family == "llama":  # grouped-query attention with RoPE
        assert pir.attr(attention[0], "num_kv_heads") < pir.attr(attention[0], "num_heads")
        assert attention[0].inputs[8] is not None

    ids = np.random.default_rng(0).integers(0, 100, size=7)
    reference, caches = OrtDecoder(files.onnx), {}
    for begin, end in ((0, 4), (4, 5), (5, 6), (6, 7)):  # a prefill, then decode steps
        expected = reference.forward(ids[begin:end])
        got = run_blocks(model, ids[begin:end], caches, begin)
        np.testing.assert_allclose(got, expected, atol=1e-4, rtol=0)
