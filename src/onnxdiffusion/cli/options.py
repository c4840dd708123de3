"""A verb's options from a typed options object: every field made by `fields.option()` becomes a typer option
(its name, type, default and help from the field), and the verb receives one instance of the object instead of
one parameter per field. Verb-only arguments (MODEL, PROMPT, --output) stay in the verb's own signature."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
import typing
from typing import Annotated, Any, Optional

import typer

from ..fields import help_text


def from_fields(cls, into: str, *, skip: tuple[str, ...] = ()):
    """Decorate a verb whose parameter `into` is a `cls` instance: that parameter becomes `cls`'s option fields (in
    field order, where `into` stood), and the verb is called with `cls(**those values)`. `skip`: fields the verb
    declares itself or does not take."""
    def decorate(fn):
        sig = inspect.signature(fn, eval_str=True)
        params = list(sig.parameters.values())
        at = [p.name for p in params].index(into)
        fields = [f for f in dataclasses.fields(cls) if help_text(f) is not None and f.name not in skip]
        clash = {f.name for f in fields} & {p.name for p in params}
        if clash:
            raise TypeError(f"{fn.__name__}: {sorted(clash)} are both verb parameters and {cls.__name__} fields")
        hints = typing.get_type_hints(cls)
        made = [_parameter(f, hints[f.name]) for f in fields]
        new = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in params[:at] + made + params[at + 1:]]

        @functools.wraps(fn)
        def verb(**kwargs):
            values = {f.name: _value(f, kwargs.pop(f.name)) for f in fields}
            return fn(**kwargs, **{into: cls(**values)})

        verb.__signature__ = sig.replace(parameters=new)
        verb.__annotations__ = {p.name: p.annotation for p in new}
        del verb.__wrapped__  # typer reads the signature above, not the verb's own
        return verb
    return decorate


def _parameter(f, hint) -> inspect.Parameter:
    meta = f.metadata
    kind = _cli_type(meta["cli_type"] if meta["cli_type"] is not None else hint)
    default = meta["cli_default"]
    if default is dataclasses.MISSING:  # a field without a default: a required option
        default = f.default if f.default is not dataclasses.MISSING else inspect.Parameter.empty
    if meta["invert"]:  # --no-validate, --quiet: a flag whose value is the field's negation
        kind, default = bool, not f.default
    info = typer.Option(*meta["flags"], help=help_text(f), metavar=meta["metavar"])
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default,
                             annotation=Annotated[kind, info])


def _cli_type(hint) -> Any:
    """The field's type as typer takes it: `X | None` -> Optional[X], a tuple -> a repeatable option."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"{hint}: give the field a cli_type")
        return Optional[_cli_type(rest[0])]
    if typing.get_origin(hint) is tuple:
        return Optional[list[args[0] if args else str]]
    return hint


def _value(f, value):
    meta = f.metadata
    if meta["invert"]:
        return not value
    if meta["convert"] is not None:
        return meta["convert"](value)
    if isinstance(value, list):
        return tuple(value)
    if value is None and f.default is not None and f.default is not dataclasses.MISSING \
            and meta["cli_default"] is dataclasses.MISSING:
        return f.default
    return value

