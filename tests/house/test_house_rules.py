"""The house rules of src/ that a reviewer would otherwise check by hand (issue 22's acceptance 1):
no import circle (module- or function-level imports alike), no function over 150 lines, no backbone
name as a string literal outside families/, `quantize()` read as its stages (<= 80 lines), and (issue 41)
no module but runtime/pipeline.py reaching into a Pipeline's private attributes or an object's __dict__, and no
string-keyed manifest read outside the manifest package: modules read the typed records' attributes."""

from __future__ import annotations

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PKG = SRC / "onnxdiffusion"
MAX_FUNCTION_LINES = 150


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every onnxdiffusion module `name` imports, wherever the import statement is (module, function, class).

    `from . import x` names module x when it is one, else the package; `import a.b` names a.b."""
    is_pkg = path.name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("onnxdiffusion"):
                    found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("onnxdiffusion"):
                continue
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                found.add(sub if sub in known else mod)
    return {m for m in found if m in known and m != name}


def import_graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {name: _imports(name, path, known) for name, path in mods.items()}
    # importing a.b.c runs a/__init__ and a/b/__init__ first: those edges are real too
    for name in list(graph):
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in known and parent != name:
                graph[name].add(parent)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _is_package_edge(a: str, b: str) -> bool:
    return b == a.rpartition(".")[0] or a == b.rpartition(".")[0]


def test_no_import_circle_in_src():
    graph = import_graph()
    # a package's __init__ re-exporting its own submodules and those submodules importing a sibling
    # through the package is not a circle Python trips on; every other edge counts
    pruned = {a: {b for b in bs if not _is_package_edge(a, b)} for a, bs in graph.items()}
    found = cycles(pruned)
    assert not found, "import circles in src/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def _functions():
    for path in sorted(PKG.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield path, node


def test_no_function_over_150_lines():
    long = [f"{p.relative_to(SRC)}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for p, n in _functions() if n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, "functions over 150 lines:\n" + "\n".join(long)


def test_quantize_reads_as_its_stages():
    api = PKG / "quantize" / "api.py"
    fn = next(n for n in ast.parse(api.read_text()).body if isinstance(n, ast.FunctionDef) and n.name == "quantize")
    assert fn.end_lineno - fn.lineno + 1 <= 80


BACKBONE_LITERAL = re.compile(r"""(?<![\w.])(["'])unet\1""")


def test_no_backbone_name_literal_outside_families():
    hits = []
    for path in sorted(PKG.rglob("*.py")):
        if "families" in path.relative_to(PKG).parts:
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if BACKBONE_LITERAL.search(line):
                hits.append(f"{path.relative_to(SRC)}:{i}: {line.strip()}")
    assert not hits, f"{len(hits)} \"unet\" literals outside families/:\n" + "\n".join(hits)


# -- Pipeline's privacy (issue 41) --------------------------------------------------------------------
# Only runtime/pipeline.py touches a Pipeline's private attributes, and nobody stores state in an object's
# __dict__ from outside: a technique's state lives in its own object, read through Pipeline's public names.
PIPELINE_MODULE = "onnxdiffusion/runtime/pipeline.py"
# Files that still reach into a Pipeline: another change is moving their state into the techniques' own
# objects (issue 41). This list only shrinks: a file that no longer reaches in must leave it (checked below).
PIPELINE_PRIVACY_ALLOWED: set[str] = set()  # empty since the techniques moved their state into pipe.technique_state
PIPE_NAMES = {"pipe", "pipeline"}  # the names src/ binds a Pipeline to (pipe = Pipeline.from_folder(...), ...)
PIPE_ATTRS = {"pipe", "pipeline"}  # attributes that hold one: self.pipe (serve/ray, bench), entry.pipeline (serve)
DICT_WRITES = {"setdefault", "update", "pop", "popitem", "clear", "__setitem__", "__delitem__"}


def _pipeline_privates() -> set[str]:
    """The private attributes Pipeline sets on itself (self._x = ... anywhere in class Pipeline)."""
    tree = ast.parse((SRC / PIPELINE_MODULE).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Pipeline")
    return {t.attr for n in ast.walk(cls) for t in getattr(n, "targets", [getattr(n, "target", None)])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
            and t.attr.startswith("_") and not t.attr.startswith("__")}


def _is_pipe(node: ast.AST) -> bool:
    return ((isinstance(node, ast.Name) and node.id in PIPE_NAMES)
            or (isinstance(node, ast.Attribute) and node.attr in PIPE_ATTRS))


def _is_dict(node: ast.AST) -> bool:  # x.__dict__ or vars(x)
    return ((isinstance(node, ast.Attribute) and node.attr == "__dict__")
            or (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "vars"))


def pipeline_reaches(source: str, privates: set[str]) -> list[str]:
    """Where `source` reads or writes a Pipeline's private attribute, or writes into an object's __dict__:
    `pipe._x` on a name or attribute that holds a pipeline, `X._x` for any X but self/cls where _x is one of
    Pipeline's own private names (an alias the names above miss), get/set/has/delattr(pipe, "_x"), and
    `X.__dict__[k] = v` / `X.__dict__.setdefault(...)` (vars(X) alike)."""
    hits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            own = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            if _is_pipe(node.value) or (node.attr in privates and not own):
                hits.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and len(node.args) >= 2 and \
                node.func.id in ("getattr", "setattr", "hasattr", "delattr") and _is_pipe(node.args[0]) and \
                isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_"):
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DICT_WRITES \
                and _is_dict(node.func.value):
            hits.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
            for t in getattr(node, "targets", [getattr(node, "target", None)]):
                if (isinstance(t, ast.Subscript) and _is_dict(t.value)) or (isinstance(t, ast.Attribute)
                                                                           and t.attr == "__dict__"):
                    hits.append(f"{node.lineno}: {ast.unparse(t)}")
    return hits


def test_pipeline_privates_stay_in_its_module():
    privates = _pipeline_privates()
    assert {"_backbone", "_threads", "_chain"} <= privates  # the collector still finds them
    found, clean_allowed = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel == PIPELINE_MODULE:
            continue
        hits = pipeline_reaches(path.read_text(), privates)
        if rel in PIPELINE_PRIVACY_ALLOWED:
            if not hits:
                clean_allowed.append(rel)
            continue
        found += [f"{rel}:{h}" for h in hits]
    assert not found, ("a Pipeline's private attribute or an object's __dict__ used outside runtime/pipeline.py "
                       "(give Pipeline a public name for it, or keep the state in its own object):\n" + "\n".join(found))
    assert not clean_allowed, f"no longer reaching into a Pipeline: take them off PIPELINE_PRIVACY_ALLOWED: {clean_allowed}"


def test_the_privacy_check_finds_reaches():
    privates = {"_backbone", "_chain"}
    bad = ["pipe._threads", "self.pipe._graphs", "entry.pipeline._chain", "p._backbone.get()",
           "pipe.__dict__.setdefault('_k', {})", "x.__dict__['k'] = 1", "vars(pipe)['k'] = 1",
           "getattr(pipe, '_lora_cache', None)", "pipeline._x = 1"]
    for src in bad:
        assert pipeline_reaches(src, privates), src
    good = ["pipe.folder", "self._backbone", "self._threads", "options.__dict__", "{**opts.__dict__}",
            "getattr(pipe, 'lora', None)", "session._extra"]
    for src in good:
        assert not pipeline_reaches(src, privates), src


# --- the manifest is read through its typed records (issue 41) ------------------------------------------------
def _manifest_keys() -> frozenset[str]:
    """Every key the typed manifest gives an attribute for (so a string read of one has a typed twin)."""
    import dataclasses

    from onnxdiffusion.folder.manifest import model

    records = (model.Manifest, model.PipelineInfo, model.Component, model.Recommended, model.PrecisionScheduleRecord)
    return frozenset(f.name for r in records for f in dataclasses.fields(r)) - {"raw", "name"}


# names that hold a manifest or a piece of one in this code base (a writer's own dict is called `draft`)
MANIFEST_HOLDER = re.compile(r"^(manifest|man|qman|qmanifest|src_manifest|info|pipe_info|pipeline|pipeline_info|entry|"
                             r"comp|comps|components|component|recommended|backbone_entry|_?backbone_info|bb|sg|"
                             r"spec_entry)$")
# Files (or FILE::function) still reading string keys. This list only shrinks: each is converted to the typed
# attributes, then dropped (the finder test below fails on an entry that no longer reads any).
MANIFEST_STRING_READS_ALLOWED: set[str] = set()  # empty since the techniques' files were swept (issue 41)
ALLOWED_PREFIXES = ("folder/manifest/",)  # the schema itself
MANIFEST_MAKERS = ("read_manifest", "typed")


def _holder(node: ast.AST) -> str:
    """The name a subscript or .get() reads from: `manifest` in manifest["x"], `pipeline` in m.pipeline["x"]."""
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Subscript):  # manifest["components"]["unet"]["path"]: the chain's root
        return _holder(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get":
        return _holder(node.func.value)
    if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in MANIFEST_MAKERS:
        return "manifest"  # read_manifest(folder)["pipeline"]
    return ""


def manifest_string_reads(source: str, keys: frozenset[str]) -> list[tuple[int, str, str]]:
    """(line, key, enclosing top-level function) of every `holder["key"]` / `holder.get("key")` / `.setdefault` /
    `.pop` / `.setting` load of a key the typed manifest has an attribute for."""
    tree = ast.parse(source)
    spans = [(n.lineno, n.end_lineno, n.name) for n in tree.body
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    hits = []
    for node in ast.walk(tree):
        key = base = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and isinstance(node.slice, ast.Constant):
            key, base = node.slice.value, node.value
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("get", "setdefault", "pop", "setting") and node.args
              and isinstance(node.args[0], ast.Constant)):
            key, base = node.args[0].value, node.func.value
        if isinstance(key, str) and key in keys and MANIFEST_HOLDER.match(_holder(base)):
            where = next((name for lo, hi, name in spans if lo <= node.lineno <= hi), "")
            hits.append((node.lineno, key, where))
    return hits


def _allowed(rel: str, function: str) -> bool:
    return (rel in MANIFEST_STRING_READS_ALLOWED or f"{rel}::{function}" in MANIFEST_STRING_READS_ALLOWED
            or rel.startswith(ALLOWED_PREFIXES))


def test_no_string_keyed_manifest_reads_outside_the_manifest_module():
    keys = _manifest_keys()
    hits = [f"{path.relative_to(PKG)}:{line}: [{key!r}]" for path in sorted(PKG.rglob("*.py"))
            for line, key, fn in manifest_string_reads(path.read_text(), keys)
            if not _allowed(path.relative_to(PKG).as_posix(), fn)]
    assert not hits, (f"{len(hits)} string-keyed manifest reads (read the typed record's attribute, "
                      "onnxdiffusion.folder.manifest):\n" + "\n".join(hits))


def test_the_manifest_read_finder_finds_reads():
    keys = _manifest_keys()
    src = ('a = manifest["pipeline"]["vae_scale_factor"]\nb = info.get("latent_channels")\n'
           'c = pipe.manifest["components"]\nd = entry["path"]\ndraft["path"] = 1\ne = results["steps"]\n'
           'f = m.pipeline.vae_scale_factor\ndef g(entry):\n    return entry.setting("precision")\n'
           'h = read_manifest(folder)["recommended"]\n')
    assert sorted((line, fn) for line, _, fn in manifest_string_reads(src, keys)) == [
        (1, ""), (1, ""), (2, ""), (3, ""), (4, ""), (9, "g"), (10, "")]
    stale = []
    for entry in MANIFEST_STRING_READS_ALLOWED:
        rel, _, fn = entry.partition("::")
        found = manifest_string_reads((PKG / rel).read_text(), keys)
        if not any(not fn or f == fn for _, _, f in found):
            stale.append(entry)
    assert not stale, f"allow-listed but clean (drop them from the list): {stale}"


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
    assert not hits, "samplers/ imports onnx:\n" + "\n".join(hits)
