"""models/training/compare_eval.py: a retrained model reproduces the shipped one only within the tolerance and
only when both evaluations used the same pairs and sampling options."""

import json

import compare_eval

OPTIONS = {"count": 256, "steps": 20, "sampler": "flow_euler", "guidance": 3.0, "split": "heldout", "seed_offset": 0}


def _eval(attr=0.99, strict=0.97, **opts):
    return {"attribute_accuracy": attr, "strict_accuracy": strict, "frechet_distance": 55.0,
            "options": {**OPTIONS, **opts}}


def test_within_tolerance_reproduces(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_eval()))
    b.write_text(json.dumps(_eval(attr=0.975, strict=0.95)))
    out = tmp_path / "r.json"
    assert compare_eval.main([str(a), str(b), "--out", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["reproduces"] and abs(r["largest_accuracy_delta"] - 0.02) < 1e-9


def test_a_larger_drop_or_other_options_do_not_reproduce():
    assert not compare_eval.compare(_eval(), _eval(strict=0.93), 0.03)["reproduces"]
    r = compare_eval.compare(_eval(), _eval(guidance=4.0), 0.03)
    assert not r["reproduces"] and r["options_mismatched"] == ["guidance"]


def test_unreadable_input_is_exit_2(tmp_path, capsys):
    assert compare_eval.main([str(tmp_path / "missing.json"), str(tmp_path / "x.json")]) == 2
    assert capsys.readouterr().err.startswith("error:")
