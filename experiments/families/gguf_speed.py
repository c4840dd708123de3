#!/usr/bin/env python
"""One backbone call of the full-width 3-block Qwen-Image (gguf_memory.py's folders W/out_fp32, W/out_q8, W/out_q4)
in ONNX Runtime's default session (prepacking on: MatMulNBits' int8 path), 2 threads, 256x256 (256 image tokens,
32 text tokens), batch 1; 3 rounds interleaved, medians.   python experiments/families/gguf_speed.py W"""
import time, sys, numpy as np, onnxruntime as ort, torch
from onnxdiffusion.export import family_export
from onnxdiffusion.export.pipeline import source_info


def main(W: str) -> None:
    base = f'{W}/qwenimage-src'
    family, info = source_info(base)
    spec = family.component_specs(info, {family.backbone})[family.backbone]
    dims = dict(family.export_dims(spec, info)[0]); print(dims)
    dims.update(batch_size=1, rows=16, cols=16, image_sequence_length=256, sequence_length=32, height_latent=32, width_latent=32, height=256, width=256)
    feeds = family_export.export_feeds(family, spec, dims, torch.Generator().manual_seed(0), 0)
    run = {t.name: feeds[t.name].numpy() for t in spec.inputs}
    sess = {}
    for k in ('fp32','q8','q4'):
        so = ort.SessionOptions(); so.intra_op_num_threads = 2
        sess[k] = ort.InferenceSession(f'{W}/out_{k}/transformer/model.onnx', so, providers=['CPUExecutionProvider'])
        sess[k].run(None, run)
    times = {k: [] for k in sess}
    outs = {}
    for r in range(3):
        for k in sess:
            t = time.perf_counter(); outs[k] = sess[k].run(None, run)[0]; times[k].append(time.perf_counter() - t)
    for k in sess: print(k, 'median s', round(float(np.median(times[k])), 3), [round(x, 2) for x in times[k]])
    print('ratio fp32/q8', np.median(times['fp32'])/np.median(times['q8']), 'fp32/q4', np.median(times['fp32'])/np.median(times['q4']))


if __name__ == "__main__":
    main(sys.argv[1])
