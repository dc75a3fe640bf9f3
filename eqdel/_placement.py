"""Place every array leaf of a pytree on the mesh from the axes the leaf declares."""

import dataclasses
from collections.abc import Iterator
from typing import Any, NamedTuple

import equinox as eqx
import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from . import axes as ax
from ._field import AXES_METADATA_KEY
from ._sharding_config import Fallback, Kind, ShardingConfig, active_sharding, is_preset


class LeafPlacement(NamedTuple):
    """Where one array leaf goes."""

    path: str
    leaf: Any
    axes: tuple | None
    spec: PartitionSpec
    fallbacks: tuple[Fallback, ...]


def _declared_axes(module: eqx.Module, f: dataclasses.Field):
    declared = f.metadata.get(AXES_METADATA_KEY)
    if callable(declared) and not isinstance(declared, type):
        declared = declared(module)
    if is_preset(declared):
        declared = declared.axes
    return None if declared is None else tuple(declared)


def _is_module(x) -> bool:
    return isinstance(x, eqx.Module)


def _leaf_axes(tree, declared: tuple | None = None) -> Iterator[tuple | None]:
    """Yield the declared axes (or `None`) of every leaf of `tree`, in
    `jax.tree_util.tree_leaves` order. `declared` is what the enclosing field declares."""
    if isinstance(tree, eqx.Module):
        for f in dataclasses.fields(tree):
            if not f.metadata.get("static", False):
                yield from _leaf_axes(getattr(tree, f.name), _declared_axes(tree, f))
        return
    for child in jax.tree_util.tree_leaves(tree, is_leaf=_is_module):
        if isinstance(child, eqx.Module):
            yield from _leaf_axes(child)
        else:
            yield declared


def _full_axes(path: str, declared: tuple | None, ndim: int) -> tuple:
    if declared is None:
        return (None,) * ndim
    extra = ndim - len(declared)
    if extra < 0:
        raise ValueError(
            f"{path}: declares {len(declared)} axes but the array has only {ndim} dimensions."
        )
    return (ax.LAYERS,) * extra + declared


def placements(
    tree, cfg: ShardingConfig, mode: str | int = ax.MODE_TRAIN, kind: Kind = "parameter"
) -> list[LeafPlacement]:
    """Resolve the placement of every array leaf of `tree`.

    **Arguments:**

    - `tree`: any pytree (model, optimizer state, cache); `jax.ShapeDtypeStruct` leaves
        count as arrays.
    - `cfg`: the sharding config.
    - `mode`: the runtime mode the rules are taken in.
    - `kind`: the rule table, `"parameter"` or `"activation"`.

    **Returns:**

    One `LeafPlacement` per array leaf, in leaf order. Leaves with no declared axes are
    replicated (`PartitionSpec()` padded to their rank).
    """
    with_paths, _ = jax.tree_util.tree_flatten_with_path(tree)
    declared = list(_leaf_axes(tree))
    if len(declared) != len(with_paths):
        raise RuntimeError(
            f"internal: found axes for {len(declared)} leaves but the tree has {len(with_paths)}."
        )
    out = []
    for (path, leaf), leaf_axes in zip(with_paths, declared):
        if not is_array_like(leaf):
            continue
        where = jax.tree_util.keystr(path) or "<root>"
        full = _full_axes(where, leaf_axes, leaf.ndim)
        spec, fallbacks = cfg.resolve_with_fallbacks(
            full, mode, leaf.shape, kind=kind, where=where
        )
        out.append(
            LeafPlacement(where, leaf, None if leaf_axes is None else full, spec, fallbacks)
        )
    return out


def on_one_device(tree) -> bool:
    """Whether every array of `tree` lies on one and the same device (`False` when one is
    traced, which hides where it lies)."""
    devices = set()
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.core.Tracer):
            return False
        if isinstance(x, jax.Array):
            devices |= x.sharding.device_set
    return len(devices) <= 1


def is_array_like(x) -> bool:
    """An array, or the `jax.ShapeDtypeStruct` that `eqx.filter_eval_shape` leaves."""
    return eqx.is_array(x) or isinstance(x, jax.ShapeDtypeStruct)


def _map_arrays(tree, values: list):
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    it = iter(values)
    return jax.tree_util.tree_unflatten(
        treedef, [next(it) if is_array_like(leaf) else leaf for leaf in leaves]
    )


def partition_specs(
    tree, cfg: ShardingConfig, mode: str | int = ax.MODE_TRAIN, kind: Kind = "parameter"
):
    """The `PartitionSpec` of every array leaf, for `jax.jit` shardings or `shard_map`.

    **Arguments:** as [`eqdel.shard`][].

    **Returns:**

    A pytree of the same structure whose array leaves are `PartitionSpec`s; non-array
    leaves are kept as they are.
    """
    return _map_arrays(tree, [p.spec for p in placements(tree, cfg, mode, kind)])


def _is_local(x) -> bool:
    return not isinstance(x, jax.Array) or x.is_fully_addressable


def _from_local_copy(x, sharding: NamedSharding) -> jax.Array:
    """A global array on a mesh spanning several processes, each process filling its
    own devices from its full local copy of `x` (the same on every process)."""
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        data = _from_local_copy(jax.random.key_data(x), sharding)
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    host = np.asarray(x)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def shard(tree, cfg: ShardingConfig, mode: str | int = ax.MODE_TRAIN, kind: Kind = "parameter"):
    """Place every array leaf of `tree` on `cfg.mesh()` from its declared semantic axes.

    Outside `jax.jit` leaves are moved with `jax.device_put`; inside, the placement is a
    `jax.lax.with_sharding_constraint`; a `jax.ShapeDtypeStruct` (from
    `equinox.filter_eval_shape`) gets the sharding as its own. Leaves with no declared
    axes (an optimizer's step count, a user's own arrays) are replicated.

    **Arguments:**

    - `tree`: any pytree: a model, an optax state, a KV cache.
    - `cfg`: the sharding config.
    - `mode`: runtime mode for the rules (`axes.MODE_TRAIN` by default), or a dimension
        index as in [`eqdel.ShardingConfig.resolve`][].
    - `kind`: the rule table, `"parameter"` (default) or `"activation"`.

    **Returns:**

    A pytree of the same structure with its arrays placed.
    """
    mesh = cfg.mesh()
    placed = []
    for p in placements(tree, cfg, mode, kind):
        sharding = NamedSharding(mesh, p.spec)
        if isinstance(p.leaf, jax.core.Tracer):
            placed.append(jax.lax.with_sharding_constraint(p.leaf, sharding))
        elif isinstance(p.leaf, jax.ShapeDtypeStruct):
            placed.append(jax.ShapeDtypeStruct(p.leaf.shape, p.leaf.dtype, sharding=sharding))
        elif sharding.is_fully_addressable or not _is_local(p.leaf):
            placed.append(jax.device_put(p.leaf, sharding))
        else:
            placed.append(_from_local_copy(p.leaf, sharding))
    return _map_arrays(tree, placed)


def constrain(
    x: jax.Array, axes, cfg: ShardingConfig | None = None, mode: str | int = ax.MODE_TRAIN
):
    """Constrain an activation's sharding inside a forward pass.

    **Arguments:**

    - `x`: the activation.
    - `axes`: its semantic axes, one per dimension, or a `DynamicShardingAxes` preset.
    - `cfg`: the sharding config; by default the one of the enclosing
        [`eqdel.ShardingConfig.activate`][] block. With neither, `x` is returned as it
        is, so a model can constrain its activations and still run unsharded.
    - `mode`: runtime mode or dimension index, as in [`eqdel.ShardingConfig.resolve`][].

    **Returns:**

    `x` with a sharding constraint from the activation rule table.
    """
    cfg = active_sharding() if cfg is None else cfg
    if cfg is None:
        return x
    spec = cfg.resolve(axes, mode, x.shape, kind="activation")
    return jax.lax.with_sharding_constraint(x, NamedSharding(cfg.mesh(), spec))
