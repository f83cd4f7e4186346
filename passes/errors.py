"""The errors users see. `UserError`: a problem with their input, one `error:` line, exit 2.
`PassError`: something broke inside a pass (a bug, or TVM / HiGHS / torch failing), one `error:` line
naming the pass and the layer, exit 1 (an internal error; `-v` adds the traceback)."""


class UserError(Exception):
    """Bad input (file, model, option). The CLI prints `error: <message>` and exits 2."""


class PassError(Exception):
    """An exception escaped a compiler pass; `__cause__` is the original (with its traceback)."""

    def __init__(self, pass_name: str, layer: int | None, error: BaseException):
        self.pass_name, self.layer, self.error = pass_name, layer, error
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        first = next((line for line in lines if not line.startswith(("Traceback", "File ", "  File "))),
                     lines[0] if lines else "")
        self.where = where = f"pass {pass_name}" + (f", layer {layer}" if layer is not None else "")
        super().__init__(f"{where}: {type(error).__name__}: {first}" if first else f"{where}: {type(error).__name__}")
