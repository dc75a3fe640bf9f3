"""Attention masks from token indices, padding and sliding windows."""

import equinox as eqx
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def attention_mask(
    query_index: Int[Array, "batch q_len"],
    key_index: Int[Array, "batch kv_len"],
    key_valid: Bool[Array, "batch kv_len"],
    sliding_window: Int[Array, ""] | int | None = None,
) -> Bool[Array, "batch q_len kv_len"]:
    """Which keys each query may attend to: causal by index, valid keys only, and (if a
    window is given and positive) only the last `sliding_window` keys.

    The indices are places in the key/value sequence (a cache slot, not a position id),
    so a query block at a cache offset is aligned correctly.

    **Arguments:**

    - `query_index`: the index of every query in the key/value sequence.
    - `key_index`: the index of every key.
    - `key_valid`: `False` for padding and unwritten cache slots.
    - `sliding_window`: window size; `None` or `0` for none. May be traced (it varies per
        layer inside a scan).

    **Returns:**

    `True` where attention is allowed.
    """
    distance = query_index[:, :, None] - key_index[:, None, :]
    allowed = (distance >= 0) & key_valid[:, None, :]
    if sliding_window is None:
        return allowed
    window = jnp.asarray(sliding_window)
    return allowed & ((window <= 0) | (distance < window))


class AttentionMask(eqx.Module):
    """What [`eqdel.attention.attention_mask`][] is made of, kept small: every kernel
    builds the blocks of the mask it needs from it, so no kernel but the vanilla one
    holds a `[q_len, kv_len]` mask.

    **Fields:**

    - `query_index`: `[batch, q_len]` index of every query in the key/value sequence.
    - `key_index`: `[batch, kv_len]` index of every key.
    - `key_valid`: `[batch, kv_len]`, `False` for padding and unwritten cache slots.
    - `sliding_window`: scalar window size (`0`: none).
    - `aligned`: whether the keys are the queries themselves, in order (no cache: query
        `i` is key `i`), so that no query attends to a key after its own. Kernels may
        then skip the blocks of keys that follow a block of queries.
    """

    query_index: Int[Array, "batch q_len"]
    key_index: Int[Array, "batch kv_len"]
    key_valid: Bool[Array, "batch kv_len"]
    sliding_window: Int[Array, ""]
    aligned: bool = eqx.field(static=True)

    def __init__(self, query_index, key_index, key_valid, sliding_window=0, *, aligned=False):
        self.query_index = jnp.asarray(query_index, jnp.int32)
        self.key_index = jnp.asarray(key_index, jnp.int32)
        self.key_valid = jnp.asarray(key_valid, bool)
        self.sliding_window = jnp.asarray(0 if sliding_window is None else sliding_window)
        self.aligned = aligned

    def dense(self) -> Bool[Array, "batch q_len kv_len"]:
        """The whole mask, `True` where attention is allowed."""
        return attention_mask(
            self.query_index, self.key_index, self.key_valid, self.sliding_window
        )
