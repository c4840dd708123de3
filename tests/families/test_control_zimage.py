"""Z-Image's ControlNet declarations (families/control_zimage.py): the config checks against the folder's
transformer, one line each; the hints' layout (over the unified sequence: image tokens padded to 32, then the
caption); the join sites in a graph (the last edge out of a control place, behind Q/DQ)."""

from __future__ import annotations

import pytest
from onnx import helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.families.control_zimage import check_zimage_controlnet, zimage_joins, zimage_residuals

TR = {"_class_name": "ZImageTransformer2DModel", "dim": 48, "n_heads": 2, "n_refiner_layers": 1, "n_layers": 3,
      "in_channels": 4, "qk_norm": True, "norm_eps": 1e-5}
NET = {"_class_name": "ZImageControlNetModel", "dim": 48, "n_heads": 2, "n_refiner_layers": 1, "qk_norm": True,
       "norm_eps": 1e-5, "control_layers_places": [0, 2], "control_in_dim": 4, "add_control_noise_refiner": None,
       "control_refiner_layers_places": None, "all_patch_size": [2], "all_f_patch_size": [1]}


def test_a_fitting_net_is_recorded():
    rec = check_zimage_controlnet(NET, TR, "zimage")
    assert rec["places"] == [0, 2] and rec["width"] == 48 and rec["shares_backbone"] and rec["condition"] == "latents"
    refiner = {**NET, "control_in_dim": 9, "add_control_noise_refiner": "control_noise_refiner",
               "control_refiner_layers_places": [0]}
    assert check_zimage_controlnet(refiner, TR, "zimage")["control_in_dim"] == 9


@pytest.mark.parametrize("change,match", [
    ({"_class_name": "QwenImageControlNetModel"}, "is 'QwenImageControlNetModel'; a zimage folder takes a diffusers ZImageControlNetModel"),
    ({"dim": 64}, "dim 64 is not the folder's transformer's 48"),
    ({"n_refiner_layers": 2}, "n_refiner_layers 2 is not"),
    ({"control_layers_places": [1, 2]}, r"control_layers_places \[1, 2\] must name distinct main layers"),
    ({"control_layers_places": [0, 3]}, r"\(0..2\), layer 0 among them"),
    ({"control_layers_places": "0"}, "control_layers_places must be a list of layer indices, got .0."),
    ({"control_in_dim": 3}, "control_in_dim 3 must be at least the transformer's 4 latent channels"),
    ({"add_control_noise_refiner": "other"}, "add_control_noise_refiner 'other' is not one of"),
    ({"add_control_noise_refiner": "control_noise_refiner"}, r"control_refiner_layers_places \[\] must name 1 to 1"),
    ({"all_patch_size": [4]}, "patch sizes"),
])
def test_nets_that_do_not_fit_are_refused_in_one_line(change, match):
    with pytest.raises(UserError, match=match):
        check_zimage_controlnet({**NET, **change}, TR, "zimage")


def test_hints_span_the_unified_sequence():
    rec = check_zimage_controlnet(NET, TR, "zimage")
    assert zimage_residuals(rec) == [(f"controlnet_block_sample_{k}", ("batch_size", "unified_sequence_length", 48))
                                     for k in (0, 1)]
    # 10 x 14 latents: 35 tokens padded to 64, then a 32-token caption
    assert zimage_residuals(rec, (2, 10, 14, 32))[1] == ("controlnet_block_sample_1", (2, 96, 48))


def test_joins_take_the_last_edge_out_of_a_place_before_its_qdq():
    def node(op, name, ins, outs):
        return helper.make_node(op, ins, outs, name=name)

    nodes = [node("Unsqueeze", "/model/layers.0/attention/Unsqueeze", ["cos"], ["u"]),
             node("Add", "/model/layers.0/Add_4", ["x0", "y0"], ["h0"]),
             node("QuantizeLinear", "/model/layers.0/Add_4_output_0_QuantizeLinear", ["h0", "s", "z"], ["q0"]),
             node("DequantizeLinear", "/model/layers.0/Add_4_output_0_DequantizeLinear", ["q0", "s", "z"], ["d0"]),
             node("Mul", "/model/layers.1/attention/Mul", ["u", "k"], ["m1"]),
             node("Pow", "/model/layers.1/attention_norm1/Pow", ["d0", "two"], ["p1"]),
             node("Add", "/model/layers.1/Add_4", ["d0", "p1"], ["h1"]),
             node("LayerNormalization", "/model/2-1/norm_final/LayerNormalization", ["h1", "g"], ["o"])]
    rec = {**check_zimage_controlnet({**NET, "control_layers_places": [0, 1]}, {**TR, "n_layers": 2}, "zimage")}
    assert zimage_joins(nodes, rec) == [("controlnet_block_sample_0", "/model/layers.0/Add_4_output_0_QuantizeLinear", 0,
                                         True),
                                        ("controlnet_block_sample_1", "/model/2-1/norm_final/LayerNormalization", 0, True)]
    with pytest.raises(UserError, match="no edge out of /model/layers.1/"):
        zimage_joins(nodes[:-1], rec)


def test_control_context_joins_the_inpainting_parts_and_pads_to_control_in_dim():
    import numpy as np

    from onnxdiffusion.families.control_zimage import zimage_control_latents

    plain, wide = check_zimage_controlnet(NET, TR, "zimage"), check_zimage_controlnet({**NET, "control_in_dim": 9}, TR,
                                                                                       "zimage")
    assert not plain["inpaint"] and wide["inpaint"]
    lat, keep, kept = (np.full((2, c, 3, 5), v, np.float32) for c, v in ((4, 1.0), (1, 2.0), (4, 3.0)))
    ctx = zimage_control_latents({}, wide, lat)
    assert ctx.shape == (2, 9, 3, 5) and (ctx[:, :4] == 1).all() and (ctx[:, 4:] == 0).all()
    ctx = zimage_control_latents({}, wide, lat, (keep, kept))
    assert [float(ctx[0, c, 0, 0]) for c in (0, 4, 5, 8)] == [1.0, 2.0, 3.0, 3.0]
    assert zimage_control_latents({}, plain, lat).shape == (2, 4, 3, 5)
