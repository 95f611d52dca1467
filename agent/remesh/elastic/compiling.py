"""The session's own step (``Session.run``), compiled for every epoch's mesh from shapes alone.

The user's ``train_step`` is traced once per process (tracing, autodiff included, does not depend on
the mesh) and kept as a program; every epoch only lowers and compiles that program for its mesh,
while the state is being restored (the two take about as long).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from jax.extend.core import ClosedJaxpr, jaxpr_as_fun
from jax.sharding import NamedSharding

from remesh.elastic.agent_client import Assignment
from remesh.elastic.data import StepData
from remesh.elastic.template import StateTemplate

__all__ = ["StepCompiler"]

PyTree = Any
CompiledStep = Callable[[PyTree, PyTree], tuple[PyTree, Any]]


class StepCompiler:
    """Traces ``train_step`` once and compiles it for each epoch's mesh; its batches' shapes come
    from ``data`` (one row, since a host reads only its own) or ``batch_for_step``."""

    def __init__(
        self,
        template: StateTemplate,
        train_step: Callable[[PyTree, PyTree], tuple[PyTree, Mapping[str, jax.Array]]],
        data: StepData | None,
        batch_for_step: Callable[[int], np.ndarray] | None,
    ) -> None:
        self.template = template
        self._train_step = train_step
        self._data = data
        self._batch_for_step = batch_for_step
        self._program: tuple[ClosedJaxpr, Any] | None = None
        # Not the background work's low priority: a recovery waits for the compiler.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="remesh-compile")

    @property
    def traced(self) -> bool:
        """Whether the step was traced already."""
        return self._program is not None

    def compile_later(
        self,
        assignment: Assignment,
        shardings: list[NamedSharding],
        by_rows: NamedSharding,
        replicated: NamedSharding,
    ) -> Future[tuple[CompiledStep, dict[str, float]]]:
        """``compile`` in the background."""
        return self._pool.submit(self.compile, assignment, shardings, by_rows, replicated)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def program(self) -> tuple[ClosedJaxpr, Any]:
        """The step function traced once per process, from shapes alone: its program and the tree of
        its outputs.

        Tracing is the Python half of compiling (autodiff included) and does not depend on the mesh,
        but JAX's own trace cache goes with the runtime at every re-mesh. Kept here, every later
        epoch only replays the program for its mesh, a fraction of tracing the user's function.
        """
        if self._program is None:
            state = self.template.tree(self.template.leaves())
            traced = jax.jit(self._train_step).trace(state, self._batch_shapes(0))
            out_tree = traced.out_tree
            children = out_tree.children()
            returned = children[0] if len(children) == 2 else None
            if returned != self.template.treedef:
                raise TypeError(
                    "train_step must return (state, metrics) with the state shaped like its input; "
                    f"it returned {out_tree}"
                )
            closed = traced.jaxpr
            # Constants on this runtime's devices would not survive the re-mesh: keep them on the host.
            consts = [np.asarray(c) if isinstance(c, jax.Array) else c for c in closed.consts]
            self._program = (ClosedJaxpr(closed.jaxpr, consts), out_tree)
        return self._program

    def compile(
        self,
        assignment: Assignment,
        shardings: list[NamedSharding],
        by_rows: NamedSharding,
        replicated: NamedSharding,
    ) -> tuple[CompiledStep, dict[str, float]]:
        """The step for this epoch's mesh, and where compiling it went (trace, lower, XLA)."""
        t = time.monotonic()
        program, out_tree = self.program()
        timings = {"compile_trace": time.monotonic() - t}
        template = self.template.leaves()
        # Any step's batch has the shapes of every step's batch.
        batch_leaves = jax.tree.leaves(self._batch_shapes(max(assignment.restore_step, 0)))
        args = [
            *(
                jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
                for x, s in zip(template, shardings, strict=True)
            ),
            *(jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=by_rows) for x in batch_leaves),
        ]
        metrics = out_tree.num_leaves - len(shardings)
        step_fn = jax.jit(
            jaxpr_as_fun(program),
            in_shardings=(*shardings, *[by_rows] * len(batch_leaves)),
            out_shardings=[*shardings, *[replicated] * metrics],  # the program returns a list
        )
        t = time.monotonic()
        traced = step_fn.trace(*args)
        timings["compile_trace"] += time.monotonic() - t
        t = time.monotonic()
        lowered = traced.lower()
        timings["compile_lower"] = time.monotonic() - t
        t = time.monotonic()
        compiled = lowered.compile()
        timings["compile_xla"] = time.monotonic() - t
        treedef = self.template.treedef

        def step(state: PyTree, batch: PyTree) -> tuple[PyTree, Any]:
            flat = compiled(*treedef.flatten_up_to(state), *jax.tree.leaves(batch))
            return jax.tree_util.tree_unflatten(out_tree, flat)

        return step, timings

    def _batch_shapes(self, step: int) -> PyTree:
        """The shapes of a global batch: from ``batch_for_step``, or from one row of ``data`` (a
        host reads only its own rows, even to learn the shapes)."""
        if self._data is not None:
            one = self._data.rows(step, slice(0, 1))
            size = self._data.global_batch_size
            return jax.tree.map(lambda x: jax.ShapeDtypeStruct((size, *np.shape(x)[1:]), x.dtype), one)
        assert self._batch_for_step is not None
        sample = self._batch_for_step(step)
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), sample)
