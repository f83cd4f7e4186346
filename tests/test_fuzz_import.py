"""Property-based fuzzing of import + recognise: a tiny real export, mutated (a node dropped, an input
rewired, an attribute, dtype or shape changed, an initializer deleted, the bytes truncated), must either
compile or raise UserError; never another exception.

Bounded for the normal suite (PICOMPILE_FUZZ_EXAMPLES, default 100, derandomized so CI is repeatable);
raise it for a longer local hunt, e.g. PICOMPILE_FUZZ_EXAMPLES=2000 PICOMPILE_FUZZ_RANDOM=1.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from passes.import_onnx import Import
from passes.front_end import load
from passes.recognise import Recognise
from passes.errors import UserError
from passes.pipeline import Context, run_passes
from passes.targets import get_target

EXAMPLES = int(os.environ.get("PICOMPILE_FUZZ_EXAMPLES", "100"))
OPS = ["Relu", "Gelu", "Tanh", "Add", "Mul", "MatMul", "Gemm", "Softmax", "Reshape", "Transpose", "Identity",
       "Gather", "Cast", "Sigmoid", "LayerNormalization", "Concat", "NoSuchOp"]
DTYPES = [onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE, onnx.TensorProto.INT64, onnx.TensorProto.INT8,
          onnx.TensorProto.BOOL, onnx.TensorProto.STRING, 0, 999]


def mutate(proto: onnx.ModelProto, data, kind: str) -> None:
    graph = proto.graph
    pick = lambda seq: data.draw(st.integers(0, len(seq) - 1))  # noqa: E731
    if kind == "drop_node":
        del graph.node[pick(graph.node)]
    elif kind == "rewire_input":
        node = graph.node[pick(graph.node)]
        if node.input:
            names = [o for n in graph.node for o in n.output] + [t.name for t in graph.initializer] + ["", "dangling"]
            node.input[pick(node.input)] = names[pick(names)]
    elif kind == "change_op":
        graph.node[pick(graph.node)].op_type = data.draw(st.sampled_from(OPS))
    elif kind == "change_attribute":
        nodes = [n for n in graph.node if n.attribute]
        attribute = nodes[pick(nodes)].attribute
        a = attribute[pick(attribute)]
        if a.type == onnx.AttributeProto.INT:
            a.i = data.draw(st.integers(-3, 70000))
        elif a.type == onnx.AttributeProto.FLOAT:
            a.f = data.draw(st.floats(allow_nan=True, allow_infinity=True, width=32))
        elif a.type == onnx.AttributeProto.INTS:
            a.ints[:] = data.draw(st.lists(st.integers(-3, 5), max_size=4))
        else:
            a.type = onnx.AttributeProto.INT  # a type that does not match the field set
    elif kind == "change_dtype":
        tensor = graph.initializer[pick(graph.initializer)]
        tensor.data_type = data.draw(st.sampled_from(DTYPES))
    elif kind == "change_shape":
        tensor = graph.initializer[pick(graph.initializer)]
        tensor.dims[:] = data.draw(st.lists(st.integers(0, 300), max_size=3))
    elif kind == "delete_initializer":
        del graph.initializer[pick(graph.initializer)]
    elif kind == "change_graph_input":
        value = graph.input[pick(graph.input)]
        if data.draw(st.booleans()):
            value.type.tensor_type.elem_type = data.draw(st.sampled_from(DTYPES[:5]))
        else:
            del value.type.tensor_type.shape.dim[:]
    elif kind == "drop_output":
        del graph.output[pick(graph.output)]


def compile_front(path: Path) -> None:
    with tempfile.TemporaryDirectory() as workdir:
        run_passes(load(path), [Import(), Recognise()], Context(get_target("cpu"), workdir=Path(workdir)))


@pytest.fixture(scope="session")
def base_bytes(tiny_models):
    return tiny_models("opt", "legacy").onnx.read_bytes()


KINDS = ["drop_node", "rewire_input", "change_op", "change_attribute", "change_dtype", "change_shape",
         "delete_initializer", "change_graph_input", "drop_output", "truncate"]


@settings(max_examples=EXAMPLES, deadline=None, derandomize=not os.environ.get("PICOMPILE_FUZZ_RANDOM"),
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], database=None)
@given(data=st.data())
def test_mutated_models_raise_only_user_errors(base_bytes, tmp_path, caplog, data):
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=1, max_size=2))
    proto = onnx.load_from_string(base_bytes)
    for kind in kinds:
        if kind != "truncate":
            mutate(proto, data, kind)
    blob = proto.SerializeToString()
    if "truncate" in kinds:
        blob = blob[: data.draw(st.integers(1, len(blob) - 1))]
    path = tmp_path / "model.onnx"
    path.write_bytes(blob)
    caplog.clear()
    try:
        compile_front(path)
    except UserError as error:
        message = str(error)
        assert message and "\n" not in message.strip()  # one line for the CLI's `error:`
    # library warnings would reach the CLI user's stderr beside the `error:` line
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
