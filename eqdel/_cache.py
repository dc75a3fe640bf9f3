"""The key/value cache: one stacked pytree for all layers, placed by its semantic axes,
optionally stored as int8 with a scale per token and head."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, Int8

from . import axes as ax
from ._field import field
from ._unstack import unstack_layers

_KV_AXES = (ax.BATCH, ax.KV_LENGTH, ax.KV_HEAD, ax.KV_HEAD_DIM)
_SCALE_AXES = (ax.BATCH, ax.KV_LENGTH, ax.KV_HEAD)


def _quantize(x: Float[Array, "*rest head_dim"]) -> tuple[Int8[Array, "*rest head_dim"], Array]:
    scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1) / 127.0
    safe = jnp.where(scale == 0, 1.0, scale)
    codes = jnp.round(x.astype(jnp.float32) / safe[..., None]).astype(jnp.int8)
    return codes, scale


class KVLayer(eqx.Module):
    """One layer's keys and values (stacked over layers inside [`eqdel.KVCache`][]).

    **Fields:**

    - `keys`, `values`: `[batch, max_length, kv_heads, head_dim]` (with a leading layer
        dimension when stacked), float or int8.
    - `key_scale`, `value_scale`: `[batch, max_length, kv_heads]` float32 scales when the
        cache is int8, else `None`.
    """

    keys: Array = field(axes=_KV_AXES)
    values: Array = field(axes=_KV_AXES)
    key_scale: Float[Array, "*layers batch max_length kv_heads"] | None = field(axes=_SCALE_AXES)
    value_scale: Float[Array, "*layers batch max_length kv_heads"] | None = field(axes=_SCALE_AXES)

    @property
    def quantized(self) -> bool:
        return self.key_scale is not None

    def write(
        self,
        k: Float[Array, "batch seq kv_heads head_dim"],
        v: Float[Array, "batch seq kv_heads head_dim"],
        index: Int[Array, ""],
    ) -> "KVLayer":
        """A new layer cache with `k` and `v` written from slot `index` on."""
        start = (0, index, 0, 0)
        if not self.quantized:
            return KVLayer(
                jax.lax.dynamic_update_slice(self.keys, k.astype(self.keys.dtype), start),
                jax.lax.dynamic_update_slice(self.values, v.astype(self.values.dtype), start),
                None,
                None,
            )
        (k_codes, k_scale), (v_codes, v_scale) = _quantize(k), _quantize(v)
        return KVLayer(
            jax.lax.dynamic_update_slice(self.keys, k_codes, start),
            jax.lax.dynamic_update_slice(self.values, v_codes, start),
            jax.lax.dynamic_update_slice(self.key_scale, k_scale, start[:3]),
            jax.lax.dynamic_update_slice(self.value_scale, v_scale, start[:3]),
        )

    def read(self, dtype) -> tuple[Array, Array]:
        """All keys and values, dequantised to `dtype`."""
        if not self.quantized:
            return self.keys.astype(dtype), self.values.astype(dtype)
        keys = self.keys.astype(jnp.float32) * self.key_scale[..., None]
        values = self.values.astype(jnp.float32) * self.value_scale[..., None]
        return keys.astype(dtype), values.astype(dtype)


class KVCache(eqx.Module):
    """Keys and values of every layer for `max_length` slots, and which slots hold real
    tokens.

    Rows are aligned: all rows have written the first `length` slots (prompts are
    left-padded, and `valid` marks the padding). The leading layer dimension of `layers`
    is placed on `axes.LAYERS` by [`eqdel.shard`][]; batch goes on (dp, fsdp) and kv heads
    on tp.

    **Fields:**

    - `layers`: a [`eqdel.KVLayer`][] whose arrays have a leading layer dimension.
    - `valid`: `[batch, max_length]`, `False` for padding and unwritten slots.
    - `length`: number of slots written.
    """

    layers: KVLayer | tuple[KVLayer, ...]
    valid: Bool[Array, "batch max_length"] = field(axes=(ax.BATCH, ax.KV_LENGTH))
    length: Int[Array, ""]

    @classmethod
    def empty(
        cls,
        layers: int,
        batch: int,
        max_length: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        *,
        quantize: bool = False,
    ) -> "KVCache":
        """A cache with nothing written; `quantize` stores int8 codes with float32 scales
        per token and head."""
        shape = (layers, batch, max_length, kv_heads, head_dim)
        if quantize:
            scales = jnp.zeros(shape[:-1], jnp.float32)
            stacked = KVLayer(
                jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scales, scales
            )
        else:
            stacked = KVLayer(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), None, None)
        return cls(stacked, jnp.zeros((batch, max_length), bool), jnp.zeros((), jnp.int32))

    def unstacked(self) -> "KVCache":
        """This cache with `layers` as a tuple of one [`eqdel.KVLayer`][] per layer, the
        form a model with unstacked layers ([`eqdel.nn.unstack_layers`][]) updates in
        place."""
        if isinstance(self.layers, tuple):
            return self
        return KVCache(unstack_layers(self.layers), self.valid, self.length)

    def stacked(self) -> "KVCache":
        """This cache with `layers` as one [`eqdel.KVLayer`][] stacked over layers."""
        if not isinstance(self.layers, tuple):
            return self
        layers = jax.tree.map(lambda *xs: jnp.stack(xs), *self.layers)
        return KVCache(layers, self.valid, self.length)

    @property
    def max_length(self) -> int:
        return self.valid.shape[1]

    @property
    def nbytes(self) -> int:
        """Bytes held by the cache's arrays."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))
