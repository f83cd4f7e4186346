"""Compiler passes, one module each. Every pass is a dataclass whose fields are the options it reads; it
reads the IR (an onnx_ir.Model) and a Context and returns a PassResult; each module's docstring says what
it reads from the IR and what it adds. `picompile.compiler.pipeline` builds them."""
