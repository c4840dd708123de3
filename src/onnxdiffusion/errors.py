"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class UserError(Exception):
    """Bad input or an unusable artifact: say what is wrong, in one line."""


class ModelRunError(UserError):
    """A model's graph failed while running (ONNX Runtime raised): the folder's graph is broken or crafted.
    One line to a user; the service also treats it as a session fault (reload, or mark the model failed)."""
