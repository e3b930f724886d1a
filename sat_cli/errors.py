"""Errors that reach the user as a one-paragraph message and an exit code (no traceback)."""


class UserError(Exception):
    """A problem with the user's input (config, files, paths, run names): exit code 2."""

    code = 2

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class RunFailed(Exception):
    """A run stopped on a runtime fault (a dead process, a non-recoverable I/O error): exit 1."""

    code = 1
