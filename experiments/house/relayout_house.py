"""Issue 41's relayout of the house, replayable: run it on any tree of this project (a branch, the merged main) and it
moves the package's modules and the tests into the layout docs/layout.md draws, rewrites every import and every
module path or dotted module name that names a moved file, and turns the slow tier's name lists in
tests/conftest.py into markers in the test files. Safe to re-run: what is already in place is left alone.

    python experiments/house/relayout_house.py [--dry-run] [--no-probe]

Where it moves what (the lead's layout, issue 41):
  cli.py, cli_*.py             -> cli/__init__.py, cli/*.py (the `cli_` prefix dropped)
  samplers/graph*.py           -> loopgraph/ (graph.py -> builder.py, graph_X.py -> X.py)
  loops.py, loops_*.py         -> loopgraph/compile.py, loopgraph/compile_*.py
  schedules.py                 -> samplers/schedules.py
  artifacts, manifest (file or package), relayout, paths, tempfiles, imageio -> folder/
  scenes.py                    -> evaluate/scenes.py (the judge's scenes; evaluate, quantize, bench read them)
  fixup_trt.py                 -> export/fixup_trt.py (an export-side repair of a foreign export, beside fixups.py)
  tests/test_*.py              -> tests/<package>/ (TEST_HOMES; a file it does not know: by what it imports)
  tests/<other>.py (helpers)   -> tests/helpers/ (conftest puts it on sys.path: `from cli_helpers import ...` stays)
  experiments/house/behaviour_hashes.py, behaviour_baseline.json -> bench/ (a test loads them; tests import no
                                  experiments/)

Imports are rewritten from the syntax tree (relative imports recomputed from the file's new place, `from . import
cli_pipeline` -> `from . import pipeline as cli_pipeline`, so names bound in the file stay); the rest (strings
given to monkeypatch, importlib, `-m`, docs) by a whole-word pass over dotted names `onnxdiffusion.X` and paths
`onnxdiffusion/X.py`, `samplers/graph_X.py`, `tests/test_X.py`.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path

PKG_NAME = "onnxdiffusion"

# -- where each test lives: the package it mainly tests ----------------------------------------------------------
TEST_HOMES = {
    "cli": ["test_bad_inputs", "test_bad_inputs_embedded", "test_cli_errors", "test_controlnet_cli", "test_faults",
            "test_img2img_cli", "test_signals"],
    "runtime": ["test_cache", "test_cache_int8", "test_cache_residual", "test_controlnet", "test_controlnet_flux",
                "test_controlnet_qwen", "test_controlnet_sd3", "test_dead_queries", "test_flow_runtime",
                "test_folder_scheduler", "test_hardening", "test_img2img", "test_inpaint", "test_inpaint_flow",
                "test_memory_lean", "test_pipeline_parity", "test_runtime_no_torch", "test_static_shapes",
                "test_stop_early", "test_tiny_vae", "test_vae_tiling"],
    "loopgraph": ["test_loop_graph", "test_cache_loop", "test_stop_loop"],
    "samplers": ["test_samplers", "test_more_samplers", "test_flow_samplers", "test_scheduler_configs"],
    "export": ["test_export_attention", "test_external_data", "test_flow_export", "test_single_file",
               "test_fixup_trt", "test_fixup_trt_families", "test_optimum_interop"],
    "families": ["test_family_sd3", "test_family_sdxl", "test_flow_families"],
    "adapters": ["test_lora", "test_lora_bad_inputs", "test_lora_families", "test_lora_fused"],
    "quantize": ["test_quantize", "test_quantize_adapter", "test_quantize_bias", "test_quantize_components",
                 "test_quantize_files", "test_quantize_groups", "test_quantize_int4_algorithms",
                 "test_quantize_lowbit", "test_quantize_stages", "test_lowbit", "test_portable_rounding",
                 "test_behaviour_hashes", "test_family_quantize", "test_precision_schedule"],
    "cpu": ["test_int8_lowering"],
    "onnxio": ["test_fp16_storage"],
    "serve": ["test_serve", "test_serve_auth", "test_serve_edits", "test_serve_limits", "test_serve_lora",
              "test_serve_ray", "test_batch", "test_controlnet_serve"],
    "bench": ["test_bench", "test_bench_compare", "test_bench_isolate", "test_roofline", "test_machine_facts",
              "test_gpu_bundle", "test_peers"],
    "evaluate": ["test_metrics", "test_judge", "test_scenes_condition"],
    "web": ["test_web"],
    "folder": ["test_confinement", "test_manifest_property", "test_fuzz_folders"],
    "profiles": ["test_profiles"],
    # the shipped models under models/ and their training scripts (models/training)
    "models": ["test_embedded_model", "test_mmdit_model", "test_shipped_controlnet", "test_shipped_lora",
               "test_compare_eval", "test_train_tiny_vae", "test_training_parse"],
    # the house's own checks: rules over all of src/, the docs against the CLI, every script still loads
    "house": ["test_house_rules", "test_docs", "test_bench_scripts"],
}
# imports that say little about which package a test is for
_GENERIC = {"errors", "evaluate", "folder"}

# files moved outside src/ (old -> new, relative to the root)
TOOL_MOVES = {
    "experiments/house/behaviour_hashes.py": "bench/behaviour_hashes.py",
    "experiments/house/behaviour_baseline.json": "bench/behaviour_baseline.json",
}
# the same files named as Path joins
LITERAL_MOVES = {
    'ROOT / "experiments" / "house" / "behaviour_hashes.py"': 'ROOT / "bench" / "behaviour_hashes.py"',
    'ROOT / "experiments" / "house" / "behaviour_baseline.json"': 'ROOT / "bench" / "behaviour_baseline.json"',
}
TEXT_SCOPES = ("src", "tests", "bench", "experiments", "models", "docs")
TEXT_FILES = ("README.md", "Makefile")
TEXT_SUFFIXES = {".py", ".md", ".sh", ".toml", ".yaml", ".yml", ".txt", ".mjs", ".cfg"}

LOG: list[str] = []
WARN: list[str] = []


def say(msg: str) -> None:
    LOG.append(msg)
    print(msg)


def warn(msg: str) -> None:
    WARN.append(msg)
    print(f"WARNING: {msg}")


def git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], check=True, capture_output=True, text=True).stdout


# -- the src/ plan ----------------------------------------------------------------------------------------------

def src_moves(pkg: Path) -> dict[str, str]:
    """Old -> new path of every file to move, relative to src/onnxdiffusion (only those still at their old place)."""
    moves: dict[str, str] = {}

    def add(old: str, new: str) -> None:
        if (pkg / old).exists():
            if (pkg / new).exists():
                warn(f"both {old} and {new} exist: {old} left where it is")
            else:
                moves[old] = new

    add("cli.py", "cli/__init__.py")
    for p in sorted(pkg.glob("cli_*.py")):
        add(p.name, f"cli/{p.name[len('cli_'):]}")
    for p in sorted((pkg / "samplers").glob("graph*.py")):
        stem = p.stem
        add(f"samplers/{p.name}", "loopgraph/builder.py" if stem == "graph" else f"loopgraph/{stem[len('graph_'):]}.py")
    add("loops.py", "loopgraph/compile.py")
    for p in sorted(pkg.glob("loops_*.py")):
        add(p.name, f"loopgraph/compile_{p.stem[len('loops_'):]}.py")
    add("schedules.py", "samplers/schedules.py")
    for name in ("artifacts", "relayout", "paths", "tempfiles", "imageio", "manifest"):
        add(f"{name}.py", f"folder/{name}.py")
    if (pkg / "manifest").is_dir():  # a typed manifest package: moved whole
        for p in sorted((pkg / "manifest").rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts:
                rel = p.relative_to(pkg).as_posix()
                add(rel, f"folder/{rel}")
    add("scenes.py", "evaluate/scenes.py")
    add("fixup_trt.py", "export/fixup_trt.py")
    return moves


def module_of(rel: str) -> str:
    """src/onnxdiffusion-relative path -> dotted module name."""
    parts = [PKG_NAME, *Path(rel).with_suffix("").parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


class Mapper:
    def __init__(self, moves: dict[str, str]):
        self.map = {module_of(o): module_of(n) for o, n in moves.items() if o.endswith(".py")}
        self.keys = sorted(self.map, key=len, reverse=True)

    def __call__(self, name: str) -> str:
        for old in self.keys:
            if name == old or name.startswith(old + "."):
                return self.map[old] + name[len(old):]
        return name


# -- import rewriting -------------------------------------------------------------------------------------------

def _resolve(module: str | None, level: int, package: str) -> str:
    if not level:
        return module or ""
    base = package.split(".")
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def _relative(target: str, package: str) -> str:
    p, t = package.split("."), target.split(".")
    common = 0
    while common < min(len(p), len(t)) and p[common] == t[common]:
        common += 1
    return "." * (len(p) - common + 1) + ".".join(t[common:])


def _segment(lines: list[str], node: ast.AST) -> tuple[int, int, int, int]:
    """Node position as (line, char col, end line, end char col), 0-based lines (ast gives UTF-8 byte columns)."""
    def col(line: int, b: int) -> int:
        return len(lines[line].encode()[:b].decode(errors="ignore"))
    return (node.lineno - 1, col(node.lineno - 1, node.col_offset),
            node.end_lineno - 1, col(node.end_lineno - 1, node.end_col_offset))


def _offsets(text: str, node: ast.AST) -> tuple[int, int]:
    """Node position as character offsets into text."""
    lines = text.splitlines(keepends=True)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln))
    l0, c0, l1, c1 = _segment([ln.rstrip("\r\n") for ln in lines], node)
    return starts[l0] + c0, starts[l1] + c1


MAX_LINE = 120


def _format_from(indent: int, spec: str, names: list[str], tail: int) -> str:
    """`from spec import names` within MAX_LINE where it fits; else in parentheses, the names aligned after them."""
    one = f"from {spec} import {', '.join(names)}"
    if indent + len(one) + tail <= MAX_LINE:
        return one
    first = f"from {spec} import ("
    pad = indent + len(first)
    lines, line = [], first
    for i, n in enumerate(names):
        item = n + (", " if i < len(names) - 1 else ")")
        if len(line) > len(first) and indent + len(line) + len(item.rstrip()) > MAX_LINE:
            lines.append(line.rstrip())
            line = " " * pad
        line += item
    lines.append(line)
    return ("\n" + " " * indent).join([lines[0]] + [ln[indent:] for ln in lines[1:]])


def rewrite_imports(text: str, old_mod: str, new_mod: str, is_pkg: bool, mapper: Mapper, known: set[str],
                    where: str) -> str:
    """Every import of an onnxdiffusion module in `text` (a file whose module was old_mod and is new_mod) mapped
    through `mapper`; relative imports stay relative, computed from the new place."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        warn(f"{where}: not parsed ({e}); its imports are left as they are")
        return text
    old_pkg = old_mod if is_pkg else old_mod.rpartition(".")[0]
    new_pkg = new_mod if is_pkg else new_mod.rpartition(".")[0]
    edits = []
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = []
            changed = False
            for a in node.names:
                new = mapper(a.name) if a.name.startswith(PKG_NAME + ".") else a.name
                changed |= new != a.name
                names.append(new + (f" as {a.asname}" if a.asname else ""))
            if changed:
                if not all(a.asname for a in node.names):
                    warn(f"{where}:{node.lineno}: `import {', '.join(a.name for a in node.names)}` without `as`: "
                         "its uses are rewritten by the dotted-name pass")
                edits.append((node, "import " + ", ".join(names)))
        elif isinstance(node, ast.ImportFrom):
            if not old_mod.startswith(PKG_NAME) and node.level:
                continue  # a relative import outside the package (tests, scripts): not ours
            src_mod = _resolve(node.module, node.level, old_pkg)
            if src_mod != PKG_NAME and not src_mod.startswith(PKG_NAME + "."):
                continue
            groups: dict[str, list[str]] = {}
            renamed = False
            for a in node.names:
                full = f"{src_mod}.{a.name}"
                if a.name != "*" and full in known:  # `from pkg import module`
                    new_full = mapper(full)
                    parent, _, leaf = new_full.rpartition(".")
                    bound = a.asname or a.name
                    renamed |= leaf != a.name
                    # a module imported for its side effects only (cli's verbs) needs no alias of its old name
                    unused = bound not in used
                    groups.setdefault(parent, []).append(leaf if leaf == bound or (unused and not a.asname)
                                                         else f"{leaf} as {bound}")
                else:
                    groups.setdefault(mapper(src_mod), []).append(a.name + (f" as {a.asname}" if a.asname else ""))
            specs = {parent: (_relative(parent, new_pkg) if node.level else parent) for parent in groups}
            old_spec = "." * node.level + (node.module or "")
            if len(groups) == 1 and not renamed:
                (spec,) = specs.values()
                if spec != old_spec:
                    edits.append((node, ("respec", spec, groups[next(iter(groups))])))
            else:
                edits.append((node, [(specs[p], names) for p, names in groups.items()]))
    for node, new in sorted(edits, key=lambda e: (e[0].lineno, e[0].col_offset), reverse=True):
        a, b = _offsets(text, node)
        seg = text[a:b]
        head = text[text.rfind("\n", 0, a) + 1:a]
        tail = len(text[b:].split("\n", 1)[0])
        if isinstance(new, tuple):
            body = re.sub(r"^from\s+[.\w]*\s+import", f"from {new[1]} import", seg, count=1)
            if "#" not in seg and len(head) + max(map(len, body.splitlines())) + tail > MAX_LINE:
                body = _format_from(len(head), new[1], new[2], tail)
        elif isinstance(new, list):
            if head.strip() and len(new) > 1:
                warn(f"{where}:{node.lineno}: an import split in two after `;`: check it by hand")
                body = "; ".join(f"from {spec} import {', '.join(names)}" for spec, names in new)
            else:
                body = ("\n" + head).join(_format_from(len(head), spec, names, tail if i == len(new) - 1 else 0)
                                          for i, (spec, names) in enumerate(new))
        else:
            body = new
        text = text[:a] + body + text[b:]
    return text


# -- the dotted-name and path pass ------------------------------------------------------------------------------

def text_pass_patterns(moves: dict[str, str], mapper: Mapper, test_moves: dict[str, str]):
    dotted = {old: new for old, new in mapper.map.items() if old != new}
    paths: dict[str, str] = {}
    for old, new in moves.items():
        paths[f"{PKG_NAME}/{old}"] = f"{PKG_NAME}/{new}"
        if old.startswith("samplers/graph"):  # "samplers/graph_cache.py" is how the docs name them
            paths[old] = new
    paths.update(test_moves)
    paths.update(TOOL_MOVES)
    dotted_re = re.compile(r"(?<![\w.])(" + "|".join(re.escape(k) for k in sorted(dotted, key=len, reverse=True))
                           + r")(?!\w)") if dotted else None
    paths_re = re.compile(r"(?<![\w.-])(" + "|".join(re.escape(k) for k in sorted(paths, key=len, reverse=True))
                          + r")(?![\w])") if paths else None
    return dotted, dotted_re, paths, paths_re


_RULER = re.compile(r"^(\s*#.*?) (-{4,})$", re.M)


def bare_names(moves: dict[str, str], pkg: Path) -> dict[str, str]:
    """A moved module's file name as prose names it ("(graph_cache.py)", "`loops.py`") -> its new path in the
    package; only names that no file staying where it is bears (adapters/graph.py: "graph.py" stays), and not
    cli.py (a word of cli's own code)."""
    staying = {p.name for p in pkg.rglob("*.py") if p.relative_to(pkg).as_posix() not in moves}
    out = {}
    for old, new in moves.items():
        name = Path(old).name
        if "/" in old and not old.startswith("samplers/graph") or name in ("__init__.py", "cli.py") or name in staying:
            continue
        out[name] = new
    return out


def bare_pass(text: str, bare: dict[str, str], home: str | None) -> str:
    """`home`: the package folder (relative to src/onnxdiffusion) of the file being rewritten, None outside it;
    a name of the same package stays bare, another gets its package."""
    if not bare:
        return text
    pattern = re.compile(r"(?<=[\s`(\"'\[])(" + "|".join(re.escape(k) for k in sorted(bare, key=len, reverse=True))
                         + r")(?![\w/])")

    def sub(m):
        new = bare[m.group(1)]
        folder, _, name = new.rpartition("/")
        return name if home and folder == home else new
    return pattern.sub(sub, text)


def text_pass(text: str, dotted, dotted_re, paths, paths_re) -> str:
    if dotted_re:
        text = dotted_re.sub(lambda m: dotted[m.group(1)], text)
    if paths_re:
        text = paths_re.sub(lambda m: paths[m.group(1)], text)
    # a section ruler (`# -- title ----`) that a longer path pushed past the margin is cut back to it
    return _RULER.sub(lambda m: m.group(0) if len(m.group(0)) <= MAX_LINE else
                      f"{m.group(1)} {'-' * max(4, MAX_LINE - len(m.group(1)) - 1)}", text)


# -- tests --------------------------------------------------------------------------------------------------------

def test_home(path: Path, mapper: Mapper) -> str | None:
    stem = path.stem
    for home, stems in TEST_HOMES.items():
        if stem in stems:
            return home
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return None
    count: Counter = Counter()
    for node in ast.walk(tree):
        mods = []
        if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith(PKG_NAME):
            mods = [mapper(f"{node.module}.{a.name}") for a in node.names] if node.module == PKG_NAME else \
                [mapper(node.module)]
        elif isinstance(node, ast.Import):
            mods = [mapper(a.name) for a in node.names if a.name.startswith(PKG_NAME + ".")]
        for m in mods:
            parts = m.split(".")
            if len(parts) > 1:
                count[parts[1]] += 1
    ranked = [(m, n) for m, n in count.most_common() if m not in _GENERIC] or count.most_common()
    if ranked and (len(ranked) == 1 or ranked[0][1] > ranked[1][1]):
        home = ranked[0][0]
        if (path.parents[1] / "src" / PKG_NAME / home).is_dir() or home in TEST_HOMES:
            return home
    # a sibling by name: test_cache_magcache.py beside test_cache.py
    best = None
    for home, stems in TEST_HOMES.items():
        for s in stems:
            if stem.startswith(s + "_") and (best is None or len(s) > len(best[1])):
                best = (home, s)
    if best:
        return best[0]
    if ranked and (path.parents[1] / "src" / PKG_NAME / ranked[0][0]).is_dir():
        return ranked[0][0]
    return None


def plan_tests(root: Path, mapper: Mapper) -> dict[str, str]:
    tests = root / "tests"
    moves = {}
    for p in sorted(tests.glob("*.py")):
        if p.name == "conftest.py":
            continue
        if p.name.startswith("test_"):
            home = test_home(p, mapper)
            if home is None:
                warn(f"tests/{p.name}: no home found (imports no onnxdiffusion package); left at tests/")
                continue
            moves[f"tests/{p.name}"] = f"tests/{home}/{p.name}"
        else:
            moves[f"tests/{p.name}"] = f"tests/helpers/{p.name}"
    return moves


_PROBE = '''
import json, os
import pytest

@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    out = []
    for it in items:
        out.append({"file": str(it.path.relative_to(config.rootpath)), "func": getattr(it, "originalname", None) or it.name,
                    "cls": it.cls.__name__ if getattr(it, "cls", None) else None,
                    "slow": it.get_closest_marker("slow") is not None})
    with open(os.environ["RELAYOUT_PROBE_OUT"], "w") as f:
        json.dump(out, f)
'''


def probe_slow(root: Path) -> list[dict]:
    """Every test item and whether the slow tier holds it, as the old conftest.py decides (collection only)."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "relayout_probe.py").write_text(_PROBE)
        out = Path(tmp) / "items.json"
        env = {**os.environ, "RELAYOUT_PROBE_OUT": str(out), "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([tmp, str(root / "src"), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "relayout_probe",
                               "-n", "0", "--collect-only", "-qq", "tests"], cwd=root, env=env,
                              capture_output=True, text=True)
        if not out.exists():
            raise SystemExit(f"collection failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        items = json.loads(out.read_text())
        broken = sorted(set(re.findall(r"ERROR collecting (tests/\S+\.py)", proc.stdout)))
        if broken:
            warn(f"these test files do not import, so collection cannot tell their tier: {', '.join(broken)}; "
                 "they get the slow marker by the old lists read as written (module names, test names, fixtures "
                 "named in a test's own parameters)")
            items += static_tier(root, broken)
        return items


def static_tier(root: Path, files: list[str]) -> list[dict]:
    """The old conftest's rule read from the source, for a test file that cannot be collected."""
    lists = {}
    for node in ast.parse((root / "tests" / "conftest.py").read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("SLOW_FIXTURES", "SLOW_MODULES", "SLOW_TESTS"):
            lists[node.targets[0].id] = set(ast.literal_eval(node.value))
    items = []
    for rel in files:
        tree = ast.parse((root / rel).read_text())
        scopes = [(None, tree.body)] + [(n.name, n.body) for n in tree.body if isinstance(n, ast.ClassDef)]
        for cls, body in scopes:
            for f in body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and f.name.startswith("test"):
                    params = {a.arg for a in f.args.args}
                    slow = (Path(rel).name in lists.get("SLOW_MODULES", ()) or f.name in lists.get("SLOW_TESTS", ())
                            or bool(params & lists.get("SLOW_FIXTURES", set())))
                    items.append({"file": rel, "func": f.name, "cls": cls, "slow": slow})
    return items


def _has_slow(decorators: list[ast.expr], text: str) -> bool:
    return any("mark.slow" in (ast.get_source_segment(text, d) or "") for d in decorators)


def _module_mark(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return node
    return None


def _ensure_import_pytest(text: str, tree: ast.Module) -> str:
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name == "pytest" and not a.asname for a in node.names):
            return text
    after = 0
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            after = node.end_lineno
        elif isinstance(node, ast.ImportFrom) and node.module == "__future__":
            after = node.end_lineno
        else:
            break
    lines = text.splitlines(keepends=True)
    lines.insert(after, "\nimport pytest\n" if after else "import pytest\n")
    return "".join(lines)


def mark_slow(path: Path, items: list[dict]) -> list[str]:
    """Give `path` the slow markers the old conftest lists gave its items: pytestmark when the whole file is slow,
    else a decorator on each test function (or class) whose items all are."""
    text = path.read_text()
    tree = ast.parse(text)
    if not any(i["slow"] for i in items):
        return []
    mark = _module_mark(tree)
    if mark is not None and "mark.slow" in (ast.get_source_segment(text, mark.value) or ""):
        return []
    lines = text.splitlines(keepends=True)
    done = []
    if all(i["slow"] for i in items):
        if mark is None:
            insert_at = 0
            for node in tree.body:  # after the last import above the first def or class
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    break
                if isinstance(node, (ast.Import, ast.ImportFrom)) or (
                        isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]):
                    insert_at = node.end_lineno
            lines.insert(insert_at, "\npytestmark = pytest.mark.slow\n")
        else:
            a, b = _offsets(text, mark.value)
            seg = text[a:b]
            new = "[pytest.mark.slow, " + seg[1:] if isinstance(mark.value, ast.List) else f"[{seg}, pytest.mark.slow]"
            lines = (text[:a] + new + text[b:]).splitlines(keepends=True)
        done.append(f"{path.name}: pytestmark slow ({len(items)} tests)")
    else:
        by_def: dict[tuple, list[bool]] = defaultdict(list)
        for i in items:
            by_def[(i["cls"], i["func"])].append(i["slow"])
        targets = []
        classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
        funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for (cls, func), flags in by_def.items():
            if not any(flags):
                continue
            if not all(flags):
                warn(f"{path.name}::{func}: only some of its parametrizations were slow: marked slow as a whole")
            scope = classes.get(cls) if cls else None
            if cls and scope is None:
                warn(f"{path.name}::{cls}.{func}: class not found at module level; not marked")
                continue
            body = {n.name: n for n in scope.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))} \
                if scope else funcs
            node = body.get(func)
            if node is None:
                warn(f"{path.name}::{func}: its def is not in the file; not marked")
                continue
            if _has_slow(node.decorator_list, text) or (scope is not None and _has_slow(scope.decorator_list, text)):
                continue
            targets.append(node)
        for node in sorted(targets, key=lambda n: n.lineno, reverse=True):
            first = min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1
            indent = re.match(r"\s*", lines[first]).group(0)
            lines.insert(first, f"{indent}@pytest.mark.slow\n")
            done.append(f"{path.name}::{node.name}: @pytest.mark.slow")
    new_text = "".join(lines)
    new_text = _ensure_import_pytest(new_text, ast.parse(new_text))
    path.write_text(new_text)
    return done


_DEPTH = re.compile(r"Path\(__file__\)(\.resolve\(\))?\.(parents\[(\d+)\]|parent(?!s))")


def deepen(text: str) -> str:
    """A test moved one folder down: Path(__file__).parent / .parents[N] still name what they named."""
    def sub(m):
        n = int(m.group(3)) + 1 if m.group(3) is not None else 1
        return f"Path(__file__){m.group(1) or ''}.parents[{n}]"
    return _DEPTH.sub(sub, text)


CONFTEST_TIERS = '''# -- test tiers ------------------------------------------------------------------------------------
# `make test-fast` deselects the `slow` marker (and `browser`, `peers`), set in each test file: `pytestmark =
# pytest.mark.slow` or `@pytest.mark.slow` on the test (issue 41: a renamed file keeps its tier). Slowness is the
# cost of what a test builds: a quantized, loop-compiled or family-exported folder, a running service, a bench run,
# a CLI in a subprocess. The fixtures below build such folders: a test that uses one and is not marked slow fails
# at collection, so the fast tier never builds one by accident (measured under a load average of ~20:
# `static_folder`'s setup alone took 315 s).
SLOW_ONLY_FIXTURES = {fixtures}


def pytest_collection_modifyitems(config, items):
    unmarked = [item.nodeid for item in items if item.get_closest_marker("slow") is None
                and SLOW_ONLY_FIXTURES.intersection(getattr(item, "fixturenames", ()))]
    if unmarked:
        raise pytest.UsageError("tests that build a slow fixture must be marked slow (pytest.mark.slow):\\n  "
                                + "\\n  ".join(unmarked))
'''


def rewrite_conftest(path: Path) -> bool:
    text = path.read_text()
    if "SLOW_MODULES" not in text:
        return False
    tree = ast.parse(text)
    fixtures = None
    start = end = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ("SLOW_FIXTURES", "SLOW_MODULES", "SLOW_TESTS"):
            if node.targets[0].id == "SLOW_FIXTURES":
                fixtures = sorted(ast.literal_eval(node.value))
            start = node.lineno if start is None else min(start, node.lineno)
            end = max(end or 0, node.end_lineno)
        elif isinstance(node, ast.FunctionDef) and node.name == "pytest_collection_modifyitems":
            end = max(end or 0, node.end_lineno)
    lines = text.splitlines(keepends=True)
    # the comment block above the lists goes with them
    s = start - 1
    while s > 0 and lines[s - 1].startswith("#"):
        s -= 1
    body = CONFTEST_TIERS.replace("{fixtures}", _set_literal(fixtures or []))
    lines[s:end] = [body]
    path.write_text("".join(lines))
    return True


def add_helper_paths(path: Path) -> bool:
    text = path.read_text()
    helpers = 'sys.path.insert(0, str(ROOT / "tests" / "helpers"))'
    if helpers not in text:
        text = text.replace('sys.path.insert(0, str(ROOT / "models" / "training"))\n',
                            'sys.path.insert(0, str(ROOT / "models" / "training"))\n'
                            "# the shared helpers (`from cli_helpers import run_cli`), and the test folders: a few tests "
                            "import another's\n# toy models (`from test_loop_graph import toy_backbone`)\n"
                            + helpers + "\n"
                            'sys.path += sorted(str(d) for d in (ROOT / "tests").iterdir() if d.is_dir() and '
                            'any(d.glob("test_*.py")))\n', 1)
        if helpers not in text:
            warn("tests/conftest.py: the models/training sys.path line was not found: add tests/helpers by hand")
            return False
        path.write_text(text)
        return True
    return False


def _set_literal(names: list[str]) -> str:
    out, line = ["{"], "    "
    for n in names:
        item = f'"{n}", '
        if len(line) + len(item) > 116:
            out.append(line.rstrip())
            line = "    "
        line += item
    out.append(line.rstrip().rstrip(","))
    out.append("}")
    return "\n".join(out)


# -- the CLI package's process entry ------------------------------------------------------------------------------

CLI_MAIN = '''"""`python -m onnxdiffusion.cli`: the same process as the `onnxdiffusion` script."""

from . import main

main()
'''

_STARTED = re.compile(r'^    return os\.path\.basename\(sys\.argv\[0\] if sys\.argv else ""\) in \(([^)]*)\)\n', re.M)
_STARTED_NEW = '''    argv0 = os.path.basename(sys.argv[0] if sys.argv else "")
    # `python -m onnxdiffusion.cli` imports this package while argv[0] is still "-m" (then .../cli/__main__.py)
    by_module = argv0 == "-m" and __name__ in getattr(sys, "orig_argv", ())
    return by_module or argv0 in ({names})
'''


def fix_cli_package(pkg: Path) -> None:
    init, main = pkg / "cli" / "__init__.py", pkg / "cli" / "__main__.py"
    if not init.exists():
        return
    if not main.exists():
        main.write_text(CLI_MAIN)
        say("wrote cli/__main__.py (python -m onnxdiffusion.cli)")
    text = init.read_text()
    new = _STARTED.sub(lambda m: _STARTED_NEW.replace("{names}", m.group(1)), text, count=1)
    if new == text and "orig_argv" not in text:
        warn("cli/__init__.py: _started_as_cli() not in the form expected: `python -m onnxdiffusion.cli` imports "
             "the package while argv[0] is '-m' -- make it install its early signal handlers then too")
    new = re.sub(r'\n\nif __name__ == "__main__":\n    main\(\)\n$', "\n", new)
    for old in ("cli_pipeline.py", "pipeline.py"):
        new = new.replace(f"(the verbs: {old} and the other cli_*.py\nmodules;",
                          "(the verbs: pipeline.py and the other modules\nhere;")
    if new != text:
        init.write_text(new)
        say("cli/__init__.py: early signal handlers also under `python -m onnxdiffusion.cli`")


PACKAGE_DOCS = {
    "loopgraph": '"""The Loop-graph compiler: the whole sampling loop (sampler, guidance, per-step techniques) built into '
                 'one ONNX graph\n(builder.py and its parts), and the compile-loop verb\'s library code that writes it '
                 'into a model folder\n(compile.py). The numpy samplers it compiles are samplers/."""\n',
    "folder": '"""The model folder on disk: its manifest (format, validation), the hashes and atomic writes of '
              'artifacts.py,\nconfined paths, temporary folders, image files, and relayout (the stored weights '
              'rewritten for a target)."""\n',
}

SAMPLERS_RULE = '''

def test_samplers_import_no_onnx():
    """samplers/ is the numpy samplers (issue 41): the ONNX loop compiler that builds them into a graph is
    loopgraph/, so nothing in samplers/ imports onnx or onnxruntime, at module level or inside a function."""
    hits = []
    for path in sorted((PKG / "samplers").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] in ("onnx", "onnxruntime") for n in names):
                hits.append(f"{path.relative_to(SRC)}:{node.lineno}: {', '.join(names)}")
    assert not hits, "samplers/ imports onnx:\\n" + "\\n".join(hits)
'''


# -- the run --------------------------------------------------------------------------------------------------------

def in_scope(root: Path):
    me = Path(__file__).resolve()
    for scope in TEXT_SCOPES:
        for p in sorted((root / scope).rglob("*")):
            if p.resolve() == me or p.name == Path(__file__).name:  # this script names the old paths on purpose
                continue
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not any(
                    part in ("__pycache__", "node_modules", ".venv") or part.startswith(".venv")
                    for part in p.relative_to(root).parts):
                yield p
    for name in TEXT_FILES:
        if (root / name).is_file():
            yield root / name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=None, help="the tree to relayout (default: this git checkout)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan, change nothing")
    ap.add_argument("--no-probe", action="store_true", help="skip the slow-tier conversion (no collection run)")
    args = ap.parse_args(argv)
    root = (args.root or Path(git(Path.cwd(), "rev-parse", "--show-toplevel").strip())).resolve()
    pkg = root / "src" / PKG_NAME

    moves = src_moves(pkg)
    mapper = Mapper(moves)
    test_moves = plan_tests(root, mapper)
    tool_moves = {o: n for o, n in TOOL_MOVES.items() if (root / o).exists() and not (root / n).exists()}
    for o, n in {**{f"src/{PKG_NAME}/{k}": f"src/{PKG_NAME}/{v}" for k, v in moves.items()}, **test_moves,
                 **tool_moves}.items():
        say(f"move {o} -> {n}")
    if args.dry_run:
        return 0

    # 1. the slow tier, as the old conftest decides it, before anything moves
    conftest = root / "tests" / "conftest.py"
    probe = None
    if not args.no_probe and "SLOW_MODULES" in conftest.read_text():
        say("collecting the suite to read the slow tier off the old conftest.py ...")
        probe = probe_slow(root)

    # 2. imports, from the syntax tree, with the old and the new module name of every file
    known = {module_of(p.relative_to(pkg).as_posix()) for p in pkg.rglob("*.py")}
    for path in in_scope(root):
        if path.suffix != ".py":
            continue
        rel = path.relative_to(root).as_posix()
        if rel.startswith(f"src/{PKG_NAME}/"):
            r = rel[len(f"src/{PKG_NAME}/"):]
            old_mod, new_mod, is_pkg = module_of(r), module_of(moves.get(r, r)), path.name == "__init__.py"
            is_pkg = is_pkg or moves.get(r, "").endswith("__init__.py")
            old_is_pkg = path.name == "__init__.py"
            text = path.read_text()
            # cli.py becomes a package's __init__: relative imports resolve from the package itself then
            new = rewrite_imports(text, old_mod, new_mod, old_is_pkg, mapper, known, rel) if old_is_pkg == is_pkg \
                else _rewrite_to_package(text, old_mod, new_mod, mapper, known, rel)
        else:
            text = path.read_text()
            new = rewrite_imports(text, "__script__", "__script__", False, mapper, known, rel)
        if new != text:
            path.write_text(new)
            say(f"imports rewritten: {rel}")

    # 3. dotted module names and paths in strings, comments and docs
    dotted, dotted_re, paths, paths_re = text_pass_patterns(moves, mapper, test_moves)
    bare = bare_names(moves, pkg)
    for path in in_scope(root):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = text_pass(text, dotted, dotted_re, paths, paths_re)
        rel = path.relative_to(root).as_posix()
        if rel != "docs/layout.md":  # names its packages' files bare on purpose
            r = rel[len(f"src/{PKG_NAME}/"):] if rel.startswith(f"src/{PKG_NAME}/") else None
            home = str(Path(moves.get(r, r)).parent) if r is not None else None
            new = bare_pass(new, bare, "" if home == "." else home)
        for a, b in LITERAL_MOVES.items():
            new = new.replace(a, b)
        if path.suffix == ".py" and path.relative_to(root).parts[0] in ("experiments", "bench"):
            new = re.sub(r'(ROOT / "tests")(?=\s*[,)\]])', r'\1 / "helpers"', new)
        if new != text:
            path.write_text(new)
            say(f"names rewritten: {path.relative_to(root)}")

    # 4. the slow markers into the test files (at their old place: the probe named them so)
    if probe is not None:
        by_file: dict[str, list[dict]] = defaultdict(list)
        for item in probe:
            by_file[item["file"]].append(item)
        for name, items in sorted(by_file.items()):
            for line in mark_slow(root / name, items):
                say(f"tier: {line}")
        if rewrite_conftest(conftest):
            say("tests/conftest.py: the tier's name lists replaced by a guard on the markers")
    elif "SLOW_MODULES" in conftest.read_text():
        warn("slow tier not converted (--no-probe): tests/conftest.py keeps its name lists")
    if add_helper_paths(conftest):
        say("tests/conftest.py: tests/helpers and the test folders on sys.path")

    # 5. moves (git mv keeps the history)
    for old, new in {**{f"src/{PKG_NAME}/{k}": f"src/{PKG_NAME}/{v}" for k, v in moves.items()}, **test_moves,
                     **tool_moves}.items():
        (root / new).parent.mkdir(parents=True, exist_ok=True)
        git(root, "mv", old, new)
        if old.startswith("tests/") and new.count("/") > old.count("/"):
            p = root / new
            p.write_text(deepen(p.read_text()))
        if old in TOOL_MOVES and old.endswith(".py"):
            p = root / new
            p.write_text(p.read_text().replace("Path(__file__).resolve().parents[2]",
                                               "Path(__file__).resolve().parents[1]"))
    # a moved package's old folder keeps only __pycache__: gone, or Python would find a namespace package there
    for old in {str(Path(o).parent) for o in moves if "/" in o}:
        d = pkg / old
        if d.is_dir() and not any(p.is_file() and "__pycache__" not in p.parts for p in d.rglob("*")):
            shutil.rmtree(d)
            say(f"removed the empty src/{PKG_NAME}/{old}/")
    for name, doc in PACKAGE_DOCS.items():
        init = pkg / name / "__init__.py"
        if (pkg / name).is_dir() and not init.exists():
            init.write_text(doc)
            git(root, "add", str(init))
            say(f"wrote {init.relative_to(root)}")
    fix_cli_package(pkg)
    if (pkg / "cli" / "__main__.py").exists():
        git(root, "add", str(pkg / "cli" / "__main__.py"))
    rules = next(iter(sorted((root / "tests").rglob("test_house_rules.py"))), None)
    if rules and "def test_samplers_import_no_onnx" not in rules.read_text():
        rules.write_text(rules.read_text().rstrip("\n") + "\n" + SAMPLERS_RULE)
        say(f"{rules.relative_to(root)}: test_samplers_import_no_onnx")
    leftovers = sorted(p.name for p in (root / "tests").glob("test_*.py"))
    for name in leftovers:
        warn(f"tests/{name} stays at the top of tests/ (no home found)")
    print(f"\n{len(LOG)} changes, {len(WARN)} warnings")
    for w in WARN:
        print(f"  WARNING: {w}")
    return 0


def _rewrite_to_package(text: str, old_mod: str, new_mod: str, mapper: Mapper, known: set[str], where: str) -> str:
    """A module that becomes a package's __init__ (cli.py -> cli/__init__.py): its relative imports are resolved
    from its old package and written relative to the new package (itself)."""
    try:
        tree = ast.parse(text)
    except SyntaxError as e:
        warn(f"{where}: not parsed ({e})")
        return text
    old_pkg = old_mod.rpartition(".")[0]
    # the old text with every relative import made absolute, then rewritten as a package __init__ would be
    lines = text.splitlines(keepends=True)
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level),
                       key=lambda n: n.lineno, reverse=True):
        l0, c0, l1, c1 = _segment([ln.rstrip("\r\n") for ln in lines], node)
        line = lines[l0]
        absolute = _resolve(node.module, node.level, old_pkg)
        lines[l0] = line[:c0] + re.sub(r"^from\s+[.\w]*\s+import", f"from {absolute} import", line[c0:], count=1)
    text = "".join(lines)
    text = rewrite_imports(text, new_mod, new_mod, True, mapper, known, where)
    # and back to relative, from the package itself
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level
                        and (n.module or "").startswith(PKG_NAME)), key=lambda n: n.lineno, reverse=True):
        l0, c0, l1, c1 = _segment([ln.rstrip("\r\n") for ln in lines], node)
        line = lines[l0]
        lines[l0] = line[:c0] + re.sub(r"^from\s+[.\w]*\s+import", f"from {_relative(node.module, new_mod)} import",
                                       line[c0:], count=1)
    return "".join(lines)


if __name__ == "__main__":
    sys.exit(main())
