"""What per-step techniques keep across one Pipeline's generations (a cut backbone, loaded nets), each under
its technique's name: held by the Pipeline in one public attribute, ``pipe.technique_state``."""

from __future__ import annotations

from typing import Any, Callable


class TechniqueState:
    def __init__(self):
        self._held: dict[str, Any] = {}

    def get(self, name: str, make: Callable[[], Any]) -> Any:
        """Technique `name`'s state, made by `make()` on first use."""
        if name not in self._held:
            self._held[name] = make()
        return self._held[name]
