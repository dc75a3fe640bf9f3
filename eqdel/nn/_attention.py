"""Grouped-query self-attention with rotary embeddings."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import axes as ax
from .._cache import KVLayer
from ..attention import ATTENTION_MECHANISMS, AttentionMask, attention
from ._linear import Linear, concatenated
from ._norm import RMSNorm
from ._rotary import apply_rotary


class Attention(eqx.Module):
    """Multi-head self-attention where `num_kv_heads` key/value heads are shared by groups
    of query heads (GQA; `num_kv_heads == num_heads` is plain multi-head attention)."""

    q_proj: Linear | None
    k_proj: Linear | None
    v_proj: Linear | None
    qkv_proj: Linear | None
    o_proj: Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    num_heads: int = eqx.field(static=True)
    num_kv_heads: int = eqx.field(static=True)
    head_dim: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    soft_cap: float | None = eqx.field(static=True)
    mechanism: str = eqx.field(static=True)
    block_q: int = eqx.field(static=True)
    block_k: int = eqx.field(static=True)
    shard_computation: bool = eqx.field(static=True)

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        scale: float | None = None,
        soft_cap: float | None = None,
        qk_norm_eps: float | None = None,
        fused_qkv: bool = False,
        mechanism: str = "auto",
        block_q: int = 128,
        block_k: int = 128,
        shard_computation: bool = True,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `hidden_size`: model width.
        - `num_heads`, `num_kv_heads`, `head_dim`: query heads, key/value heads (a divisor
            of `num_heads`) and per-head size.
        - `qkv_bias`, `o_bias`: biases on the input and output projections.
        - `scale`: score scale; `head_dim ** -0.5` by default.
        - `soft_cap`: optional logit soft-capping of the scores.
        - `qk_norm_eps`: if given, queries and keys pass through an RMSNorm over each
            head (with this epsilon) before the rotation, as in Qwen3.
        - `fused_qkv`: one `qkv_proj` whose output holds the queries, keys and values
            one after another (as Phi-3 stores them) instead of three projections.
        - `mechanism`, `block_q`, `block_k`: the attention kernel (one of
            [`eqdel.attention.ATTENTION_MECHANISMS`][]) and the chunked kernel's blocks.
        - `shard_computation`: constrain the attention's inputs and output inside
            `ShardingConfig.activate()` (see [`eqdel.attention.attention`][]).
        - `dtype`, `initializer_range`: parameter dtype and initialisation scale.
        - `key`: a `jax.random` key.
        """
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})."
            )
        if mechanism not in ATTENTION_MECHANISMS:
            raise ValueError(
                f"Unknown attention mechanism {mechanism!r}; known: {ATTENTION_MECHANISMS}."
            )
        kq, kk, kv, ko = jax.random.split(key, 4)

        def projection(n_in, n_out, axes, use_bias, key):
            return Linear(
                n_in,
                n_out,
                axes=axes,
                use_bias=use_bias,
                dtype=dtype,
                initializer_range=initializer_range,
                key=key,
            )

        heads, kv_heads = num_heads * head_dim, num_kv_heads * head_dim
        if fused_qkv:
            self.q_proj = self.k_proj = self.v_proj = None
            out = heads + 2 * kv_heads
            self.qkv_proj = projection(hidden_size, out, (ax.EMBED, ax.HEAD), qkv_bias, kq)
        else:
            self.qkv_proj = None
            self.q_proj = projection(hidden_size, heads, (ax.EMBED, ax.HEAD), qkv_bias, kq)
            self.k_proj = projection(hidden_size, kv_heads, (ax.EMBED, ax.KV_HEAD), qkv_bias, kk)
            self.v_proj = projection(hidden_size, kv_heads, (ax.EMBED, ax.KV_HEAD), qkv_bias, kv)
        self.o_proj = projection(heads, hidden_size, (ax.HEAD, ax.EMBED), o_bias, ko)
        if qk_norm_eps is None:
            self.q_norm = self.k_norm = None
        else:
            self.q_norm = RMSNorm(head_dim, qk_norm_eps, axes=(ax.HEAD_DIM,), dtype=dtype)
            self.k_norm = RMSNorm(head_dim, qk_norm_eps, axes=(ax.KV_HEAD_DIM,), dtype=dtype)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5 if scale is None else float(scale)
        self.soft_cap = soft_cap
        self.mechanism = mechanism
        self.block_q = block_q
        self.block_k = block_k
        self.shard_computation = shard_computation

    def fused(self) -> "Attention":
        """This block with its query, key and value projections made one `qkv_proj`:
        one matrix product instead of three, the same outputs. Returned unchanged when
        they are already fused or are not plain `Linear`s (quantized, LoRA)."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        if not all(type(p) is Linear for p in projections):
            return self
        return eqx.tree_at(
            lambda a: (a.q_proj, a.k_proj, a.v_proj, a.qkv_proj),
            self,
            (None, None, None, concatenated(projections)),
            is_leaf=lambda x: x is None,
        )

    def project(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
    ) -> tuple[
        Float[Array, "batch seq heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
        Float[Array, "batch seq kv_heads head_dim"],
    ]:
        """Queries, keys and values with the rotation applied to queries and keys."""
        batch, seq, _ = x.shape
        if self.qkv_proj is None:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        else:
            heads, kv_heads = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = jnp.split(self.qkv_proj(x), [heads, heads + kv_heads], axis=-1)
        q = q.reshape(batch, seq, self.num_heads, self.head_dim)
        k = k.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        v = v.reshape(batch, seq, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def attend(
        self,
        q: Float[Array, "batch q_len heads head_dim"],
        k: Float[Array, "batch kv_len kv_heads head_dim"],
        v: Float[Array, "batch kv_len kv_heads head_dim"],
        mask: AttentionMask,
    ) -> Float[Array, "batch q_len embed"]:
        """Attention over (possibly cached) keys and values, then the output projection."""
        out = attention(
            q,
            k,
            v,
            mask,
            scale=self.scale,
            soft_cap=self.soft_cap,
            mechanism=self.mechanism,
            block_q=self.block_q,
            block_k=self.block_k,
            shard_computation=self.shard_computation,
        )
        batch, q_len = out.shape[:2]
        return self.o_proj(out.reshape(batch, q_len, self.num_heads * self.head_dim))

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        kv: KVLayer | None = None,
        write_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVLayer | None]:
        """**Arguments:**

        - `x`: hidden states.
        - `cos`, `sin`: rotary tables for the tokens' positions.
        - `mask`: an [`eqdel.attention.AttentionMask`][] over the cache's slots when `kv`
            is given, else over the tokens of `x`.
        - `kv`: this layer's [`eqdel.KVLayer`][], or `None` without a cache.
        - `write_index`: the cache slot of the first token of `x`.

        **Returns:**

        `(output, kv)`: the block's output and the cache with this block's keys and
        values written (`None` without a cache).
        """
        q, k, v = self.project(x, cos, sin)
        if kv is None:
            return self.attend(q, k, v, mask), None
        kv = kv.write(k, v, write_index)
        return self.attend(q, *kv.read(q.dtype), mask), kv
