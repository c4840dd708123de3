"""What `image` means per family (issue 42): the roles, the one-line refusals every entry point shares, the
Kontext reference inputs' layout, the probe picture. Fast: no model runs (the Kontext model's own tests are
tests/families/test_flux_kontext.py, the CLI's tests/cli/test_edit_cli.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.families import describe_image_roles, get_family, image_roles
from onnxdiffusion.runtime.references import check_image_request, pictures, probe_feeds, probe_picture, start_picture


def test_every_family_has_a_known_role_and_the_help_names_them():
    roles = image_roles()
    assert set(roles) <= {"start", "reference", "none"}
    assert "flux_kontext" in roles["reference"] and {"sd", "sdxl", "sd3", "flux", "qwenimage"} <= set(roles["start"])
    text = describe_image_roles()
    assert "the picture to edit for flux_kontext" in text and "img2img start picture for sd" in text


def _family(role: str, most: int = 1):
    return SimpleNamespace(name="toy", image_role=role, max_references=most)


@pytest.mark.parametrize("role,count,mask,strength,match", [
    ("reference", 0, False, False, "edits a picture: give the picture to edit"),
    ("reference", 2, False, False, "at most 1 reference"),
    ("reference", 1, True, False, "takes no mask or strength"),
    ("reference", 1, False, True, "takes no mask or strength"),
    ("none", 1, False, False, "takes no picture"),
    ("none", 0, True, False, "takes no picture"),
    ("start", 2, False, False, "one start picture"),
])
def test_refusals_are_one_line(role, count, mask, strength, match):
    with pytest.raises(UserError, match=match) as e:
        check_image_request(_family(role), count, mask, strength)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("role,count,mask,strength", [
    ("reference", 1, False, False), ("start", 0, False, False), ("start", 1, True, True), ("none", 0, False, False)])
def test_what_each_role_takes(role, count, mask, strength):
    check_image_request(_family(role), count, mask, strength)
    check_image_request(_family("reference", 3), 3)  # a family that takes several references


def test_pictures_and_start_picture():
    a = np.zeros((4, 4, 3), np.uint8)
    assert pictures(None) == [] and pictures(a)[0] is a and len(pictures([a, a])) == 2
    assert start_picture([a]) is a and start_picture(a) is a  # a one-item list is img2img's one picture


def test_kontext_reference_inputs_layout():
    """Packed 2x2 tokens after the noise's, ids (frame 1, row, column), repeated over the batch."""
    family = get_family("flux_kontext")
    info = SimpleNamespace(latent_channels=4, vae_scale_factor=2, size_multiple=4)
    lat = np.arange(1 * 4 * 6 * 4, dtype=np.float32).reshape(1, 4, 6, 4)
    out = family.reference_inputs(info, [lat], batch=2)
    assert out["reference_latents"].shape == (2, 6, 16) and out["reference_ids"].shape == (2, 6, 3)
    assert (out["reference_ids"][:, :, 0] == 1).all()
    np.testing.assert_array_equal(out["reference_ids"][0, :, 1:], [[0, 0], [0, 1], [1, 0], [1, 1], [2, 0], [2, 1]])
    # token 0 holds the first 2x2 patch, channels outer (diffusers' _pack_latents)
    np.testing.assert_array_equal(out["reference_latents"][1, 0], lat[0, :, :2, :2].reshape(-1))
    with pytest.raises(UserError, match="one reference picture"):
        family.reference_inputs(info, [lat, lat], batch=1)
    assert [s.name for s in family.conditioning(SimpleNamespace(
        latent_channels=4, context_dim=8, pooled_dim=8, setting=lambda k, d=None: True))][-2:] == \
        ["reference_latents", "reference_ids"]


def test_a_start_family_takes_no_reference_inputs():
    with pytest.raises(UserError, match="takes no reference picture"):
        get_family("sd").reference_inputs(None, [], 1)


def test_probe_picture_is_a_ramp_and_only_for_editing_models():
    p = probe_picture(40, 24)
    assert p.shape == (24, 40, 3) and p.dtype == np.uint8 and p[0, 0, 0] < p[0, -1, 0] and (p[0] == p[-1]).all()
    info = SimpleNamespace(default_width=32, default_height=16)
    assert probe_feeds(SimpleNamespace(family=get_family("sd"), info=info)) == {}
    assert probe_feeds(SimpleNamespace(family=get_family("flux_kontext"), info=info))["image"].shape == (16, 32, 3)
