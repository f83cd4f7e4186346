"""The one error type users see: a problem with their input, reported as one `error:` line, exit 2."""


class UserError(Exception):
    """Bad input (file, model, option). The CLI prints `error: <message>` and exits 2."""
