"""The names a timestep-grouped backbone (int8-timestep: K group graphs behind sibling `If` switches) is written
with by quantize/timestep_graphs.py and read by runtime/backbone_groups.py, which cuts each group for step caching
by its nodes' module paths: one definition, so the writer and the reader cannot drift apart."""

from __future__ import annotations

import re

_SWITCH = re.compile(r"^groups/if(\d+)$")


def switch_name(j: int) -> str:
    """The `If` node that runs group j."""
    return f"groups/if{j}"


def switch_index(name: str) -> int | None:
    """j for group j's switch; None for any other node."""
    m = _SWITCH.match(name)
    return int(m.group(1)) if m else None


def branch_tag(j: int) -> str:
    """The prefix of group j's branch-local names."""
    return f"g{j}"


def branch_node_name(j: int, name: str, place: int) -> str:
    """A node's name inside group j's branch: its module path (/model/...) kept behind the group's tag; an unnamed or
    non-path node named by its place in the graph."""
    return f"{branch_tag(j)}{name}" if name.startswith("/") else f"{branch_tag(j)}/n{place}"
