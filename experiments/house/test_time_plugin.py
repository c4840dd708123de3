"""Per-phase test cost for experiments/house/test_time.md: wall seconds as pytest reports them and CPU seconds of
this process plus its waited-for children (CLI subprocesses), which do not depend on a busy machine's load.

    DURPLUG_OUT=x.tsv PYTHONPATH=src:experiments/house python -m pytest -p test_time_plugin -n 0 FILES...

Each line: wall, phase (setup/call/teardown), outcome, node id, CPU."""

import os
import resource

_OUT = os.environ.get("DURPLUG_OUT")
_last = [0.0]


def _cpu() -> float:
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def pytest_runtest_logstart(nodeid, location):
    _last[0] = _cpu()


def pytest_runtest_logreport(report):
    now = _cpu()
    cpu, _last[0] = now - _last[0], now
    if _OUT:
        with open(_OUT, "a") as f:
            f.write(f"{report.duration:.3f}\t{report.when}\t{report.outcome}\t{report.nodeid}\t{cpu:.3f}\n")
