#!/usr/bin/env python
"""The options tables of docs/verbs/VERB.md, read from the CLI itself (the typer app in onnxdiffusion.cli).

Each verb page holds its table between `<!-- options:begin -->` and `<!-- options:end -->`; the rest of the page
(what the verb does, examples, notes) is written by hand. tests/house/test_docs.py fails when an option of a verb is
missing from its page or its help text there differs from `--help`'s.

    python docs/cli_options.py --write    # rewrite every page's table (a new page gets a stub to fill in)
    python docs/cli_options.py --check    # list what is out of date, exit 1 if anything is
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
BEGIN, END = "<!-- options:begin -->", "<!-- options:end -->"


def commands() -> dict:
    """verb -> click command of the onnxdiffusion app."""
    import typer.main

    from onnxdiffusion.cli import app

    return dict(typer.main.get_command(app).commands)


def normalize(text: str | None) -> str:
    return " ".join((text or "").replace("|", "\\|").split())


def option_name(param) -> str:
    """`--quality / --no-quality`, `--output, -o`: how the page names an option."""
    longs = [o for o in param.opts if o.startswith("--")] or list(param.opts)
    name = ", ".join(longs + [o for o in param.opts if o not in longs])
    if getattr(param, "secondary_opts", None):
        name += " / " + ", ".join(param.secondary_opts)
    return name


def primary(param) -> str:
    return next((o for o in param.opts if o.startswith("--")), param.opts[0])


def _default(param) -> str:
    d = param.default
    if d is None or d == () or d == []:
        return ""
    if isinstance(d, bool):
        return primary(param) if d else ""
    return f"`{d}`"


def table(cmd) -> str:
    rows = ["| argument / option | default | what |", "|---|---|---|"]
    for p in cmd.params:
        if p.param_type_name == "argument":
            rows.append(f"| `{p.name.upper()}` (argument) | {'' if p.required else 'optional'} | "
                        f"{normalize(getattr(p, 'help', None))} |")
        elif p.name != "help":
            rows.append(f"| `{option_name(p)}` | {_default(p)} | {normalize(p.help)} |")
    return "\n".join(rows)


def page(verb: str) -> Path:
    return DOCS / "verbs" / f"{verb}.md"


def render(verb: str, cmd, text: str | None) -> str:
    block = f"{BEGIN}\n{table(cmd)}\n{END}"
    if text is None:
        doc = normalize(cmd.help).split(". ")[0]
        return f"# onnxdiffusion {verb}\n\n{doc}.\n\n## Options\n\n{block}\n"
    if BEGIN not in text:
        return text.rstrip() + f"\n\n## Options\n\n{block}\n"
    return re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)


def main(argv: list[str]) -> int:
    write = "--write" in argv
    stale = []
    for verb, cmd in commands().items():
        p = page(verb)
        old = p.read_text() if p.is_file() else None
        new = render(verb, cmd, old)
        if new != old:
            stale.append(str(p.relative_to(DOCS.parent)))
            if write:
                p.parent.mkdir(parents=True, exist_ok=True)
                p.write_text(new)
    for s in stale:
        print(("rewrote " if write else "out of date: ") + s)
    return 0 if write or not stale else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
