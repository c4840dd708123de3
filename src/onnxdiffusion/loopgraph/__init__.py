"""The Loop-graph compiler: the whole sampling loop (sampler, guidance, per-step techniques) built into one ONNX graph
(builder.py and its parts), and the compile-loop verb's library code that writes it into a model folder
(compile.py). The numpy samplers it compiles are samplers/."""
