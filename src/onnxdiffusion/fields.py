"""Option fields: a dataclass field that carries its help text, so one typed options object (GenerateOptions,
ExportOptions, TuneOptions, ...) is the single source of the Python API's keywords, the CLI's options
(cli/options.py turns these fields into options) and the docs (docs/cli_options.py reads --help). A new option is
one field here, not a field plus a hand-written CLI parameter that must keep the same default and words."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any, Callable

HELP = "help"


def option(default: Any = MISSING, help: str | Callable[[], str] = "", *, flags: tuple[str, ...] = (),
           cli_default: Any = MISSING, cli_type: Any = None, metavar: str | None = None,
           convert: Callable[[Any], Any] | None = None, invert: bool = False, default_factory: Any = MISSING) -> Any:
    """A dataclass field that is also a CLI option.

    `help`: its help text (a callable for text computed from the registries, read when the CLI is built);
    `flags`: the option's names when they are not `--field-name` (a short name, a `--no-X` flag);
    `cli_default` / `cli_type`: where the CLI's differ from the field's (a CLI default None that the library
    resolves later; a field that also takes a dict or a number in Python but a string on the CLI); `convert`: the
    CLI value -> the field's value (a repeatable option's list becomes a tuple without one); `invert`: a boolean
    field the CLI sets by the opposite flag (validate=True <- --no-validate off; progress=True <- --quiet off)."""
    meta = {HELP: help, "flags": tuple(flags), "cli_default": cli_default, "cli_type": cli_type,
            "metavar": metavar, "convert": convert, "invert": invert}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def help_text(f) -> str | None:
    """The help of a dataclass field made by option(), None for a field that is not a CLI option."""
    text = f.metadata.get(HELP)
    if text is None:
        return None
    return text() if callable(text) else text
