"""compile-loop's refusals of techniques it cannot build into one graph: the registry's table, read from the
backbone's records before any graph is loaded (loopgraph/compile.py `_check_techniques`)."""

from types import SimpleNamespace

import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.loopgraph import compile as compile_mod
from onnxdiffusion.techniques import registry


def _entry(**records):
    return SimpleNamespace(**{"precision_schedule": None, "lora_targets": None, "correction": None, **records})


@pytest.mark.parametrize("records, pair", [
    (dict(precision_schedule={"component": "unet_high"}), ("controlnet", "precision_schedule")),
    (dict(lora_targets={"unet": ["to_q"]}), ("lora", "controlnet")),
])
def test_controlnet_is_refused_with_the_registry_message(records, pair):
    row = registry.conflict(*pair, "loop", compiled=True)
    assert row is not None
    with pytest.raises(UserError) as e:
        compile_mod._check_techniques(None, [{"name": "net"}], _entry(**records))
    assert str(e.value) == row.message


def test_what_combines_passes():
    compile_mod._check_techniques(None, [{"name": "net"}], _entry(correction={"method": "output"}))
    compile_mod._check_techniques(None, [], _entry(precision_schedule={"component": "unet_high"}))
