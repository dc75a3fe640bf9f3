"""Splitting arrays stacked along a leading layer dimension into one module per layer."""

import equinox as eqx
import jax


def unstack_layers(stacked: eqx.Module | tuple[eqx.Module, ...]) -> tuple[eqx.Module, ...]:
    """Split stacked layers into one module per layer.

    **Arguments:**

    - `stacked`: layers from [`eqdel.nn.stack_layers`][] (a tuple of layers is
        returned as it is).

    **Returns:**

    A tuple of layer modules, each holding its own arrays, which
    [`eqdel.nn.run_layers`][] runs in order. A loop that runs the layers many times
    (the decode loop) reads each layer's weights in place this way, where slicing the
    stacked arrays inside the loop copies them on every pass.
    """
    if isinstance(stacked, tuple):
        return stacked
    dynamic, static = eqx.partition(stacked, eqx.is_array)
    count = jax.tree.leaves(dynamic)[0].shape[0]
    return tuple(
        eqx.combine(jax.tree.map(lambda x, i=i: x[i], dynamic), static) for i in range(count)
    )
