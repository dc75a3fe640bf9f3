"""Reference attention: materialises the full score matrix."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..axes import DEFAULT_MASK_VALUE
from ._masks import AttentionMask

ALIGNED_QUERY_BLOCKS = 4
"""On the CPU backend, the vanilla kernel splits the queries of an `aligned` mask (no
cache) into up to this many blocks of at least 64 queries, each against the keys up to
its last query only: 5/8 of the score matrix for four blocks. SmolLM2's attention over
4 x 256 tokens, forward and gradient: 16.0 -> 10.7 ms a layer."""

_MIN_ALIGNED_BLOCK = 64


def vanilla_attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: AttentionMask,
    *,
    scale: float,
    soft_cap: float | None = None,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Grouped-query attention without repeating keys and values: each group of
    `heads // kv_heads` query heads reads one key/value head.

    **Arguments:**

    - `query`, `key`, `value`: projected and rotated inputs.
    - `mask`: an [`eqdel.attention.AttentionMask`][]; its dense `[batch, q_len, kv_len]`
        form is built here.
    - `scale`: multiplies the scores (usually `head_dim ** -0.5`).
    - `soft_cap`: if given, scores become `soft_cap * tanh(scores / soft_cap)`.

    **Returns:**

    The attention output, in `query`'s dtype. Softmax runs in float32.

    On the CPU backend an `aligned` mask's queries run in blocks that skip the keys
    after them (see [`eqdel.attention.ALIGNED_QUERY_BLOCKS`][]).
    """
    from ..nn import _few_rows  # eqdel.nn imports this package

    if _few_rows.attention_usable(query, key, soft_cap):
        # A decode step: the CPU kernel reads the cache as stored, where XLA transposes
        # every layer's whole cache first.
        def reference(query, key, value):
            return _attention(query, key, value, mask, scale=scale, soft_cap=soft_cap)

        allowed = mask.dense()
        return _few_rows.attention(
            query, key, value, allowed, scale, DEFAULT_MASK_VALUE, reference
        )
    blocks = min(ALIGNED_QUERY_BLOCKS, query.shape[1] // _MIN_ALIGNED_BLOCK)
    if mask.aligned and blocks > 1 and jax.default_backend() == "cpu":
        return _aligned_blocks(query, key, value, mask, blocks, scale=scale, soft_cap=soft_cap)
    return _attention(query, key, value, mask, scale=scale, soft_cap=soft_cap)


def _aligned_blocks(query, key, value, mask: AttentionMask, blocks: int, *, scale, soft_cap):
    """`_attention` over `blocks` blocks of queries, each against the keys up to its last
    query: an `aligned` mask masks every later key for all of them."""
    q_len = query.shape[1]
    outs, start = [], 0
    for end in (q_len * (i + 1) // blocks for i in range(blocks)):
        part = AttentionMask(
            mask.query_index[:, start:end],
            mask.key_index[:, :end],
            mask.key_valid[:, :end],
            mask.sliding_window,
        )
        q, k, v = query[:, start:end], key[:, :end], value[:, :end]
        outs.append(_attention(q, k, v, part, scale=scale, soft_cap=soft_cap))
        start = end
    out = jnp.concatenate(outs, axis=1)
    # A query that may attend to no key (padding before the first valid token) scores
    # every key alike, so the whole kernel gives it the mean of all the values; its
    # block alone would average fewer.
    group = query.shape[2] // key.shape[2]
    mean = jnp.repeat(jnp.mean(value.astype(jnp.float32), axis=1), group, axis=1)
    attends_none = ~jnp.any(mask.dense(), axis=-1)[:, :, None, None]
    return jnp.where(attends_none, mean[:, None].astype(out.dtype), out)


def _attention(query, key, value, mask: AttentionMask, *, scale: float, soft_cap=None):
    """`vanilla_attention` in XLA's operations."""
    batch, q_len, heads, head_dim = query.shape
    kv_len, kv_heads = key.shape[1], key.shape[2]
    group = heads // kv_heads
    # Batch dimensions first and the contracted one last on both sides: the layout
    # XLA's CPU and GPU dot emitters run fastest, about twice the speed of contracting
    # in place on CPU.
    grouped = query.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    grouped = grouped.reshape(batch, kv_heads, group * q_len, head_dim)
    key = key.transpose(0, 2, 1, 3)
    value = value.transpose(0, 2, 1, 3)
    scores = _per_head_product(grouped, key, transpose_b=True) * scale
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = scores.reshape(batch, kv_heads, group, q_len, kv_len)
    scores = jnp.where(mask.dense()[:, None, None, :, :], scores, DEFAULT_MASK_VALUE)
    weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
    weights = weights.reshape(batch, kv_heads, group * q_len, kv_len)
    out = _per_head_product(weights, value, transpose_b=False).astype(query.dtype)
    out = out.reshape(batch, kv_heads, group, q_len, head_dim).transpose(0, 3, 1, 2, 4)
    return out.reshape(batch, q_len, heads, head_dim)


def _per_head_product(
    a: Float[Array, "batch kv_heads rows depth"],
    b: Float[Array, "batch kv_heads depth columns"] | Float[Array, "batch kv_heads columns depth"],
    transpose_b: bool,
) -> Float[Array, "batch kv_heads rows columns"]:
    """`a @ b` (`a @ bᵀ` when `transpose_b`) for each sequence and key/value head,
    accumulated in float32 (for 16-bit inputs, also what is fast on CPU); for float32
    inputs through OpenBLAS where eqdel's CPU kernels have it and it is not
    differentiated (prefill, evaluation)."""
    from ..nn import _few_rows  # eqdel.nn imports this package

    spec = "bkqd,bksd->bkqs" if transpose_b else "bkqs,bksd->bkqd"

    def reference(a, b):
        return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)

    if _few_rows.batched_gemm_usable(a, b):
        return _few_rows.batched_gemm(a, b, transpose_b, reference)
    return reference(a, b)
