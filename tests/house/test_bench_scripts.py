"""Every script under bench/ (the tools) and experiments/<topic>/ (the investigations) still loads against the
library as it is now.

The bench scripts are run by hand, weeks apart; a rename in src/ or in a sibling script (a helper moved
from quantize_eval.py to quantize_tables.py) broke one silently before. Each is loaded as a module (its
`main` not run) in one fresh interpreter, so an import error anywhere names the script.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

_LOADER = """
import importlib.util, sys
from pathlib import Path
bad = []
for p in sorted(Path("bench").glob("*.py")) + sorted(Path("experiments").glob("*/*.py")):
    spec = importlib.util.spec_from_file_location("_bench_" + p.parent.name.replace("-", "_") + "_" + p.stem, p)
    try:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))
    except BaseException as e:
        bad.append(f"{p}: {type(e).__name__}: {e}")
print("\\n".join(bad))
sys.exit(1 if bad else 0)
"""


def test_every_bench_script_loads():
    tools = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    experiments = sorted(p.name for p in (ROOT / "experiments").glob("*/*.py"))
    assert len(tools) >= 6 and len(experiments) > 20
    proc = subprocess.run([sys.executable, "-c", _LOADER], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT / "src")})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
