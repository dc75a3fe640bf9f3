"""Blockwise (flash-style) attention in pure JAX: online softmax over key blocks, and a
backward pass that recomputes each block instead of storing the score matrix."""

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from ..axes import DEFAULT_MASK_VALUE
from ._masks import AttentionMask, attention_mask


def _blocks(x, axis: int, size: int, fill):
    """Pad `axis` to a multiple of `size` and split it into `[blocks, ..., size, ...]`
    with the block dimension first."""
    length = x.shape[axis]
    count = -(-length // size)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, count * size - length)
    x = jnp.pad(x, pad, constant_values=fill)
    x = x.reshape(*x.shape[:axis], count, size, *x.shape[axis + 1 :])
    return jnp.moveaxis(x, axis, 0)


def _unblocks(x, axis: int, length: int):
    """Undo `_blocks`: move the block dimension back before `axis`, merge the two and
    drop the padding."""
    x = jnp.moveaxis(x, 0, axis)
    x = x.reshape(*x.shape[:axis], -1, *x.shape[axis + 2 :])
    return jax.lax.slice_in_dim(x, 0, length, axis=axis)


def _key_blocks(k, v, mask: AttentionMask, block_k: int):
    """Keys, values, key indices and validity in blocks; the padding keys get index -1."""
    return (
        _blocks(k, 2, block_k, 0),
        _blocks(v, 2, block_k, 0),
        _blocks(mask.key_index, 1, block_k, -1),
        _blocks(mask.key_valid, 1, block_k, False),
    )


def block_scores(q, k, qi, ki, kv, window, scale, soft_cap):
    """One block's scores `[batch, kv_heads, group, bq, bk]` (float32, soft-capped,
    masked) and the derivative of the soft cap.

    Masked keys score `DEFAULT_MASK_VALUE`, as in the vanilla kernel; keys past the end
    of the sequence (`ki < 0`) score `-inf`, so they never count."""
    raw = jnp.einsum("bkgqd,bksd->bkgqs", q, k).astype(jnp.float32) * scale
    if soft_cap is None:
        capped, slope = raw, None
    else:
        t = jnp.tanh(raw / soft_cap)
        capped, slope = soft_cap * t, 1.0 - t * t
    allowed = attention_mask(qi, ki, kv, window)[:, None, None]
    beyond = (ki < 0)[:, None, None, None, :]
    s = jnp.where(allowed, capped, DEFAULT_MASK_VALUE)
    return jnp.where(beyond, -jnp.inf, s), slope


def online_softmax_init(query):
    """The empty running statistics `(max, sum, weighted values)` for `query` blocks of
    shape `[batch, kv_heads, group, q_len, head_dim]` (built from `query`, so inside
    `shard_map` they vary along the same mesh axes)."""
    acc = jnp.zeros_like(query, jnp.float32)
    return jnp.full_like(acc[..., 0], -jnp.inf), jnp.zeros_like(acc[..., 0]), acc


def online_softmax_step(carry, scores, value):
    """Fold one key block's `scores` `[batch, kv_heads, group, q_len, block]` and
    `value` `[batch, kv_heads, block, head_dim]` into the running statistics."""
    row_max, row_sum, acc = carry
    new_max = jnp.maximum(row_max, scores.max(-1))
    p = jnp.exp(scores - new_max[..., None])
    correction = jnp.exp(row_max - new_max)
    pv = jnp.einsum("bkgqs,bksd->bkgqd", p.astype(value.dtype), value)
    return (
        new_max,
        row_sum * correction + p.sum(-1),
        acc * correction[..., None] + pv.astype(jnp.float32),
    )


def _forward(q, k, v, mask: AttentionMask, scale, soft_cap, block_q, block_k):
    """Output `[batch, kv_heads, group, q_len, head_dim]` and every row's softmax
    statistics: its maximum score and the sum of exponentials below it. (Kept apart, not
    as a log-sum-exp: for a fully masked row the maximum is `DEFAULT_MASK_VALUE`, beside
    which the log of the sum vanishes in float32.)"""
    q_len = q.shape[3]
    qb = _blocks(q, 3, block_q, 0)
    qib = _blocks(mask.query_index, 1, block_q, 0)
    key_blocks = _key_blocks(k, v, mask, block_k)

    def one_query_block(q_blk, qi_blk):
        def over_keys(carry, key_block):
            k_blk, v_blk, ki_blk, kv_blk = key_block
            scores = block_scores(
                q_blk, k_blk, qi_blk, ki_blk, kv_blk, mask.sliding_window, scale, soft_cap
            )[0]
            return online_softmax_step(carry, scores, v_blk), None

        init = online_softmax_init(q_blk)
        (row_max, row_sum, acc), _ = jax.lax.scan(over_keys, init, key_blocks)
        return acc / row_sum[..., None], row_max, row_sum

    blocked = jax.lax.map(lambda x: one_query_block(*x), (qb, qib))
    out, row_max, row_sum = (_unblocks(x, 3, q_len) for x in blocked)
    return out.astype(q.dtype), row_max, row_sum


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _flash(q, k, v, mask, scale, soft_cap, block_q, block_k):
    return _forward(q, k, v, mask, scale, soft_cap, block_q, block_k)[0]


def _flash_fwd(q, k, v, mask, scale, soft_cap, block_q, block_k):
    out, row_max, row_sum = _forward(q, k, v, mask, scale, soft_cap, block_q, block_k)
    return out, (q, k, v, mask, out, row_max, row_sum)


def _flash_bwd(scale, soft_cap, block_q, block_k, residuals, d_out):
    q, k, v, mask, out, row_max, row_sum = residuals
    q_len, kv_len = q.shape[3], k.shape[2]
    # D = rowsum(dO * O): the softmax Jacobian's correction term.
    delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
    qb, dob = _blocks(q, 3, block_q, 0), _blocks(d_out, 3, block_q, 0)
    mb, lb = _blocks(row_max, 3, block_q, 0.0), _blocks(row_sum, 3, block_q, 1.0)
    deltab = _blocks(delta, 3, block_q, 0.0)
    qib = _blocks(mask.query_index, 1, block_q, 0)
    key_blocks = _key_blocks(k, v, mask, block_k)
    window = mask.sliding_window

    def block_grads(rows, k_blk, v_blk, ki_blk, kv_blk):
        q_blk, do_blk, max_blk, sum_blk, delta_blk, qi_blk = rows
        s, slope = block_scores(q_blk, k_blk, qi_blk, ki_blk, kv_blk, window, scale, soft_cap)
        p = jnp.exp(s - max_blk[..., None]) / sum_blk[..., None]
        dp = jnp.einsum("bkgqd,bksd->bkgqs", do_blk, v_blk).astype(jnp.float32)
        ds = p * (dp - delta_blk[..., None])
        allowed = attention_mask(qi_blk, ki_blk, kv_blk, window)[:, None, None]
        ds = jnp.where(allowed, ds if slope is None else ds * slope, 0.0) * scale
        return p, ds

    rows = (qb, dob, mb, lb, deltab, qib)

    def dq_for_query_block(query_rows):
        def over_keys(dq, key_block):
            _, ds = block_grads(query_rows, *key_block)
            return dq + jnp.einsum("bkgqs,bksd->bkgqd", ds, key_block[0].astype(jnp.float32)), None

        zeros = jnp.zeros(query_rows[0].shape, jnp.float32)
        dq, _ = jax.lax.scan(over_keys, zeros, key_blocks)
        return dq

    def dkv_for_key_block(k_blk, v_blk, ki_blk, kv_blk):
        def over_queries(carry, query_rows):
            dk, dv = carry
            p, ds = block_grads(query_rows, k_blk, v_blk, ki_blk, kv_blk)
            q_blk, do_blk = query_rows[0], query_rows[1]
            dv = dv + jnp.einsum("bkgqs,bkgqd->bksd", p, do_blk.astype(jnp.float32))
            dk = dk + jnp.einsum("bkgqs,bkgqd->bksd", ds, q_blk.astype(jnp.float32))
            return (dk, dv), None

        zeros = jnp.zeros(k_blk.shape, jnp.float32)
        (dk, dv), _ = jax.lax.scan(over_queries, (zeros, zeros), rows)
        return dk, dv

    dq = jax.lax.map(dq_for_query_block, rows)
    dk, dv = jax.lax.map(lambda x: dkv_for_key_block(*x), key_blocks)
    dq = _unblocks(dq, 3, q_len)
    dk, dv = _unblocks(dk, 2, kv_len), _unblocks(dv, 2, kv_len)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None


_flash.defvjp(_flash_fwd, _flash_bwd)


def chunked_attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: AttentionMask,
    *,
    scale: float,
    soft_cap: float | None = None,
    block_q: int = 128,
    block_k: int = 128,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Flash-style attention: queries in blocks of `block_q`, each running an online
    softmax over key blocks of `block_k`, so memory grows as `q_len * block_k`, not
    `q_len * kv_len`. The backward pass (a `jax.custom_vjp`) recomputes every block's
    scores from the saved log-sum-exp rather than storing them. Lengths need not be
    multiples of the block sizes. Equals [`eqdel.attention.vanilla_attention`][],
    fully masked rows included.

    **Arguments:**

    - `query`, `key`, `value`: projected and rotated inputs; grouped-query attention
        reads each key/value head for its group of query heads, without repeating it.
    - `mask`: an [`eqdel.attention.AttentionMask`][].
    - `scale`: multiplies the scores.
    - `soft_cap`: if given, scores become `soft_cap * tanh(scores / soft_cap)`.
    - `block_q`, `block_k`: block sizes (capped at the lengths).

    **Returns:**

    The attention output, in `query`'s dtype. Softmax statistics are float32.
    """
    batch, q_len, heads, head_dim = query.shape
    kv_heads = key.shape[2]
    group = heads // kv_heads
    q = query.reshape(batch, q_len, kv_heads, group, head_dim).transpose(0, 2, 3, 1, 4)
    k, v = key.transpose(0, 2, 1, 3), value.transpose(0, 2, 1, 3)
    block_q, block_k = min(block_q, q_len), min(block_k, key.shape[1])
    out = _flash(q, k, v, mask, float(scale), soft_cap, block_q, block_k)
    return out.transpose(0, 3, 1, 2, 4).reshape(batch, q_len, heads, head_dim)
