"""Reference attention: materialises the full score matrix."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from ..axes import DEFAULT_MASK_VALUE


def vanilla_attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: Bool[Array, "batch q_len kv_len"],
    *,
    scale: float,
    soft_cap: float | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Grouped-query attention without repeating keys and values: each group of
    `heads // kv_heads` query heads reads one key/value head.

    **Arguments:**

    - `query`, `key`, `value`: projected and rotated inputs.
    - `mask`: `True` where a query may attend to a key.
    - `scale`: multiplies the scores (usually `head_dim ** -0.5`).
    - `soft_cap`: if given, scores become `soft_cap * tanh(scores / soft_cap)`.

    **Returns:**

    The attention output, in `query`'s dtype. Softmax runs in float32.
    """
    batch, q_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    grouped = query.reshape(batch, q_len, kv_heads, heads // kv_heads, head_dim)
    scores = jnp.einsum("btkgd,bskd->bkgts", grouped, key).astype(jnp.float32) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(mask[:, None, None, :, :], scores, DEFAULT_MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", weights, value)
    return out.reshape(batch, q_len, heads, head_dim)
