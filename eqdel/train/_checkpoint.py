"""Sharded, atomic, resumable train-state checkpoints on orbax-checkpoint."""

from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from .._partition_rules import leaf_path
from .._placement import is_array_like


def _leaf_name(path) -> str:
    """A readable, filesystem-safe name for a pytree path: `model.model.norm.weight`,
    `opt_state.0.mu.lm_head.weight`."""
    return leaf_path(path, sep=".")


def _is_key(x) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _arrays_by_name(state) -> dict:
    """Every array leaf of `state` (or its `jax.ShapeDtypeStruct`), named by its path;
    PRNG keys are stored as their raw key data."""
    named = {}
    leaves = jax.tree_util.tree_leaves_with_path(eqx.filter(state, is_array_like))
    for path, leaf in leaves:
        if _is_key(leaf) and eqx.is_array(leaf):
            leaf = jax.random.key_data(leaf)
        elif _is_key(leaf):
            data = jax.eval_shape(jax.random.key_data, leaf)
            leaf = jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=leaf.sharding)
        named[_leaf_name(path)] = leaf
    return named


def _manager(directory, max_to_keep: int | None = None):
    import orbax.checkpoint as ocp  # imported on first use: it takes seconds to load

    options = ocp.CheckpointManagerOptions(
        max_to_keep=max_to_keep, create=True, enable_async_checkpointing=False
    )
    return ocp.CheckpointManager(
        Path(directory).absolute(), options=options, item_handlers=ocp.StandardCheckpointHandler()
    )


def _orbax_args():
    import orbax.checkpoint as ocp

    return ocp.args


def save_train_state(directory, state, *, max_to_keep: int | None = None) -> Path:
    """Save a [`eqdel.train.TrainState`][] (or any pytree with a `step`) as checkpoint
    `directory/<step>`, each process writing its own shards.

    The step is written to a temporary directory and renamed into place only once
    complete, so an interrupted save leaves the earlier checkpoints as they were.

    **Arguments:**

    - `directory`: the run's checkpoint directory (created if missing).
    - `state`: the state to save; its `step` names the checkpoint.
    - `max_to_keep`: delete the oldest steps beyond this many (`None`: keep all).

    **Returns:**

    The directory of the saved step.
    """
    step = int(state.step)
    with _manager(directory, max_to_keep) as manager:
        if step in manager.all_steps():
            raise FileExistsError(f"{Path(directory) / str(step)}: step {step} is already saved.")
        manager.save(step, args=_orbax_args().StandardSave(_arrays_by_name(state)))
        manager.wait_until_finished()
    return Path(directory) / str(step)


def latest_train_step(directory) -> int | None:
    """The newest complete step saved in `directory`, or `None` if there is none."""
    if not Path(directory).is_dir():
        return None
    with _manager(directory) as manager:
        return manager.latest_step()


def restore_train_state(directory, like, *, step: int | None = None):
    """Restore a state saved by [`eqdel.train.save_train_state`][].

    **Arguments:**

    - `directory`: the run's checkpoint directory.
    - `like`: a state of the same structure, e.g. a fresh
        [`eqdel.train.init_train_state`][] or its `equinox.filter_eval_shape`; every
        array is restored with its shape, dtype and sharding (so onto its mesh).
    - `step`: the step to restore (default: the newest complete one).

    **Returns:**

    `like` with every array replaced by the saved one.

    **Raises:**

    `FileNotFoundError` when there is no such step; `ValueError` naming the leaves that
    are missing, unexpected or of another shape or dtype.
    """
    with _manager(directory) as manager:
        step = manager.latest_step() if step is None else step
        if step is None or step not in manager.all_steps():
            raise FileNotFoundError(
                f"{directory}: no complete checkpoint"
                + ("" if step is None else f" for step {step}")
                + f" (saved steps: {sorted(manager.all_steps())})."
            )
        wanted = _arrays_by_name(like)
        _check_matches(Path(directory) / str(step), manager.item_metadata(step), wanted)
        target = {
            name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=_sharding_of(x))
            for name, x in wanted.items()
        }
        restored = manager.restore(step, args=_orbax_args().StandardRestore(target))

    arrays, rest = eqx.partition(like, is_array_like)
    leaves = []
    for path, old in jax.tree_util.tree_leaves_with_path(arrays):
        new = restored[_leaf_name(path)]
        if _is_key(old):
            # An abstract key carries no implementation: it gets the default one.
            impl = jax.random.key_impl(old) if eqx.is_array(old) else None
            new = jax.random.wrap_key_data(new, impl=impl)
        leaves.append(new)
    return eqx.combine(jax.tree.unflatten(jax.tree.structure(arrays), leaves), rest)


def _sharding_of(x):
    sharding = getattr(x, "sharding", None)
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return sharding


def _check_matches(where: Path, metadata, wanted: dict) -> None:
    saved = dict(metadata.items()) if metadata is not None else {}
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    different = [
        f"{name} (saved {tuple(saved[name].shape)} {np.dtype(saved[name].dtype)}, "
        f"wanted {tuple(x.shape)} {np.dtype(x.dtype)})"
        for name, x in wanted.items()
        if name in saved
        and (
            tuple(saved[name].shape) != tuple(x.shape)
            or np.dtype(saved[name].dtype) != np.dtype(x.dtype)
        )
    ]
    problems = [
        f"{label}: {', '.join(names[:8])}"
        + (f" and {len(names) - 8} more" if len(names) > 8 else "")
        for label, names in (
            ("missing", missing),
            ("unexpected", unexpected),
            ("different shape or dtype", different),
        )
        if names
    ]
    if problems:
        raise ValueError(
            f"{where}: the checkpoint does not match the state; " + "; ".join(problems)
        )
