"""tinylm: a small byte-level transformer LM in plain JAX, the example workload for remesh.

It is deliberately small (trains visibly in a minute on a laptop CPU) and fully deterministic: the
data order is a pure function of (step, seed) and the train state is a dict of arrays, so a run that
recovers from a checkpoint on a different world size can be compared with a clean run step by step.

- ``data``: the shipped corpus, ``global_batch(step, ...)`` and ``host_slice(batch, rank, world)``.
- ``model``: ``Config``, ``init_state``, ``train_step`` (jit it; shard the batch along a data axis).
- ``train_plain``: a single-process training script, the baseline without remesh.
"""
