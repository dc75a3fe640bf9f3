"""Layers stacked along a leading dimension and run with `lax.scan` or unrolled."""

from collections.abc import Callable

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray


def stack_layers(make: Callable[[PRNGKeyArray], eqx.Module], key: PRNGKeyArray, count: int):
    """Build `count` layers with one call of `make` under `filter_vmap`.

    **Arguments:**

    - `make`: builds one layer from a key.
    - `key`: split into one key per layer.
    - `count`: number of layers.

    **Returns:**

    One layer module whose arrays have a leading dimension of size `count` (placed on
    `axes.LAYERS` by [`eqdel.shard`][]).
    """
    return eqx.filter_vmap(make)(jax.random.split(key, count))


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": jax.checkpoint_policies.dots_saveable,
    "checkpoint_dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_with_no_batch_dims_saveable": (jax.checkpoint_policies.dots_with_no_batch_dims_saveable),
}
"""Rematerialisation policy names and the `jax.checkpoint_policies` they mean (`none`:
store every activation; `full`: recompute each layer in the backward pass)."""


def run_layers(
    stacked: eqx.Module,
    step: Callable,
    carry,
    xs=None,
    *,
    scan: bool = True,
    remat: str = "none",
):
    """Run `carry, y = step(layer, carry, x)` over stacked layers.

    **Arguments:**

    - `stacked`: layers from [`eqdel.nn.stack_layers`][].
    - `step`: applies one layer.
    - `carry`: what flows from layer to layer (the hidden states).
    - `xs`: per-layer inputs (arrays with a leading layer dimension), or `None`.
    - `scan`: `lax.scan` over the layers (compile time flat in depth); `False` unrolls
        them. Both agree to float rounding.
    - `remat`: a name from [`eqdel.nn.REMAT_POLICIES`][], applied to each layer.

    **Returns:**

    `(carry, ys)` with `ys` stacked over layers, as `lax.scan` returns.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat policy {remat!r}; known: {sorted(REMAT_POLICIES)}.")
    dynamic, static = eqx.partition(stacked, eqx.is_array)

    def body(carry, inputs):
        layer, x = inputs
        return step(eqx.combine(layer, static), carry, x)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])

    return jax.lax.scan(body, carry, (dynamic, xs), unroll=not scan)
