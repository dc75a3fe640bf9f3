"""RMSNorm and LayerNorm over the last dimension."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .. import axes as ax
from .._field import field
from ._broadcast import trailing


class RMSNorm(eqx.Module):
    """Root-mean-square normalisation, computed in float32 and scaled by `weight`.

    `offset=1.0` gives the `(1 + weight)` form used by Gemma.
    """

    weight: Float[Array, " size"] = field(axes=lambda self: self.axes)
    eps: float = eqx.field(static=True)
    offset: float = eqx.field(static=True)
    axes: tuple = eqx.field(static=True)

    def __init__(
        self,
        size: int,
        eps: float = 1e-6,
        *,
        offset: float = 0.0,
        axes: tuple = (ax.EMBED,),
        dtype=jnp.float32,
    ):
        """**Arguments:**

        - `size`: the normalised dimension.
        - `eps`: added to the mean square.
        - `offset`: added to `weight` before scaling (ones are the initial scale).
        - `axes`: the semantic axis of `weight` (`(axes.EMBED,)`; a per-head norm's is
            `(axes.HEAD_DIM,)`).
        - `dtype`: parameter dtype.
        """
        self.weight = jnp.full((size,), 1.0 - offset, dtype)
        self.eps = eps
        self.offset = offset
        self.axes = axes

    def __call__(self, x: Float[Array, "*batch size"]) -> Float[Array, "*batch size"]:
        """**Arguments:**

        - `x`: inputs.

        **Returns:**

        The normalised inputs, in `x`'s dtype.
        """
        h = x.astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + self.eps)
        scale = self.weight if self.offset == 0.0 else self.weight + self.offset
        return trailing(scale.astype(x.dtype), h.ndim) * h.astype(x.dtype)


class LayerNorm(eqx.Module):
    """Layer normalisation with a learned scale and bias."""

    weight: Float[Array, " embed"] = field(axes=(ax.EMBED,))
    bias: Float[Array, " embed"] = field(axes=(ax.EMBED,))
    eps: float = eqx.field(static=True)

    def __init__(self, size: int, eps: float = 1e-5, *, dtype=jnp.float32):
        """**Arguments:**

        - `size`: the normalised dimension.
        - `eps`: added to the variance.
        - `dtype`: parameter dtype.
        """
        self.weight = jnp.ones((size,), dtype)
        self.bias = jnp.zeros((size,), dtype)
        self.eps = eps

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        """**Arguments:**

        - `x`: inputs.

        **Returns:**

        The normalised inputs, in `x`'s dtype.
        """
        h = x.astype(jnp.float32)
        mean = jnp.mean(h, axis=-1, keepdims=True)
        var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
        h = (h - mean) * jax.lax.rsqrt(var + self.eps)
        h = h * trailing(self.weight.astype(h.dtype), h.ndim) + trailing(
            self.bias.astype(h.dtype), h.ndim
        )
        return h.astype(x.dtype)
