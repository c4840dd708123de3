"""The docs say what the CLI does: every option of every verb (read from the typer app) has a row in its page
docs/verbs/VERB.md with the help text `--help` prints; the README stays short with the quickstart first; every
relative link in the README and docs/ resolves."""

from __future__ import annotations

import re
from pathlib import Path

import typer.main

from onnxdiffusion.cli import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FIX = "run `python docs/cli_options.py --write` and describe it"


def _norm(text: str | None) -> str:
    return " ".join((text or "").replace("|", "\\|").split())


def _options_block(page: Path) -> list[str]:
    text = page.read_text()
    m = re.search(r"<!-- options:begin -->(.*?)<!-- options:end -->", text, re.S)
    return m.group(1).strip().splitlines() if m else []


def test_every_option_of_every_verb_is_documented():
    problems = []
    for verb, cmd in typer.main.get_command(app).commands.items():
        page = DOCS / "verbs" / f"{verb}.md"
        if not page.is_file():
            problems.append(f"onnxdiffusion {verb}: no page docs/verbs/{verb}.md ({FIX})")
            continue
        rows = _options_block(page)
        if not rows:
            problems.append(f"onnxdiffusion {verb}: docs/verbs/{verb}.md has no options table ({FIX})")
            continue
        for p in cmd.params:
            if p.param_type_name != "option" or p.name == "help":
                continue
            flag = next((o for o in p.opts if o.startswith("--")), p.opts[0])
            row = next((r for r in rows if re.match(r"\| `" + re.escape(flag) + r"[`,/ ]", r)), None)
            if row is None:
                problems.append(f"onnxdiffusion {verb}: option {flag} is not documented in docs/verbs/{verb}.md ({FIX})")
            elif _norm(p.help) not in row:
                problems.append(f"onnxdiffusion {verb}: option {flag}'s help in docs/verbs/{verb}.md differs from "
                                f"--help ({_norm(p.help)!r}; {FIX})")
        documented = {m.group(1) for r in rows for m in [re.match(r"\| `(--[\w-]+)", r)] if m}
        known = {o for p in cmd.params for o in p.opts}
        for flag in sorted(documented - known):
            problems.append(f"onnxdiffusion {verb}: docs/verbs/{verb}.md documents {flag}, which the CLI does not have")
    assert not problems, "\n".join(problems)


def test_readme_is_short_and_starts_with_the_quickstart():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md is {len(lines)} lines; move detail into docs/"
    first_screen = "\n".join(lines[:60])
    assert "make demo" in first_screen and "make test" in first_screen
    for verb in typer.main.get_command(app).commands:
        assert f"docs/verbs/{verb}.md" in "\n".join(lines), f"README.md does not link docs/verbs/{verb}.md"


def test_relative_links_resolve():
    broken = []
    pages = [ROOT / "README.md", *sorted(DOCS.rglob("*.md")), *sorted((ROOT / "experiments").glob("**/README.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, "broken links:\n" + "\n".join(broken)
