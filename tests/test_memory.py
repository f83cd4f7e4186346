"""The build's memory: weights memory-mapped from external data leave the resident set once read."""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from passes import ir as pir
from passes import memory


def test_mapped_weights_leave_the_resident_set_and_read_back_the_same(tmp_path):
    weight = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)  # 64 MiB
    tensor = onnx.numpy_helper.from_array(weight, "w")
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["w"], ["y"])], "g", [],
                                   [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4096, 4096])],
                                   [tensor])
    onnx.save(onnx.helper.make_model(graph), str(tmp_path / "m.onnx"), save_as_external_data=True,
              location="m.onnx.data", size_threshold=0)
    model = ir.load(str(tmp_path / "m.onnx"))
    view = model.graph.initializers["w"].const_value.numpy()  # a view of the file's memory map
    total = float(view.sum(dtype=np.float64))  # every page read in
    resident = memory.resident_bytes()
    assert pir.release_mapped_pages(model) >= weight.nbytes
    assert memory.resident_bytes() < resident - weight.nbytes // 2
    assert float(view.sum(dtype=np.float64)) == total  # read back from the page cache, unchanged
