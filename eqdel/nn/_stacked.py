"""Layers stacked along a leading dimension and run with `lax.scan` or unrolled."""

from collections.abc import Callable

import equinox as eqx
import jax
from jaxtyping import PRNGKeyArray

from .._unstack import unstack_layers as unstack_layers
from ._few_rows import PRODUCT_NAME
from ._scan_bits import read_scanned, scanned_form


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


def _and_named_products(policy: Callable) -> Callable:
    """`policy`, also saving the outputs of the products it does not recognise as such:
    those through OpenBLAS (custom calls) and the 16-bit products on CPU (their custom
    gradient hides the product from the policy)."""
    products = jax.checkpoint_policies.save_only_these_names(PRODUCT_NAME)
    return jax.checkpoint_policies.save_from_both_policies(policy, products)


REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "nothing_saveable": jax.checkpoint_policies.nothing_saveable,
    "everything_saveable": jax.checkpoint_policies.everything_saveable,
    "dots_saveable": _and_named_products(jax.checkpoint_policies.dots_saveable),
    "checkpoint_dots": _and_named_products(jax.checkpoint_policies.checkpoint_dots),
    "dots_with_no_batch_dims_saveable": _and_named_products(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    ),
}
"""Rematerialisation policy names and the `jax.checkpoint_policies` they mean (`none`:
store every activation; `full`: recompute each layer in the backward pass). The dots
policies also save the float32 products that run through OpenBLAS and the 16-bit
products on CPU."""


def run_layers(
    stacked: eqx.Module | tuple[eqx.Module, ...],
    step: Callable,
    carry,
    xs=None,
    *,
    scan: bool = True,
    remat: str = "none",
):
    """Run `carry, y = step(layer, carry, x)` over stacked layers.

    **Arguments:**

    - `stacked`: layers from [`eqdel.nn.stack_layers`][], or a tuple of layers from
        [`eqdel.nn.unstack_layers`][] (run one after another).
    - `step`: applies one layer.
    - `carry`: what flows from layer to layer (the hidden states).
    - `xs`: per-layer inputs (arrays with a leading layer dimension; for a tuple of
        layers, a tuple with one entry per layer), or `None`.
    - `scan`: `lax.scan` over the layers (compile time flat in depth); `False` unrolls
        them. Both agree to float rounding.
    - `remat`: a name from [`eqdel.nn.REMAT_POLICIES`][], applied to each layer.

    **Returns:**

    `(carry, ys)` with `ys` stacked over layers, as `lax.scan` returns (for a tuple of
    layers, a tuple of each layer's `y`).
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"Unknown remat policy {remat!r}; known: {sorted(REMAT_POLICIES)}.")
    layers = stacked if isinstance(stacked, tuple) else (stacked,)
    static = eqx.partition(layers[0], eqx.is_array)[1]

    def body(carry, inputs):
        layer, x = inputs
        layer = read_scanned(layer)
        return step(eqx.combine(layer, static), carry, x)

    if remat != "none":
        body = jax.checkpoint(body, policy=REMAT_POLICIES[remat])

    if isinstance(stacked, tuple):
        ys = []
        for layer, x in zip(stacked, xs or (None,) * len(stacked), strict=True):
            carry, y = body(carry, (eqx.filter(layer, eqx.is_array), x))
            ys.append(y)
        return carry, tuple(ys)
    arrays = scanned_form(eqx.filter(stacked, eqx.is_array))
    return jax.lax.scan(body, carry, (arrays, xs), unroll=not scan)
