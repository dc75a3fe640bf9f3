"""One call for every attention kernel, and the choice `"auto"` makes."""

import logging

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from .. import axes as ax
from .._placement import constrain
from .._sharding_config import active_sharding
from ._chunked import chunked_attention
from ._masks import AttentionMask
from ._ring import ring_attention, ring_mesh_size
from ._vanilla import vanilla_attention

logger = logging.getLogger("eqdel.attention")

ATTENTION_MECHANISMS = ("auto", "vanilla", "chunked", "flash", "cudnn", "splash", "ring")
"""Names `attn_mechanism` accepts; `"flash"` is another name for `"chunked"`."""

CHUNKED_FROM_LENGTH = 2048
"""`"auto"` picks the chunked kernel once the key length reaches this (below it the
vanilla kernel is as fast and its score matrix is small)."""


def _cudnn_problem(query, soft_cap) -> str | None:
    if jax.default_backend() != "gpu":
        return f"cudnn attention needs a GPU; the backend is {jax.default_backend()!r}"
    if query.dtype not in (jnp.bfloat16, jnp.float16):
        return f"cudnn attention runs in bfloat16 or float16, not {query.dtype}"
    if soft_cap is not None:
        return "cudnn attention has no logit soft-capping"
    return None


def _cudnn(query, key, value, mask: AttentionMask, scale):
    return jax.nn.dot_product_attention(
        query, key, value, mask=mask.dense()[:, None], scale=scale, implementation="cudnn"
    )


def select_mechanism(
    mechanism: str, query, key, *, soft_cap: float | None = None, axis_name: str = "sp"
) -> str:
    """The kernel `mechanism` resolves to for these inputs.

    `"auto"` picks, in order: `"ring"` when the mesh set with `jax.set_mesh` splits
    `axis_name` and the lengths divide by it (no cache); `"cudnn"` on a GPU in bfloat16 or
    float16 without soft-capping; `"chunked"` from
    [`eqdel.attention.CHUNKED_FROM_LENGTH`][] keys; otherwise `"vanilla"`. The choice is
    logged at debug level on the `eqdel.attention` logger.

    **Raises:**

    `ValueError` for an unknown name, or a kernel this backend does not have.
    """
    if mechanism not in ATTENTION_MECHANISMS:
        raise ValueError(f"Unknown attn_mechanism {mechanism!r}; known: {ATTENTION_MECHANISMS}.")
    if mechanism == "flash":
        return "chunked"
    if mechanism == "cudnn" and (problem := _cudnn_problem(query, soft_cap)):
        raise ValueError(problem + "; use attn_mechanism='chunked' or 'auto'.")
    if mechanism == "splash":
        raise ValueError(
            "splash attention (the TPU Pallas kernel) is not part of eqdel yet; use "
            "'chunked' or 'auto'."
        )
    if mechanism != "auto":
        return mechanism
    q_len, kv_len = query.shape[1], key.shape[1]
    size = ring_mesh_size(axis_name)
    if size > 1 and q_len == kv_len and q_len % size == 0:
        chosen = "ring"
    elif _cudnn_problem(query, soft_cap) is None:
        chosen = "cudnn"
    elif kv_len >= CHUNKED_FROM_LENGTH and q_len > 1:
        chosen = "chunked"
    else:
        chosen = "vanilla"
    logger.debug(
        "attn_mechanism='auto' chose %r for query %s, key %s (%s on %s)",
        chosen,
        query.shape,
        key.shape,
        query.dtype,
        jax.default_backend(),
    )
    return chosen


def attention(
    query: Float[Array, "batch q_len heads head_dim"],
    key: Float[Array, "batch kv_len kv_heads head_dim"],
    value: Float[Array, "batch kv_len kv_heads head_dim"],
    mask: AttentionMask,
    *,
    scale: float,
    soft_cap: float | None = None,
    mechanism: str = "auto",
    block_q: int = 128,
    block_k: int = 128,
    axis_name: str = "sp",
    shard_computation: bool = True,
) -> Float[Array, "batch q_len heads head_dim"]:
    """Attention with the kernel `mechanism` names (see
    [`eqdel.attention.select_mechanism`][]); every kernel takes the same arguments and
    returns the same result to float rounding.

    **Arguments:**

    - `query`, `key`, `value`: projected and rotated inputs (grouped-query attention
        when `kv_heads < heads`).
    - `mask`: an [`eqdel.attention.AttentionMask`][].
    - `scale`, `soft_cap`: score scale and optional soft-capping.
    - `mechanism`: one of [`eqdel.attention.ATTENTION_MECHANISMS`][].
    - `block_q`, `block_k`: the chunked kernel's block sizes.
    - `axis_name`: the mesh axis ring attention splits the sequence over.
    - `shard_computation`: inside `ShardingConfig.activate()`, constrain the queries,
        keys, values and output to that config's activation rules (batch on dp/fsdp,
        the sequence on sp except for a one-token decode step, heads on tp).

    **Returns:**

    The attention output, `[batch, q_len, heads, head_dim]` in `query`'s dtype.
    """
    cfg = active_sharding() if shard_computation else None
    if cfg is not None:
        query, key, value = _constrain_inputs(query, key, value, cfg)
    chosen = select_mechanism(mechanism, query, key, soft_cap=soft_cap, axis_name=axis_name)
    out = _run(chosen, query, key, value, mask, scale, soft_cap, block_q, block_k, axis_name)
    if cfg is not None:
        out = constrain(out, _QUERY_AXES, cfg, _mode(query))
    return out


_QUERY_AXES = (ax.BATCH, ax.QUERY_LENGTH, ax.HEAD, ax.HEAD_DIM)
_KEY_AXES = (ax.BATCH, ax.KV_LENGTH, ax.KV_HEAD, ax.KV_HEAD_DIM)


def _mode(query) -> str:
    """Decode rules (no sequence sharding) for a one-token step, else training rules."""
    return ax.MODE_DECODE if query.shape[1] == 1 else ax.MODE_TRAIN


def _constrain_inputs(query, key, value, cfg):
    mode = _mode(query)
    return (
        constrain(query, _QUERY_AXES, cfg, mode),
        constrain(key, _KEY_AXES, cfg, mode),
        constrain(value, _KEY_AXES, cfg, mode),
    )


def _run(chosen, query, key, value, mask, scale, soft_cap, block_q, block_k, axis_name):
    if chosen == "vanilla":
        return vanilla_attention(query, key, value, mask, scale=scale, soft_cap=soft_cap)
    if chosen == "chunked":
        return chunked_attention(
            query,
            key,
            value,
            mask,
            scale=scale,
            soft_cap=soft_cap,
            block_q=block_q,
            block_k=block_k,
        )
    if chosen == "ring":
        return ring_attention(
            query, key, value, mask, scale=scale, soft_cap=soft_cap, axis_name=axis_name
        )
    return _cudnn(query, key, value, mask, scale)
