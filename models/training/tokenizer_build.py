"""The scene-vocabulary tokenizers now live in the package (the bench's --arch builders need them in an
installed package too): onnxdiffusion.bench.arch.tokenizers. Kept so the training scripts' import works."""

from onnxdiffusion.bench.arch.tokenizers import build_tokenizer_files, clip_tokenizer, t5_tokenizer  # noqa: F401
