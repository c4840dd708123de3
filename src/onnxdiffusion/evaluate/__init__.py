"""Evaluation of generated images: pixel metrics, Frechet distance, and the scene judge.

``metrics`` holds pure-numpy image and distribution metrics; ``judge`` wraps the shipped
ONNX judge (``models/judge/judge.onnx``) that reads a 64x64 scene back into per-slot
shape, colour and size, and scores images against their prompts.
"""
