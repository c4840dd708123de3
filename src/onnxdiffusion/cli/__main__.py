"""`python -m onnxdiffusion.cli`: the same process as the `onnxdiffusion` script."""

from . import main

main()
