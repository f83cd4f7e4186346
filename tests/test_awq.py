"""--quant-method awq: the channel-scale search, its exact folding into the norm, the fitted block scales, and
the pipelines that run it. (What it buys a model's KL is measured in benchmarks: tiny models are too small to
show it.)"""

from __future__ import annotations


from types import SimpleNamespace

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from passes.awq import AwqReport, mean_magnitude, search_scales
from passes.kernels import quant
from passes.front_end import load
from passes.profile import ProfiledActivations
from passes import ir as pir
from picompile.cli import main
from picompile.compiler import build, pipeline
from passes.pipeline import Context, Options, run_passes
from passes.targets import get_target
from runtime.artifact import load_manifest
from runtime.dtypes import WEIGHT_FORMATS

INT4 = WEIGHT_FORMATS["int4"]
OUTLIERS = (3, 17, 40)  # FFN input channels made large
OUTLIER_GAIN = 30.0


def _outlier_inputs(rng, tokens: int, width: int) -> np.ndarray:
    x = rng.standard_normal((tokens, width)).astype(np.float32)
    x[:, list(OUTLIERS)] *= OUTLIER_GAIN
    return x


def test_the_search_never_does_worse_than_no_scales_and_scales_outlier_channels():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 96)).astype(np.float32)
    w[list(OUTLIERS)] /= OUTLIER_GAIN  # the weights an outlier channel multiplies are small, as in trained models
    b = rng.standard_normal(96).astype(np.float32)
    x = _outlier_inputs(rng, 256, 64)
    found = search_scales(x, w, b, mean_magnitude(x), INT4, relu=True)
    assert found.alpha > 0 and found.scales is not None
    assert found.error < 0.7 * found.unscaled_error
    assert np.all(found.scales[list(OUTLIERS)] > 5 * np.median(found.scales))
    assert abs(np.log(found.scales).mean()) < 1e-4  # geometric mean 1
    plain = rng.standard_normal((256, 64)).astype(np.float32)  # no outliers: the search may keep alpha 0
    uniform = search_scales(plain, w * 0 + rng.standard_normal(w.shape).astype(np.float32), None,
                            mean_magnitude(plain), INT4, relu=False)
    assert uniform.error <= uniform.unscaled_error


@pytest.fixture(scope="module")
def outlier_opt(tiny_models, tmp_path_factory):
    """The tiny sparse OPT with outlier FFN input channels, as trained LLMs have them: some channels of each
    FFN norm's scale and bias multiplied by OUTLIER_GAIN and the up weights of those channels divided by it.
    The model computes the same function, but those channels' weights now round coarsely."""
    files = tiny_models("opt", sparsity=0.9)
    model = onnx.load(files.onnx)
    channels = list(OUTLIERS)
    for init in model.graph.initializer:
        if init.name.endswith(("final_layer_norm.weight", "final_layer_norm.bias", "fc1.weight")):
            array = numpy_helper.to_array(init).copy()
            if init.name.endswith("fc1.weight"):  # [ffn, d_model]: a column per input channel
                array[:, channels] /= OUTLIER_GAIN
            else:
                array[channels] *= OUTLIER_GAIN
            init.CopyFrom(numpy_helper.from_array(array, init.name))
    directory = tmp_path_factory.mktemp("outlier-opt")
    onnx.save(model, directory / "model.onnx")
    return SimpleNamespace(onnx=directory / "model.onnx", calib=files.calib)


def _passes(files, quant_method: str, dense: bool = False):
    # every neuron passes the predictor: only the weights' rounding moves the logits
    options = Options(max_context=64, calib=files.calib, dense=dense, weight_dtype="int4", quant_method=quant_method,
                      all_neurons=not dense)
    return options, pipeline(options, "dense" if dense else "predictor")


def test_the_scales_fold_into_the_norm_the_up_rows_and_the_profile_exactly(outlier_opt, tmp_path):
    options, passes = _passes(outlier_opt, "awq")
    index = next(i for i, p in enumerate(passes) if p.name == "awq")
    ctx = Context(get_target("cpu"), workdir=tmp_path, options=options)
    model = run_passes(load(outlier_opt.onnx), passes[:index], ctx)
    ffns = pir.nodes_in_domain(model, "FFN")
    before = {}
    profiled = ProfiledActivations.of(model)
    for node in ffns:
        layer = pir.attr(node, "layer")
        norm = node.inputs[0].producer()
        before[layer] = ([pir.const_array(v).copy() for v in norm.inputs[1:]], pir.const_array(node.inputs[1]).copy(),
                         np.array(profiled.layer(layer).inputs[:64]))
    passes[index].apply(model, ctx)
    report = AwqReport.of(model)
    assert {r.layer for r in report.layers} == set(before) and not report.unscaled
    alphas = {entry.layer: entry.alpha for entry in report.layers}
    assert all(entry.error <= entry.unscaled_error for entry in report.layers)
    assert any(alpha > 0 for alpha in alphas.values())  # outliers: some layer must gain from scales
    for node in ffns:
        layer = pir.attr(node, "layer")
        (scale, bias), w_up, inputs = before[layer]
        norm = node.inputs[0].producer()
        new_scale, new_bias = (pir.const_array(v) for v in norm.inputs[1:])
        s = pir.const_array(node.inputs[1])[:, 0] / w_up[:, 0]
        if alphas[layer] == 0:  # left alone
            assert np.array_equal(pir.const_array(node.inputs[1]), w_up) and np.array_equal(new_scale, scale)
            continue
        assert s[list(OUTLIERS)].min() > np.median(s)
        np.testing.assert_allclose(new_scale * s, scale, rtol=1e-5)
        np.testing.assert_allclose(new_bias * s, bias, rtol=1e-5, atol=1e-7)
        new_inputs = np.asarray(profiled.layer(layer).inputs[:64])
        np.testing.assert_allclose(new_inputs * s, inputs, rtol=1e-5, atol=1e-6)
        # what the up projection computes is unchanged in floats
        np.testing.assert_allclose(new_inputs @ pir.const_array(node.inputs[1]), inputs @ w_up, rtol=1e-4,
                                   atol=1e-4 * np.abs(inputs @ w_up).max())


def test_awq_runs_where_it_can_fold_and_a_quantized_build_asks():
    names = lambda options, mode: [p.name for p in pipeline(options, mode)]  # noqa: E731
    assert names(Options(weight_dtype="int4"), "predictor").index("awq") == \
        names(Options(weight_dtype="int4"), "predictor").index("profile") + 1
    assert names(Options(weight_dtype="int8", dense=True), "dense")[2:4] == ["profile", "awq"]
    assert "awq" not in names(Options(weight_dtype="int4", quant_method="rtn"), "predictor")
    assert "awq" not in names(Options(weight_dtype="fp16"), "predictor")
    assert "awq" not in names(Options(weight_dtype="int4", sparsity_mode="threshold"), "threshold")
    assert "profile" not in names(Options(weight_dtype="int4", dense=True, quant_method="rtn"), "dense")
    with pytest.raises(ValueError, match="unknown quantization method"):
        pipeline(Options(weight_dtype="int4", quant_method="gptq"), "predictor")


def test_fitted_block_scales_round_each_block_no_worse_than_the_largest_weight_rule():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((96, 40)).astype(np.float32) * rng.uniform(0.1, 3.0, (96, 1)).astype(np.float32)
    for name in ("int4", "int8"):
        fmt = WEIGHT_FORMATS[name]
        nearest = quant.dequantize(*quant.quantize(w, fmt, 0), 0)
        q, scales = quant.quantize(w, fmt, 0, fit_scales=True)
        fitted = quant.dequantize(q, scales, 0)
        assert q.min() >= -(1 << (fmt.bits - 1)) and q.max() < (1 << (fmt.bits - 1))
        per_block = lambda approx: ((approx - w) ** 2).reshape(3, 32, 40).sum(1)  # noqa: E731
        assert np.all(per_block(fitted) <= per_block(nearest) + 1e-9)
        assert per_block(fitted).sum() < 0.95 * per_block(nearest).sum()
        assert np.array_equal(quant.as_stored(fitted, fmt, 0), quant.dequantize(*quant.quantize(fitted, fmt, 0), 0))


def test_a_dense_awq_build_profiles_for_its_scales_and_says_which_method_it_used(outlier_opt, tmp_path, capsys):
    """Dense int4 builds with awq (the default) profile the calibration tokens for the channel scales; the
    artifact's summary names the method, and its weights round closer than round-to-nearest's."""
    summaries = {}
    for method in ("awq", "rtn"):
        options, passes = _passes(outlier_opt, method, dense=True)
        assert ("profile" in [p.name for p in passes]) == (method == "awq")
        artifact = build(outlier_opt.onnx, tmp_path / f"{method}.pic", get_target("cpu"), options, passes=passes)
        summaries[method] = load_manifest(artifact).quantization
        assert summaries[method].method == method
        assert main(["inspect", str(artifact)]) == 0
        assert ("awq channel scales on" in capsys.readouterr().out) == (method == "awq")
    assert summaries["awq"].mean_relative_error < summaries["rtn"].mean_relative_error
