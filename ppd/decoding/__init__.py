"""The decoding engine, split by where each part runs.

- ``tables.py``: a tree set as stacked device tensors, indexed by each row's depth key;
- ``confident.py``: the tables of a confident tree set, each step's candidates chosen from the guesses;
- ``kv_cache.py``: one KV buffer for every layer, and the cache view transformers' layers write through;
- ``state.py``: the persistent buffers of one batch bucket, reset per request;
- ``step.py``: the device step, a pure function of those buffers (what is compiled and captured);
- ``support.py``: which models the step decodes exactly (refusals, and a probe forward once per model);
- ``graphs.py``: eager, compiled or CUDA-graph execution of the step;
- ``loop.py``: the host loop (prefill, steps, one small read-back per step).
"""
