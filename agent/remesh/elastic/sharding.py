"""How the training state is laid out over an epoch's mesh, and where each piece of it comes from.

The mesh of an epoch has two axes, ``("replica", "fsdp")``: the hosts split into replica groups of
``hosts_per_replica`` hosts each (HSDP); the state is sharded over the devices of a group (``fsdp``)
and replicated across groups; the batch is split over both. Without ``hosts_per_replica`` there is
one group of every host (plain FSDP). The user describes the sharding once, as a function from a
mesh and the state's shapes to ``PartitionSpec``s (``fsdp_partition`` is the usual rule), and remesh
asks it again for every epoch's mesh.

Uneven sizes have one rule, applied per epoch and logged: a dimension whose size does not divide by
the mesh axes it is sharded over is replicated over them instead (``fit``); a world size that does
not split into whole replica groups makes one group of every host. Neither ever fails an epoch; a
coordinator started with ``--must-divide`` keeps world sizes to those that divide.

A piece of the state is one leaf's values over a ``Cell`` (``remesh.elastic.cells``: a box in
global coordinates, independent of the mesh that produced it; ``plan_fetch`` there decides which
member serves each old cell); ``assemble`` builds a needed box from the pieces that overlap it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import structlog
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from remesh.elastic.cells import Cell, Fetch, Offer, Uncovered, cell_of, covers, intersect, plan_fetch, whole

__all__ = [
    "AXES",
    "Cell",
    "Fetch",
    "Layout",
    "Offer",
    "Uncovered",
    "assemble",
    "build",
    "build_mesh",
    "cell_of",
    "covers",
    "first_replicas",
    "fit",
    "fsdp_partition",
    "plan_fetch",
    "replicated_partition",
    "whole",
]

log = structlog.get_logger("remesh.elastic")

PyTree = Any
AXES = ("replica", "fsdp")
# The state's sharding for a mesh: a pytree of PartitionSpecs shaped like the state.
Partition = Callable[[Mesh, PyTree], PyTree]


def replicated_partition(mesh: Mesh, shapes: PyTree) -> PyTree:
    """Every leaf whole on every device (data parallelism)."""
    return jax.tree.map(lambda _: P(), shapes)


def fsdp_partition(mesh: Mesh, shapes: PyTree, min_elements: int = 1024) -> PyTree:
    """Shard each leaf over ``fsdp`` on its largest dimension that divides by the axis size.

    Leaves under ``min_elements`` (biases, norms, counters) stay replicated: sharding them saves
    nothing and costs a collective each. A leaf with no dividing dimension stays replicated too, so
    the rule holds for every world size a shrink may leave.
    """
    size = mesh.shape["fsdp"]

    def spec(leaf: Any) -> P:
        shape = tuple(leaf.shape)
        if size == 1 or math.prod(shape) < min_elements:
            return P()
        dims = sorted((d for d in range(len(shape)) if shape[d] % size == 0), key=lambda d: -shape[d])
        if not dims:
            return P()
        axes: list[str | None] = [None] * len(shape)
        axes[dims[0]] = "fsdp"
        return P(*axes[: dims[0] + 1])

    return jax.tree.map(spec, shapes)


@dataclass(frozen=True)
class Layout:
    """How the state and the batch are laid out; passed to the session once, applied every epoch."""

    # (mesh, state shapes) -> PartitionSpecs; None: replicated.
    partition: Partition | None = None
    # Hosts in one replica group (HSDP); None: one group of every host (FSDP, or replicated).
    hosts_per_replica: int | None = None

    def replicas(self, world_size: int) -> int:
        k = self.hosts_per_replica
        if not k or k >= world_size:
            return 1
        if world_size % k:
            log.warning(
                "the hosts do not split into whole replica groups: one group of every host this epoch",
                world_size=world_size,
                hosts_per_replica=k,
            )
            return 1
        return world_size // k

    def specs(self, mesh: Mesh, shapes: PyTree) -> PyTree:
        partition = self.partition or replicated_partition
        specs = partition(mesh, shapes)
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(shapes)[0]]
        leaves, treedef = jax.tree_util.tree_flatten(shapes)
        spec_leaves = _flatten_up_to(treedef, specs)
        return jax.tree_util.tree_unflatten(
            treedef,
            [fit(s, x.shape, mesh, path) for s, x, path in zip(spec_leaves, leaves, paths, strict=True)],
        )


def _flatten_up_to(treedef: Any, tree: PyTree) -> list[Any]:
    """``tree``'s subtrees at the leaves of ``treedef`` (a PartitionSpec is a tuple: not flattened)."""
    return list(treedef.flatten_up_to(tree))


def build_mesh(devices: Sequence[Any], world_size: int, replicas: int) -> Mesh:
    """The epoch's mesh: ``devices`` ordered by process, split into ``replicas`` rows of whole hosts.

    Device order follows the rank, so the rows of a batch split over both axes that a process feeds
    are the contiguous block at its rank.
    """
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.array(ordered).reshape(replicas, len(ordered) // replicas)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def fit(spec: P, shape: Sequence[int], mesh: Mesh, path: str = "") -> P:
    """``spec`` with every dimension that does not divide by its mesh axes replicated instead."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    fitted: list[Any] = []
    for dim, entry in enumerate(entries):
        names = () if entry is None else (entry if isinstance(entry, tuple) else (entry,))
        size = math.prod(mesh.shape[n] for n in names)
        if names and shape[dim] % size:
            log.warning(
                "a sharded dimension does not divide by its mesh axes: replicated this epoch",
                leaf=path,
                dimension=dim,
                size=shape[dim],
                axes=list(names),
                axes_size=size,
            )
            fitted.append(None)
        else:
            fitted.append(entry)
    while fitted and fitted[-1] is None:
        fitted.pop()
    return P(*fitted)


def _local(box: Cell, within: Cell) -> tuple[slice, ...]:
    return tuple(slice(lo - base, hi - base) for (lo, hi), (base, _) in zip(box, within, strict=True))


def build(
    pieces: Mapping[tuple[int, Cell], np.ndarray],
    shapes: Sequence[tuple[tuple[int, ...], Any]],
    shardings: Sequence[NamedSharding],
) -> list[jax.Array]:
    """Leaves of ``shapes`` (shape, dtype) laid out by ``shardings``, each device's part assembled
    from ``pieces`` ((leaf, cell) -> values, cut by any other layout) that together cover it."""
    by_leaf: dict[int, list[tuple[Cell, np.ndarray]]] = {}
    for (leaf, cell), values in pieces.items():
        by_leaf.setdefault(leaf, []).append((cell, values))
    leaves: list[jax.Array] = []
    for i, (sharding, (shape, dtype)) in enumerate(zip(shardings, shapes, strict=True)):
        parts: dict[Cell, np.ndarray] = {}

        def part(
            index: tuple[slice, ...] | None,
            i: int = i,
            shape: tuple[int, ...] = shape,
            dtype: Any = dtype,
            parts: dict[Cell, np.ndarray] = parts,
        ) -> np.ndarray:
            cell = cell_of(index, shape)
            if cell not in parts:
                parts[cell] = assemble(cell, by_leaf.get(i, []), dtype)
            return parts[cell]

        leaves.append(jax.make_array_from_callback(shape, sharding, part))
    return leaves


def assemble(region: Cell, pieces: Iterable[tuple[Cell, np.ndarray]], dtype: Any) -> np.ndarray:
    """The values over ``region`` from ``pieces`` that together cover it (no copy where one piece is
    exactly the region)."""
    pieces = list(pieces)
    for cell, values in pieces:
        if cell == region:
            return values
    out = np.empty([hi - lo for lo, hi in region], dtype=dtype)
    for cell, values in pieces:
        box = intersect(region, cell)
        if box is not None:
            out[_local(box, region)] = values[_local(box, cell)]
    return out


def needed_cells(sharding: NamedSharding, shape: Sequence[int]) -> list[Cell]:
    """The distinct boxes of a leaf this process's devices hold under ``sharding``."""
    cells = {
        cell_of(index, shape) for index in sharding.addressable_devices_indices_map(tuple(shape)).values()
    }
    return sorted(cells)


def first_replicas(leaves: Sequence[jax.Array]) -> dict[tuple[int, Cell], jax.Array]:
    """This process's shards that are the first replica of their cell, by (leaf, cell): across the
    processes of a job, every cell of the state once."""
    return {
        (i, cell_of(s.index, x.shape)): s.data
        for i, x in enumerate(leaves)
        for s in x.addressable_shards
        if s.replica_id == 0
    }
