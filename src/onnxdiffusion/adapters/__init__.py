"""LoRA adapters: file formats -> adapter tensors -> extra feeds of the insertion points.

points.py         the graph rewrite (y = W x + (x A) B, rank-0 defaults), fp32 and ORT-fused int8 layers
folder.py         `lora points`: a derived model folder with insertion points
safetensors_io.py safetensors read/write with numpy alone (pickles refused)
lora_file.py      diffusers/peft LoRA files -> (down, up, alpha/r) per component and module
feeds.py          several LoRAs -> concatenated-rank A/B feeds, every check naming the file and key
fused.py          the host loop's backbone: the plain graph without an adapter, merged weights W' = W + A B
                  (computed once per adapter set) on a graph whose merged layers' weights are inputs with one
runtime.py        a pipeline's run-time LoRA state (RuntimeLora, Pipeline.lora: the fused backbone, files read),
                  the feeds on the text encoders' and backbone's sessions (host loop), and a compiled graph's
                  (sampling_graph_inputs: a --whole graph run by onnxruntime alone)
graph.py          the insertion points as inputs of the Loop / unrolled / whole sampling graphs
fuse.py           `export --lora`: LoRAs merged into the torch modules before export
export_lora.py    what `export` calls (--lora, --lora-points): files checked, merged, points inserted
convert.py        `lora convert`: kohya/A1111 files through diffusers' converters (export side)
"""
