"""cli/options.py: a verb's options are the fields of its typed options object (fields.option), so a new option
is one field, and the CLI's options keep the names, defaults and help the typed objects declare."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from onnxdiffusion.cli.options import from_fields
from onnxdiffusion.fields import help_text, option


@dataclass(frozen=True)
class Knobs:
    level: str = option(help="required: no default")
    steps: int | None = option(None, "how many steps")
    names: tuple[str, ...] = option((), "repeatable", flags=("--name", "-N"))
    check: bool = option(True, "skip the check", flags=("--no-check",), invert=True)
    spec: str | dict | None = option(None, "a spec string (a dict in Python)", cli_type=str | None)
    budget: tuple[str, ...] = option(("a", "b"), "comma-separated", cli_type=str, cli_default="a,b",
                                     convert=lambda s: tuple(s.split(",")))
    internal: int = 3  # no help: not an option


def _app(seen: list):
    app = typer.Typer()

    @app.command()
    @from_fields(Knobs, "knobs")
    def verb(thing: Annotated[Path, typer.Argument(help="a path")], knobs: Knobs,
             loud: Annotated[bool, typer.Option(help="verb-only")] = False) -> None:
        """A verb."""
        seen.append((thing, knobs, loud))

    @app.command()
    def other() -> None:
        """Another verb, so `verb` is a subcommand."""
    return app


def test_fields_become_options_and_the_verb_gets_one_object():
    seen = []
    app = _app(seen)
    r = CliRunner().invoke(app, ["verb", "x", "--level", "hi", "--steps", "3", "-N", "a", "--name", "b",
                                 "--no-check", "--spec", "s:1", "--budget", "c,d,e", "--loud"])
    assert r.exit_code == 0, r.output
    thing, knobs, loud = seen[0]
    assert (thing, loud) == (Path("x"), True)
    assert knobs == Knobs(level="hi", steps=3, names=("a", "b"), check=False, spec="s:1", budget=("c", "d", "e"))


def test_defaults_are_the_fields_defaults():
    seen = []
    r = CliRunner().invoke(_app(seen), ["verb", "x", "--level", "lo"])
    assert r.exit_code == 0, r.output
    assert seen[0][1] == Knobs(level="lo")


def test_names_help_and_required_come_from_the_fields():
    cmd = typer.main.get_command(_app([])).commands["verb"]
    params = {p.name: p for p in cmd.params}
    assert "internal" not in params
    assert params["level"].required
    assert params["steps"].help == "how many steps" and params["steps"].opts == ["--steps"]
    assert set(params["names"].opts) == {"--name", "-N"} and params["names"].multiple
    assert params["check"].opts == ["--no-check"] and params["check"].is_flag and not params["check"].secondary_opts
    assert params["budget"].default == "a,b"
    # the argument, the fields where the options object stood, then the verb's own option
    assert [p.name for p in cmd.params] == ["thing", "level", "steps", "names", "check", "spec", "budget", "loud"]


def test_a_field_named_like_a_verb_parameter_is_refused():
    with pytest.raises(TypeError, match="both verb parameters"):
        @from_fields(Knobs, "knobs")
        def verb(knobs: Knobs, steps: int = 1) -> None:
            pass


@pytest.mark.parametrize("verb, cls", [("generate", "GenerateOptions"), ("generate", "GenerateRequest"),
                                       ("export", "ExportOptions"), ("quantize", "QuantizeOptions"),
                                       ("tune", "TuneOptions"), ("compile-loop", "LoopOptions"),
                                       ("bench", "BenchOptions"), ("serve", "ServeConfig"),
                                       ("add-controlnet", "AddControlNetOptions")])
def test_every_typed_field_with_help_is_an_option_of_its_verb(verb, cls):
    from onnxdiffusion.cli import app
    from onnxdiffusion.export.options import AddControlNetOptions, ExportOptions
    from onnxdiffusion.quantize.options import QuantizeOptions
    from onnxdiffusion.runtime.options import GenerateOptions, GenerateRequest
    from onnxdiffusion.bench.options import BenchOptions
    from onnxdiffusion.loopgraph.options import LoopOptions
    from onnxdiffusion.serve.config import ServeConfig
    from onnxdiffusion.tune.run import TuneOptions

    typed = {c.__name__: c for c in (GenerateOptions, GenerateRequest, ExportOptions, QuantizeOptions, TuneOptions,
                                     LoopOptions, BenchOptions, ServeConfig, AddControlNetOptions)}
    helps = {p.help for p in typer.main.get_command(app).commands[verb].params if hasattr(p, "help")}
    for f in dataclasses.fields(typed[cls]):
        if help_text(f) is not None:
            assert help_text(f) in helps, f.name


def test_add_controlnet_takes_its_options_object():
    """add-controlnet's options are AddControlNetOptions' fields (no hand-written typer.Option left in cli/controlnet.py):
    --name required, --overwrite off, --backbone none."""
    from onnxdiffusion.cli import app
    from onnxdiffusion.export.options import AddControlNetOptions

    params = {p.name: p for p in typer.main.get_command(app).commands["add-controlnet"].params}
    assert [p for p in params if p not in ("model", "controlnet")] == [f.name for f in dataclasses.fields(AddControlNetOptions)]
    assert params["name"].required and params["overwrite"].default is False and params["backbone"].default is None
    source = (Path(__file__).resolve().parents[2] / "src" / "onnxdiffusion" / "cli" / "controlnet.py").read_text()
    assert "typer.Option(" not in source
