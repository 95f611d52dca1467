"""The training state's structure, from ``init_state`` alone: its tree, and each leaf's shape and dtype.

Traced abstractly once (``jax.eval_shape``: nothing is computed, no device is touched) and kept for
the whole session: every epoch's shardings, restore, checkpoints and compiled step start from it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["StateTemplate"]

PyTree = Any


class StateTemplate:
    """The state ``init_state`` makes, as shapes: its tree structure and its leaves, in flatten order."""

    def __init__(self, init_state: Callable[[], PyTree]) -> None:
        self._init_state = init_state
        self._treedef: Any = None
        self._leaves: list[jax.ShapeDtypeStruct] | None = None

    def leaves(self) -> list[jax.ShapeDtypeStruct]:
        if self._leaves is None:
            shapes = jax.eval_shape(self._init_state)
            leaves, self._treedef = jax.tree_util.tree_flatten(shapes)
            self._leaves = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in leaves]
        return self._leaves

    @property
    def treedef(self) -> Any:
        self.leaves()
        return self._treedef

    def shapes(self) -> list[tuple[tuple[int, ...], Any]]:
        """Every leaf's (shape, numpy dtype)."""
        return [(tuple(x.shape), np.dtype(x.dtype)) for x in self.leaves()]

    def tree(self, leaves: Sequence[Any]) -> PyTree:
        """``leaves`` (in flatten order) in the state's tree structure."""
        return jax.tree_util.tree_unflatten(self.treedef, list(leaves))

    def flatten(self, tree: PyTree) -> list[Any]:
        """The subtrees of ``tree`` at the state's leaves (a tree of the state's structure, flattened)."""
        return list(self.treedef.flatten_up_to(tree))
