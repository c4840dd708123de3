"""User-facing errors: the CLI prints these as one line and exits non-zero."""


class UserError(Exception):
    """Bad input or an unusable artifact: say what is wrong, in one line."""
