"""The per-step techniques package: the registry's table is the docs' and the only place refusals of a
combination come from; specs parse once, from text and Python objects alike; a cache method is a class
registered by name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.techniques import registry
from onnxdiffusion.techniques.active import Specs, check, parse_specs
from onnxdiffusion.techniques.cache_base import CacheSpec
from onnxdiffusion.techniques.cache_methods import METHODS
from onnxdiffusion.techniques.cache_first_block import FirstBlock
from onnxdiffusion.techniques.cache_taylorseer import TaylorSeer
from onnxdiffusion.techniques.caching import parse_cache, parse_compiled_cache
from onnxdiffusion.techniques.stop import StopSpec

ROOT = Path(__file__).resolve().parents[2]


def test_docs_list_the_registry_table():
    text = (ROOT / "docs" / "techniques.md").read_text()
    block = re.search(r"<!-- conflicts:begin -->\n(.*?)\n<!-- conflicts:end -->", text, re.S)
    assert block and block.group(1).strip() == registry.docs_table(), \
        "docs/techniques.md's table differs from techniques/registry.py's CONFLICTS: regenerate it from docs_table()"
    assert " -> ".join(registry.ORDER) in text


def test_every_conflict_names_known_techniques_once():
    pairs = [frozenset((c.first, c.second)) for c in registry.CONFLICTS]
    assert len(pairs) == len(set(pairs))
    for c in registry.CONFLICTS:
        assert {c.first, c.second} <= set(registry.ORDER) and set(c.forms) <= set(registry.ALL)
        assert c.reason and "\n" not in c.message


@pytest.mark.parametrize("active,form,fragment", [
    (dict(cache=FirstBlock(0.2), stop=StopSpec(0.1)), "host", "use one or the other"),
    (dict(stop=StopSpec(0.1), inpaint=True), "host", "not with inpainting"),
    (dict(cache=FirstBlock(0.2), controlnet=True), "host", "step caching with ControlNet"),
    (dict(lora=True, controlnet=True), "host", "run-time LoRAs with ControlNet"),
    (dict(controlnet=True, precision_schedule=True), "loop", "precision schedule does not take ControlNet"),
    (dict(cache=FirstBlock(0.2), precision_schedule=True), "loop", "--cache first_block: step caching in the Loop"),
    (dict(cache=TaylorSeer(3)), "unrolled", "runs in the host loop and the Loop graph"),
    (dict(stop=StopSpec(0.1)), "unrolled", "unrolled graph runs all its steps"),
    (dict(lora=True, inpaint_backbone=True), "host", "run-time LoRA on an inpainting backbone")])
def test_refusals_come_from_the_table(active, form, fragment):
    with pytest.raises(UserError, match=re.escape(fragment)) as info:
        registry.check_combination(active, form)
    assert "\n" not in str(info.value)


def test_pairs_that_combine_pass():
    registry.check_combination(dict(cache=FirstBlock(0.2), precision_schedule=True, lora=True), "host")
    registry.check_combination(dict(cache=FirstBlock(0.2), stop=StopSpec(0.1)), "loop", compiled=True)
    check(Specs(FirstBlock(0.0), StopSpec(0.1)), "host")  # a no-op cache is not active
    check(Specs(None, None), "loop", lora=True, inpaint_backbone=True)  # refused in the host loop only
    check(Specs(None, StopSpec(0.1)), "host", inpaint_backbone=True)  # no blend: an early stop is fine


def test_lora_on_an_inpainting_backbone_keys_on_backbone_layers():
    """The lora x inpaint_backbone row refuses a LoRA set with backbone layers only; whether it has some is asked
    (the files read) only when the rest of the row matches, and once."""
    from onnxdiffusion.techniques.lora import LoraUse

    asked = []

    def use(backbone: bool) -> LoraUse:
        return LoraUse(lambda: asked.append(backbone) or backbone)

    check(Specs(None, None), "host", lora=use(False), inpaint_backbone=True)  # text-encoder-only: runs
    with pytest.raises(UserError, match=re.escape("run-time LoRA on an inpainting backbone")) as info:
        check(Specs(None, None), "host", lora=use(True), inpaint_backbone=True)
    assert "\n" not in str(info.value) and "when it has backbone layers" in str(info.value)
    assert asked == [False, True]
    check(Specs(None, None), "host", lora=use(True))  # no inpainting backbone: the files are not read
    check(Specs(None, None), "loop", lora=use(True), inpaint_backbone=True)  # nor in a form the row leaves out
    assert asked == [False, True]
    with pytest.raises(UserError, match="run-time LoRAs with ControlNet"):  # the other rows key on any LoRA
        check(Specs(None, None), "host", lora=use(False), controlnet=True)
    with pytest.raises(UserError, match="run-time LoRA on an inpainting backbone"):  # True: unknown layers count
        check(Specs(None, None), "host", lora=True, inpaint_backbone=True)


def test_specs_parse_once_and_pass_objects_through():
    specs = parse_specs(type("O", (), {"cache": "first_block:0.2", "stop_early": "0.1:3"})())
    assert specs.cache == FirstBlock(0.2) and specs.stop == StopSpec(0.1, 3)
    again = parse_specs(type("O", (), {"cache": specs.cache, "stop_early": specs.stop})())
    assert again.cache is specs.cache and again.stop is specs.stop


def test_dict_form_is_checked_as_the_text_form():
    assert parse_cache({"method": "taylorseer", "interval": 4, "order": 2}) == parse_cache("taylorseer:4:2")
    for bad in ({"method": "taylorseer", "interval": 0}, {"method": "first_block", "threshold": -1.0},
                {"method": "first_block", "interval": 2}, {"method": "nope"}):
        with pytest.raises(UserError) as info:
            parse_cache(bad)
        assert "\n" not in str(info.value)


def test_methods_are_registered_by_name_and_round_trip():
    # a new method is its module and one registry line: this test needs no edit for it
    assert {"first_block", "taylorseer", "deepcache", "residual"} <= set(METHODS)
    for name, kind in METHODS.items():
        assert issubclass(kind, CacheSpec) and kind.method == name and name in kind.usage
        default = parse_compiled_cache(name)
        assert type(default) is kind and default.noop and default.record()["method"] == name
        assert parse_cache(str(default)) == default


def test_a_cache_method_is_registered_by_its_name_alone():
    from onnxdiffusion.techniques import cache_methods

    assert tuple(METHODS) == cache_methods.NAMES
    for name, kind in METHODS.items():
        assert kind.method == name and kind.__module__.endswith(f".cache_{name}")


def test_each_spec_answers_from_its_own_record_whether_the_compiled_graph_runs_it():
    from types import SimpleNamespace

    plain = SimpleNamespace(cache=None, stop=False)
    opened = []

    def graph():
        opened.append(1)
        return plain

    specs = parse_specs(SimpleNamespace(cache="deepcache:2", stop_early=None))
    specs.check_graph("host", graph)
    assert not opened  # the host loop never opens the compiled graph
    with pytest.raises(UserError, match="compiled without step caching"):
        specs.check_graph("loop", graph)
    with pytest.raises(UserError, match="compiled without the stopping test"):
        parse_specs(SimpleNamespace(cache=None, stop_early="0.05")).check_graph("loop", graph)
    compiled = SimpleNamespace(cache=specs.cache.record(), stop=True)
    specs.check_graph("loop", lambda: compiled)
    parse_specs(SimpleNamespace(cache="first_block:0", stop_early="0")).check_graph("loop", graph)  # no-ops ask nothing
