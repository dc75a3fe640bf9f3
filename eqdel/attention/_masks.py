"""Boolean attention masks from token indices, padding and sliding windows."""

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
