"""Hardware profiles: every shipped YAML validates; fallbacks and one-line errors; the device-bound
backbone agrees with the host one; a fixup-trt folder loads through the TensorRT profile's fallback."""

import shutil
import warnings

import numpy as np
import onnx
import pytest

from onnxdiffusion.errors import UserError
from onnxdiffusion.profiles import Profile, load_profile, resolve, shipped
from onnxdiffusion.profiles.providers import providers, shape_profiles
from onnxdiffusion.runtime import Pipeline

EXPECTED = {"cpu-fp32", "cpu-int8", "cuda-fp16", "tensorrt-fp8", "tensorrt-nvfp4", "openvino-int8", "openvino-fp32"}
PROMPTS = ["a red circle on the left"]
GEN = dict(steps=3, guidance=4.0, seed=2, batch=1)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_every_shipped_profile_validates(name):
    p = load_profile(name)
    assert p.name == name and p.provider == name.split("-")[0]
    assert p.fallback is None or p.fallback in shipped()
    chain = providers(p)
    assert chain[-1] == "CPUExecutionProvider"
    if p.provider == "tensorrt":
        opts = chain[0][1]
        assert opts["trt_engine_cache_enable"] == "1" and opts["trt_engine_cache_path"]


def test_shipped_set():
    assert set(shipped()) == EXPECTED


def test_tensorrt_shape_profiles_come_from_the_buckets(tiny_onnx):
    from onnxdiffusion.folder.artifacts import read_manifest

    m = read_manifest(tiny_onnx)
    p = Profile.from_dict({"version": 1, "name": "t", "provider": "tensorrt",
                           "shapes": {"batch": [1, 2, 4], "buckets": [[64, 64], [32, 48], [96, 64]]}}, "t.yaml")
    shapes = shape_profiles(p, m.components["unet"], m.pipeline)
    f = m.pipeline.vae_scale_factor
    assert shapes["trt_profile_min_shapes"].startswith(f"sample:2x4x{32 // f}x{48 // f},timestep:2,")
    assert shapes["trt_profile_opt_shapes"].startswith(f"sample:4x4x{64 // f}x{64 // f},")
    assert shapes["trt_profile_max_shapes"].startswith(f"sample:8x4x{96 // f}x{64 // f},")


@pytest.mark.parametrize("data, fragment", [
    ({"version": 1, "name": "x", "provider": "cuda", "bogus": 1}, "unknown field(s) bogus"),
    ({"version": 2, "name": "x", "provider": "cpu"}, "version 2"),
    ({"version": 1, "name": "x", "provider": "tpu"}, "provider must be one of"),
    ({"version": 1, "name": "x", "provider": "cpu", "cuda_graph": True}, "cuda_graph needs provider cuda"),
    ({"version": 1, "name": "x", "provider": "cpu", "io_binding": "device"}, "needs a GPU provider"),
    ({"version": 1, "name": "x", "provider": "cuda", "shapes": {"batch": [4, 1, 2]}}, "shapes.batch"),
    ({"version": 1, "name": "x", "provider": "cpu", "precision": "int3"}, "precision must be one of"),
    ({"version": 1, "name": "x", "provider": "openvino", "float_math": "fp16"}, "float_math must be one of"),
    ({"version": 1, "name": "x", "provider": "cpu", "float_math": "bf16"}, "needs provider openvino"),
])
def test_bad_profiles_are_one_line_errors(data, fragment):
    with pytest.raises(UserError) as e:
        Profile.from_dict(data, "mine.yaml")
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_profile_from_a_yaml_file_and_a_missing_one(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("version: 1\nname: mine\nprovider: cpu\nthreads: 1\n")
    assert load_profile(f).threads == 1
    with pytest.raises(UserError, match="not found"):
        load_profile(tmp_path / "other.yaml")
    with pytest.raises(UserError, match="unknown profile 'gpu-magic'"):
        load_profile("gpu-magic")


def test_unavailable_profile_falls_back_as_declared_or_fails_in_one_line():
    r = resolve("tensorrt-fp8")  # this CPU build of onnxruntime has no TensorRT
    if r.fell_back:
        assert r.profile.name == "cpu-fp32" and "declared fallback cpu-fp32" in r.note
    no_fallback = Profile.from_dict({"version": 1, "name": "trt-only", "provider": "tensorrt"}, "trt-only.yaml")
    if no_fallback.unavailable_reason() is not None:
        with pytest.raises(UserError) as e:
            resolve(no_fallback)
        assert "declares no fallback" in str(e.value) and "\n" not in str(e.value)


def test_cpu_int8_profile_needs_an_int8_folder(tiny_onnx):
    with pytest.raises(UserError, match="--recipe int8-static"):
        Pipeline.from_folder(tiny_onnx, profile="cpu-int8")


def test_device_backbone_matches_host_backbone_on_cpu_memory(tiny_onnx):
    from onnxdiffusion.runtime.backbone import DeviceBackbone, GuidedBackbone

    pipe = Pipeline.from_folder(tiny_onnx)
    shape = pipe.latent_shape_for(2)
    cond, uncond = pipe.encode_prompt(["a", "b"]), pipe.encode_prompt(["", ""])
    x = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    host = GuidedBackbone(pipe.backbone, shape, cond, uncond, 4.0)
    dev = DeviceBackbone(pipe.backbone, shape, cond, uncond, 4.0, device="cpu")
    for t in (900.0, 100.0):  # the same bound buffers serve every step
        np.testing.assert_allclose(dev(x, t), host(x, t), rtol=1e-5, atol=1e-5)


def test_fixup_trt_folder_loads_through_the_tensorrt_profiles_fallback(tiny_onnx, tmp_path):
    from test_fixup_trt import modelopt_export

    from onnxdiffusion.export.fixup_trt import fixup_trt

    folder = tmp_path / "model"
    shutil.copytree(tiny_onnx, folder)
    src = tmp_path / "modelopt.onnx"
    onnx.save_model(modelopt_export(onnx.load(str(tiny_onnx / "unet" / "model.onnx"))), str(src))
    fixup_trt(src, folder)
    reference = Pipeline.from_folder(tiny_onnx)(PROMPTS, **GEN).images
    with pytest.raises(UserError, match="--profile tensorrt-nvfp4"):
        Pipeline.from_folder(folder)  # plain CPU: one line naming the profile to use
    if resolve("tensorrt-nvfp4").fell_back:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe = Pipeline.from_folder(folder, profile="tensorrt-nvfp4")
        assert any("fallback" in str(w.message) for w in caught)
        np.testing.assert_array_equal(pipe(PROMPTS, **GEN).images, reference)  # the kept fp32 backbone


def test_gpu_check_skips_cleanly_without_a_gpu():
    import subprocess
    from pathlib import Path

    from onnxdiffusion.profiles import gpu_visible

    if gpu_visible():
        pytest.skip("a GPU is visible: bench/gpu_check.sh would run for real")
    script = Path(__file__).resolve().parents[2] / "bench" / "gpu_check.sh"
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "skipped: no NVIDIA GPU" in proc.stdout


def test_device_buffers_are_reused_across_generations_and_stay_correct(tiny_onnx):
    """A captured CUDA graph replays the addresses it was captured with: the bound buffers must be the
    same objects at the same addresses from one generation to the next, holding each call's inputs."""
    from types import SimpleNamespace

    pipe = Pipeline.from_folder(tiny_onnx)
    plain = Pipeline.from_folder(tiny_onnx)
    pipe.profile = SimpleNamespace(profile=SimpleNamespace(io_binding="device"))  # device binding, CPU memory
    shape = pipe.latent_shape_for(2)
    rng = np.random.default_rng(0)
    seen = []
    for prompts, t in ((["a red circle", "a blue star"], 900.0), (["a green square", "a red ring"], 300.0)):
        x = rng.standard_normal(shape, dtype=np.float32)
        fn = pipe.guided_backbone(prompts, None, 4.0, 32, 32, shape)
        assert type(fn).__name__ == "DeviceBackbone"
        seen.append((fn.buffers, fn.buffers.addresses()))
        got = fn(x, t)
        fn.close()
        ref = plain.guided_backbone(prompts, None, 4.0, 32, 32, shape)(x, t)  # host numpy binding
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    assert seen[0][0] is seen[1][0] and seen[0][1] == seen[1][1] and len(pipe.device_pool) == 1
    # whole generations: two prompts in a row through the pool equal the plain pipeline's images
    for prompts in (["a red circle on the left", "a blue star"], ["a blue star at the top", "a red ring"]):
        np.testing.assert_array_equal(pipe(prompts, steps=3, seed=2, batch=2).images,
                                      plain(prompts, steps=3, seed=2, batch=2).images)
    assert len(pipe.device_pool) == 1 and seen[0][0].addresses() == seen[0][1] and not seen[0][0].in_use


def test_device_pool_lends_a_set_to_one_generation_at_a_time(tiny_onnx):
    from onnxdiffusion.runtime.backbone import DeviceBackbone

    pipe = Pipeline.from_folder(tiny_onnx)
    shape = pipe.latent_shape_for(1)
    cond, uncond = pipe.encode_prompt(["a"]), pipe.encode_prompt([""])
    a = DeviceBackbone(pipe.backbone, shape, cond, uncond, 4.0, device="cpu", pool=pipe.device_pool)
    b = DeviceBackbone(pipe.backbone, shape, cond, uncond, 4.0, device="cpu", pool=pipe.device_pool)
    assert a.buffers is not b.buffers and a.buffers.graph_id != b.buffers.graph_id  # concurrent: own buffers, own graph
    first = a.buffers
    a.close()
    c = DeviceBackbone(pipe.backbone, shape, cond, uncond, 4.0, device="cpu", pool=pipe.device_pool)
    assert c.buffers is first and len(pipe.device_pool) == 2


def test_openvino_float_math_follows_the_cpu_and_leaves_a_given_load_config():
    import json

    from onnxdiffusion.profiles.providers import bf16_wanted

    auto = load_profile("openvino-int8")
    assert auto.float_math == "auto"
    assert bf16_wanted(auto, frozenset({"avx512_vnni", "amx_bf16"})) and bf16_wanted(auto, frozenset({"avx512_bf16"}))
    assert not bf16_wanted(auto, frozenset({"avx512_vnni", "avx2"}))
    base = {"version": 1, "name": "x", "provider": "openvino", "provider_options": {"device_type": "CPU"}}
    forced = providers(Profile.from_dict({**base, "float_math": "bf16"}, "x.yaml"))
    assert json.loads(forced[0][1]["load_config"]) == {"CPU": {"INFERENCE_PRECISION_HINT": "bf16"}}
    assert "load_config" not in providers(Profile.from_dict(base, "x.yaml"))[0][1]
    mine = {**base, "float_math": "bf16", "provider_options": {"device_type": "CPU", "load_config": "{}"}}
    assert providers(Profile.from_dict(mine, "x.yaml"))[0][1]["load_config"] == "{}"  # the user's own wins
    gpu = {**base, "float_math": "bf16", "provider_options": {"device_type": "GPU"}}
    assert "load_config" not in providers(Profile.from_dict(gpu, "x.yaml"))[0][1]
    # the run's thread count reaches OpenVINO (ORT's intra-op setting does not), unless the profile names its own
    assert providers(Profile.from_dict(base, "x.yaml"), threads=1)[0][1]["num_of_threads"] == "1"
    assert "num_of_threads" not in providers(Profile.from_dict(base, "x.yaml"))[0][1]
    own = {**base, "provider_options": {"device_type": "CPU", "num_of_threads": "4"}}
    assert providers(Profile.from_dict(own, "x.yaml"), threads=1)[0][1]["num_of_threads"] == "4"


def test_openvino_is_told_about_operators_it_cannot_run(tiny_onnx, tmp_path):
    import onnx

    from onnxdiffusion.onnxio.session import check_external_data
    from onnxdiffusion.onnxio.attention import decompose_attention
    from onnxdiffusion.runtime.profiled import foreign_ops_note

    fused = tiny_onnx / "unet" / "model.onnx"
    io = check_external_data(fused)
    note = foreign_ops_note(io.contrib_ops, "openvino")
    assert "MultiHeadAttention" in note and "stored=qdq" in note and "\n" not in note
    assert foreign_ops_note(io.contrib_ops, "cpu") is None
    # its weights are inside the file: the attention is written out at load, nothing left to warn about
    assert io.written_out == io.contrib_ops["MultiHeadAttention"] > 0 and not io.foreign_ops
    written_out = tmp_path / "model.onnx"
    onnx.save(decompose_attention(onnx.load(str(fused))), str(written_out))
    assert foreign_ops_note(check_external_data(written_out).contrib_ops, "openvino") is None
    # weights outside the file (a > 2 GB graph): the fused nodes stay, and the pipeline says so
    external = tmp_path / "ext" / "model.onnx"
    external.parent.mkdir()
    onnx.save(onnx.load(str(fused)), str(external), save_as_external_data=True, size_threshold=0)
    left = check_external_data(external)
    assert left.written_out == 0 and left.foreign_ops == left.contrib_ops
    assert "MultiHeadAttention" in foreign_ops_note(left.foreign_ops, "openvino")
