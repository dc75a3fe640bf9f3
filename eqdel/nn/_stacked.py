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


def run_layers(stacked: eqx.Module, step: Callable, carry, xs=None, *, scan: bool = True):
    """Run `carry, y = step(layer, carry, x)` over stacked layers.

    **Arguments:**

    - `stacked`: layers from [`eqdel.nn.stack_layers`][].
    - `step`: applies one layer.
    - `carry`: what flows from layer to layer (the hidden states).
    - `xs`: per-layer inputs (arrays with a leading layer dimension), or `None`.
    - `scan`: `lax.scan` over the layers (compile time flat in depth); `False` unrolls
        them in Python. Both give identical numbers.

    **Returns:**

    `(carry, ys)` with `ys` stacked over layers, as `lax.scan` returns.
    """
    dynamic, static = eqx.partition(stacked, eqx.is_array)

    def body(carry, inputs):
        layer, x = inputs
        return step(eqx.combine(layer, static), carry, x)

    return jax.lax.scan(body, carry, (dynamic, xs), unroll=not scan)
