"""import: load the user's ONNX decoder, fix batch to 1, fold constants and infer shapes.

Reads: a path (the pass's argument), not an IR. Adds: the IR itself, with every graph input's batch
dimension fixed to 1 and constant subgraphs folded (onnxscript's optimizer), so that the recognise pass
sees weights as initializers whatever exporter made the graph. Sequence and past lengths stay symbolic.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import onnx_ir as ir
import onnxscript.optimizer
from onnx_ir.passes import PassResult

from picompile.errors import UserError
from picompile.pipeline import Context

REQUIRED_INPUTS = ("input_ids",)
REQUIRED_OUTPUTS = ("logits",)


def load(path: Path) -> ir.Model:
    if not path.exists():
        raise UserError(f"model file not found: {path}")
    if path.is_dir() or path.stat().st_size == 0:
        raise UserError(f"{path} is not an ONNX model (empty or a directory)")
    try:
        return ir.load(str(path))
    except Exception as error:  # protobuf raises several types for garbage bytes
        raise UserError(f"{path} is not a readable ONNX model ({type(error).__name__}: {error})") from None


@dataclass
class Import:
    name = "import"

    def apply(self, model: ir.Model, ctx: Context) -> PassResult:
        graph = model.graph
        input_names = {v.name for v in graph.inputs}
        output_names = {v.name for v in graph.outputs}
        missing = [n for n in REQUIRED_INPUTS if n not in input_names] + [
            n for n in REQUIRED_OUTPUTS if n not in output_names
        ]
        if missing:
            raise UserError(
                f"model is not a decoder LLM export: it lacks {', '.join(missing)} "
                f"(inputs: {', '.join(sorted(input_names)) or 'none'}; outputs: {', '.join(sorted(output_names)) or 'none'})"
            )
        for value in graph.inputs:
            if value.shape is not None and len(value.shape) > 0 and not isinstance(value.shape[0], int):
                value.shape = ir.Shape([1, *value.shape[1:]])
        try:
            onnxscript.optimizer.optimize(model, num_iterations=2)
        except Exception as error:
            raise UserError(f"constant folding failed on this model: {type(error).__name__}: {error}") from None
        return PassResult(model, modified=True)
