"""A profile's `static_shapes`: one session per input-shape signature (OpenVINO's `reshape_input`), the last few
kept; the pipeline's images are those of one dynamic session. Without onnxruntime-openvino here the keyed
sessions run on the CPU provider, which leaves the provider list as it is: what is checked is which session each
call reaches and that the images do not move."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from onnxdiffusion.errors import UserError
from onnxdiffusion.onnxio.session import GraphIO
from onnxdiffusion.profiles import Profile, load_profile
from onnxdiffusion.runtime import Pipeline
from onnxdiffusion.runtime.static_shapes import ShapeKeyedSession, reshape_input, session_for, with_shapes


def _doubler() -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 3])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "g", [x], [y])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_reshape_input_and_the_provider_list():
    shapes = {"sample": (2, 4, 32, 32), "timestep": (2,), "encoder_hidden_states": (2, 77, 768)}
    assert reshape_input(shapes) == "sample[2,4,32,32],timestep[2],encoder_hidden_states[2,77,768]"
    chain = [("OpenVINOExecutionProvider", {"device_type": "CPU"}), "CPUExecutionProvider"]
    fixed = with_shapes(chain, {"x": (1, 3)})
    assert fixed[0] == ("OpenVINOExecutionProvider", {"device_type": "CPU", "reshape_input": "x[1,3]"})
    assert fixed[1] == "CPUExecutionProvider" and chain[0][1] == {"device_type": "CPU"}  # the profile's own untouched
    assert with_shapes(["CPUExecutionProvider"], {"x": (1, 3)}) == ["CPUExecutionProvider"]


def test_one_session_per_shape_the_last_ones_kept():
    model = _doubler()
    made = []

    def make(shapes):
        made.append(shapes)
        return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])

    keyed = ShapeKeyedSession(make, GraphIO(model.graph), keep=2)
    assert [i.name for i in keyed.get_inputs()] == ["x"] and [o.name for o in keyed.get_outputs()] == ["y"]
    one, two, three = (np.arange(3 * n, dtype=np.float32).reshape(n, 3) for n in (1, 2, 3))
    np.testing.assert_array_equal(keyed.run(None, {"x": one})[0], 2 * one)
    np.testing.assert_array_equal(keyed.run(["y"], {"x": two})[0], 2 * two)
    first = keyed.for_shapes({"x": (1, 3)})
    assert keyed.compiled == 2 and made == [{"x": (1, 3)}, {"x": (2, 3)}]
    keyed.run(None, {"x": one})
    assert keyed.compiled == 2 and keyed.for_shapes({"x": (1, 3)}) is first  # a shape seen is not compiled again
    keyed.run(None, {"x": three})  # a third shape: the least recently used (2, 3) goes
    assert keyed.compiled == 3 and keyed.for_shapes({"x": (1, 3)}) is first
    keyed.run(None, {"x": two})
    assert keyed.compiled == 4
    assert session_for(keyed, {"x": (3, 3)}) is keyed.for_shapes({"x": (3, 3)})
    assert session_for(first, {"x": (3, 3)}) is first  # a plain session is its own for every shape


@pytest.mark.parametrize("field, value, message", [
    ("static_shapes", "yes", "static_shapes must be true or false"),
    ("provider", "cpu", "static_shapes needs provider openvino"),
])
def test_static_shapes_field_is_checked(field, value, message):
    base = {"version": 1, "name": "x", "provider": "openvino", "static_shapes": True}
    with pytest.raises(UserError, match=message):
        Profile.from_dict({**base, field: value}, "x.yaml")


def test_shipped_openvino_profiles_compile_static_shapes():
    assert load_profile("openvino-int8").static_shapes and load_profile("openvino-fp32").static_shapes
    assert not load_profile("cpu-int8").static_shapes


@pytest.mark.filterwarnings("ignore:96x64 differs")
def test_pipeline_with_keyed_sessions_makes_the_same_images():
    # a CPU profile with static_shapes cannot be written in YAML (openvino only); built directly, it runs the
    # pipeline's keyed wiring on the CPU provider
    keyed_profile = Profile(name="cpu-static", provider="cpu", static_shapes=True)
    plain = Pipeline.from_folder(profile=Profile(name="cpu-plain", provider="cpu"))
    keyed = Pipeline.from_folder(profile=keyed_profile)
    # the backbone only: the text encoders and the VAE decoder run once an image and stay one dynamic session
    assert isinstance(keyed.backbone, ShapeKeyedSession) and isinstance(keyed.vae_decoder, ort.InferenceSession)
    assert all(isinstance(h.get(), ort.InferenceSession) for h in keyed.text_sessions.values())
    gen = dict(steps=3, guidance=4.0, seed=5, height=64, width=64)
    a, b = plain(["a red circle"], **gen), keyed(["a red circle"], **gen)
    np.testing.assert_array_equal(a.images, b.images)
    backbone = keyed.backbone
    assert backbone.compiled == 1
    keyed(["a blue square"], **gen)  # same shapes: nothing compiled again
    assert backbone.compiled == 1
    c = keyed(["a red circle"], **{**gen, "height": 96})  # another size: its own session
    assert backbone.compiled == 2
    np.testing.assert_array_equal(c.images, plain(["a red circle"], **{**gen, "height": 96}).images)
    keyed(["a red circle"], **{**gen, "guidance": 1.0})  # unguided: batch 1, a third shape; the oldest goes
    assert backbone.compiled == 3 and backbone.for_shapes({k: v.shape for k, v in _feeds(keyed, 2, 64).items()})
    assert backbone.compiled == 4  # the 64x64 guided session had gone: compiled again


def _feeds(pipe, rows: int, size: int) -> dict:
    cond = pipe.encode_prompt([""] * rows)
    lat = size // pipe.info["vae_scale_factor"]
    return {"sample": np.zeros((rows, pipe.info["latent_channels"], lat, lat), np.float32),
            "timestep": np.zeros((rows,), np.float32), **cond}


def test_the_openvino_provider_gets_the_attention_written_out(tiny_onnx):
    from onnxdiffusion.onnxio.attention import decompose_attention, openvino_form
    from onnxdiffusion.runtime.static_shapes import session_factory

    path = tiny_onnx / "unet" / "model.onnx"
    made = []

    def make(p, providers=None, model=None):
        made.append((providers, model))
        return object()

    chain = [("OpenVINOExecutionProvider", {"device_type": "CPU"}), "CPUExecutionProvider"]
    keyed = session_factory(True, chain, path, make)()
    assert isinstance(keyed, ShapeKeyedSession) and not made  # nothing compiled before a shape is known
    keyed.for_shapes({"sample": (2, 4, 8, 8), "timestep": (2,), "encoder_hidden_states": (2, 77, 32)})
    (providers, model), = made
    assert providers[0][1]["reshape_input"].startswith("sample[2,4,8,8],timestep[2],encoder_hidden_states[2,77,")
    assert not any(n.domain == "com.microsoft" for n in onnx.load_from_string(model).graph.node)
    assert model == decompose_attention(onnx.load(str(path))).SerializeToString() == openvino_form(path)
    session_factory(False, chain, path, make)()  # dynamic shapes on OpenVINO: written out all the same
    assert made[-1][1] == model and "reshape_input" not in made[-1][0][0][1]
    session_factory(True, ["CPUExecutionProvider"], path, make)().for_shapes({"sample": (1, 4, 8, 8)})
    assert made[-1] == (["CPUExecutionProvider"], None)  # ORT's CPU provider runs the fused kernel as stored


def test_only_the_plain_fused_attention_is_written_out():
    from onnxdiffusion.onnxio.attention import plain_attention

    def mha(outputs=("o",), inputs=("q", "k", "v"), **attrs):
        return helper.make_node("MultiHeadAttention", list(inputs), list(outputs), domain="com.microsoft",
                                **{"num_heads": 2, "scale": 0.5, **attrs})

    assert plain_attention(mha())
    assert not plain_attention(mha(unidirectional=1))  # causal: the written-out form has no mask
    assert not plain_attention(mha(outputs=("o", "present_k", "present_v")))  # a cache the rewrite would drop
    assert not plain_attention(mha(inputs=("q", "k", "v", "bias")))
    assert not plain_attention(helper.make_node("MultiHeadAttention", ["q", "k", "v"], ["o"], domain="com.microsoft",
                                                num_heads=2))  # no scale attribute
