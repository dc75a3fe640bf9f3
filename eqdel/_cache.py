"""The key/value cache: one stacked pytree for all layers, placed by its semantic axes."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from . import axes as ax
from ._field import field

_KV_AXES = (ax.BATCH, ax.KV_LENGTH, ax.KV_HEAD, ax.KV_HEAD_DIM)


class KVCache(eqx.Module):
    """Keys and values of every layer for `max_length` slots, and which slots hold real
    tokens.

    Rows are aligned: all rows have written the first `length` slots (prompts are
    left-padded, and `valid` marks the padding). The leading layer dimension is placed on
    `axes.LAYERS` by [`eqdel.shard`][]; batch goes on (dp, fsdp) and kv heads on tp.

    **Fields:**

    - `keys`, `values`: `[layers, batch, max_length, kv_heads, head_dim]`.
    - `valid`: `[batch, max_length]`, `False` for padding and unwritten slots.
    - `length`: number of slots written.
    """

    keys: Float[Array, "layers batch max_length kv_heads head_dim"] = field(axes=_KV_AXES)
    values: Float[Array, "layers batch max_length kv_heads head_dim"] = field(axes=_KV_AXES)
    valid: Bool[Array, "batch max_length"] = field(axes=(ax.BATCH, ax.KV_LENGTH))
    length: Int[Array, ""]

    @classmethod
    def empty(
        cls, layers: int, batch: int, max_length: int, kv_heads: int, head_dim: int, dtype
    ) -> "KVCache":
        """A cache with nothing written."""
        shape = (layers, batch, max_length, kv_heads, head_dim)
        return cls(
            keys=jnp.zeros(shape, dtype),
            values=jnp.zeros(shape, dtype),
            valid=jnp.zeros((batch, max_length), bool),
            length=jnp.zeros((), jnp.int32),
        )

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's arrays."""
        return sum(x.size * x.dtype.itemsize for x in (self.keys, self.values, self.valid))
