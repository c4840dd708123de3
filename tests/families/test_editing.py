"""families/editing.py: the picture hooks every Family inherits (img2img's defaults; the editing families override)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.families import Family, get_family, names
from onnxdiffusion.families.editing import PictureInput


def test_every_family_takes_the_picture_hooks():
    assert issubclass(Family, PictureInput)
    for name in names():
        assert isinstance(get_family(name), PictureInput)


def test_the_defaults_are_img2imgs():
    fam = get_family("sd")
    assert (fam.image_role, fam.max_references, fam.references_optional, fam.reads_pictures) == ("start", 1, False, False)
    assert fam.start_step(10, 0.55) == 5 and fam.start_step(10, 1.0) == 0
    with pytest.raises(UserError, match="takes no reference picture"):
        fam.reference_inputs({}, [np.zeros((1, 4, 8, 8), np.float32)], 1)


def test_an_editing_family_overrides_them():
    fam = get_family("flux_kontext")
    assert fam.image_role == "reference"
    assert type(fam).reference_inputs is not PictureInput.reference_inputs
