"""The per-step techniques: what changes how each sampling step runs, one module each.

  registry.py          the composition order (ORDER) and the one table of what cannot combine (CONFLICTS),
                       read by generate, compile-loop, the sampling-graph builder and docs/techniques.md
  active.py            a generation's specs, parsed once from its options, and its techniques in order
  host_base.py         the host loop's hooks (HostTechnique: backbone, wrap, stops, after_step, graph_feeds)
  loop_base.py         the Loop graph builder's hooks (LoopTechnique: inputs, prologue, carried, call_backbone,
                       end_of_step)
  caching.py           step caching's spec parsing, the cut backbone and its host runner; caching_graph.py its
                       Loop twin; cache_base.py what a method is; cache_methods.py the methods by name;
                       cache_first_block.py, cache_taylorseer.py, cache_deepcache.py, cache_residual.py,
                       cache_magcache.py one each
  stop.py              adaptive stopping: spec, host test, Loop twin, manifest record
  correction.py, precision.py
                       output correction and the precision schedule: host wrapper and Loop twin each
  lora.py              run-time LoRA: host wrapper, graph twin (the insertion points as sampling-graph inputs) and
                       the graph's manifest record
  controlnet.py        ControlNet: spec, the nets' checks, loading and preparation, host wrapper (ControlHost);
                       controlnet_graph.py its Loop twin (ControlLoop and its builders)
  inpaint.py           inpainting's blend, host side; inpaint_graph.py its Loop twin and img2img's (the graph's
                       image inputs)
  state.py             TechniqueState: what techniques keep across a Pipeline's generations (pipe.technique_state)

Adding a cache method (say ``mymethod:THRESHOLD[:K]``):

1. ``techniques/cache_mymethod.py``: a frozen dataclass deriving from ``cache_base.CacheSpec`` with its settings
   as fields and ``method = "mymethod"``, ``usage = "mymethod:THRESHOLD[:K]"``, ``max_args = 2``; implement
   ``parse_args(spec, args)`` (the text after the name, split on ':'; use cache_base's ``ints`` /
   ``finite_threshold`` for one-line errors), ``check(spec)`` (ranges; the dict form
   ``cache={"method": "mymethod", ...}`` runs it), ``noop`` (True when it never skips: the uncut backbone
   runs), ``__str__`` (the text form, round-tripping), ``loop_feeds()`` (its run-time Loop inputs:
   ``cache_interval`` int64 and/or ``cache_threshold`` double, and any inputs of its own declared by ``graph_inputs()`` with defaults that
   cache nothing) and ``record()``
   if compile-loop must record more than the method (a structure compiled in, like TaylorSeer's ORDER).
   Host loop: ``policy()`` returns a ``cache_base.Policy`` whose ``reuse(step, f, sg)`` gives the span's
   stand-in (None: run it) and ``update(step, f, out, sg)`` sees the span's output (`f`: the first piece's
   outputs; `sg.hidden_in` / `sg.probe`: the hidden-state candidates). Loop graph: ``graph_state(b, span_type)``
   adds constants with ``b.const`` and returns the carried state [(initial, type, name)] (names get
   ``_in`` / ``_out`` in the body), ``graph_step(s)`` appends the decision with ``s.b.op`` and returns
   ``(full, span)`` from ``s.switch(full, compute, reuse, outs, types)``, ``compute(sub)`` calling
   ``s.run_rest(sub)``. Decide in the host and the graph with the same float arithmetic
   (samplers/cache_math.py, graph_fold.py) so both forms pick the same steps. Optional: ``span_args()``
   (more keywords to the family's ``cache_span``; ``{"all_blocks": True}``: the span is every block),
   ``prunes_first`` / ``float_span``, ``bind(pipe, steps)`` (the spec for one run: data it reads per run, such as
   the step count or the folder's manifest; refusals there come before any model runs).
2. One line in ``cache_methods.py``: the method's name in ``NAMES``.
3. ``tests/test_cache_mymethod.py``: parsing, no-op = the uncached image bit for bit, host = Loop
   (compile-loop --cache mymethod), and parity with the reference.

generate --cache, compile-loop --cache, the registry's refusals and the dict form then take it as they are.
A transformer family's ``cache_span`` gives every method but deepcache the blocks after the first (all of them
with ``all_blocks``).
"""
