"""The page's npm packages (onnxruntime-web, @huggingface/tokenizers), pinned by the package-lock.json beside
this file and installed with `npm ci` into a cache outside the source tree (never committed).

The cache is $ONNXDIFFUSION_WEB_CACHE, else $XDG_CACHE_HOME/onnxdiffusion/web, else ~/.cache/onnxdiffusion/web;
one subfolder per lock file (its hash), so a new pin never mixes with an old install.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import UserError

HERE = Path(__file__).resolve().parent
LOCK = HERE / "package-lock.json"
PACKAGE = HERE / "package.json"
MARKER = ".installed"


def cache_root() -> Path:
    if os.environ.get("ONNXDIFFUSION_WEB_CACHE"):
        return Path(os.environ["ONNXDIFFUSION_WEB_CACHE"])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "onnxdiffusion" / "web"


def pinned() -> dict[str, str]:
    """package name -> the exact version package.json pins."""
    return dict(json.loads(PACKAGE.read_text())["dependencies"])


def install_dir() -> Path:
    return cache_root() / hashlib.sha256(LOCK.read_bytes()).hexdigest()[:16]


def installed() -> Path | None:
    """node_modules of a finished install of the pinned packages, or None."""
    d = install_dir()
    return d / "node_modules" if (d / MARKER).is_file() else None


def ensure_installed(log=lambda s: print(s, file=sys.stderr, flush=True)) -> Path:
    """node_modules of the pinned packages, running `npm ci` first when they are not in the cache."""
    found = installed()
    if found is not None:
        _check_versions(found)
        return found
    npm = shutil.which("npm")
    if npm is None:
        raise UserError("npm is not installed: the page's runtime (onnxruntime-web) comes from npm; install Node.js/npm, "
                        "then run `make web-deps`")
    final = install_dir()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".npm-", dir=final.parent))
    try:
        shutil.copyfile(PACKAGE, tmp / "package.json")
        shutil.copyfile(LOCK, tmp / "package-lock.json")
        log(f"installing the pinned npm packages ({', '.join(f'{k}@{v}' for k, v in pinned().items())}) into {final}")
        # --ignore-scripts: nothing the page ships needs an install script (protobufjs' is a notice)
        r = subprocess.run([npm, "ci", "--ignore-scripts", "--no-audit", "--no-fund", "--loglevel=error"], cwd=tmp,
                           capture_output=True, text=True)
        if r.returncode != 0:
            tail = " ".join((r.stderr or r.stdout).split())[-300:]
            raise UserError(f"npm ci failed (exit {r.returncode}): {tail}")
        (tmp / MARKER).write_text("\n".join(f"{k}@{v}" for k, v in pinned().items()) + "\n")
        if final.exists():  # a concurrent install finished first: keep that one
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            os.replace(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _check_versions(final / "node_modules")
    return final / "node_modules"


def _check_versions(node_modules: Path) -> None:
    for name, version in pinned().items():
        pkg = node_modules / name / "package.json"
        got = json.loads(pkg.read_text()).get("version") if pkg.is_file() else None
        if got != version:
            raise UserError(f"{node_modules}: {name} is {got or 'missing'}, the lock pins {version}; "
                            f"remove {node_modules.parent} and run `make web-deps`")


def main() -> int:
    """`python -m onnxdiffusion.web.npm`: install the pinned packages (make web-deps) and print node_modules."""
    try:
        print(ensure_installed())
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
