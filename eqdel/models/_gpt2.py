"""GPT-2: learned positions, LayerNorms, a fused `c_attn` and a gelu MLP, with weights
stored `[in, out]` (Hugging Face's `Conv1D`) and the head tied to the embeddings."""

import dataclasses
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import axes as ax
from .._cache import KVCache, KVLayer
from .._generation_config import GenerationConfig
from .._quant import Int8Embedding
from ..attention import ATTENTION_MECHANISMS, AttentionMask, attention
from ..nn import (
    REMAT_POLICIES,
    Embedding,
    LayerNorm,
    Linear,
    activation,
    stack_layers,
    unstack_layers,
)
from ._causal_lm import CausalLM, run_decoder_layers


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2's sizes under the names the other families use (`hidden_size` is
    Hugging Face's `n_embd`, `num_hidden_layers` its `n_layer`, ...); `intermediate_size`
    defaults to `4 * hidden_size`. `scan_layers`, `remat_policy`, `quantize_kv_cache`,
    `attn_mechanism`, `block_q`, `block_k`, `shard_attention_computation` and
    `generation_config` are as in
    [`eqdel.models.LlamaConfig`][].
    """

    vocab_size: int = 50257
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int | None = None
    max_position_embeddings: int = 1024
    layer_norm_epsilon: float = 1e-5
    hidden_act: str = "gelu_new"
    initializer_range: float = 0.02
    bos_token_id: int | None = 50256
    eos_token_id: int | tuple[int, ...] | None = 50256
    pad_token_id: int | None = None
    model_type: str = "gpt2"
    scan_layers: bool = True
    remat_policy: str = "none"
    generation_config: GenerationConfig | None = None
    quantize_kv_cache: bool = False
    attn_mechanism: str = "auto"
    block_q: int = 128
    block_k: int = 128
    shard_attention_computation: bool = True

    tie_word_embeddings = True  # GPT-2's head is always its token embeddings

    def __post_init__(self):
        if self.intermediate_size is None:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads "
                f"({self.num_attention_heads})."
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"Unknown remat_policy {self.remat_policy!r}; known: {sorted(REMAT_POLICIES)}."
            )
        if self.attn_mechanism not in ATTENTION_MECHANISMS:
            raise ValueError(
                f"Unknown attn_mechanism {self.attn_mechanism!r}; known: {ATTENTION_MECHANISMS}."
            )
        activation(self.hidden_act)

    @property
    def num_key_value_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def layer_windows(self) -> tuple[int, ...]:
        return (0,) * self.num_hidden_layers

    @classmethod
    def from_hf_config(cls, hf: Mapping, **overrides) -> "GPT2Config":
        """Read a Hugging Face GPT-2 `config.json` dict.

        **Raises:**

        `ValueError` for the attention variants eqdel does not implement
        (`scale_attn_by_inverse_layer_idx`, `reorder_and_upcast_attn`, unscaled scores).
        """
        unsupported = [
            name
            for name, default in (
                ("scale_attn_by_inverse_layer_idx", False),
                ("reorder_and_upcast_attn", False),
                ("scale_attn_weights", True),
            )
            if hf.get(name, default) != default
        ]
        if unsupported:
            raise ValueError(f"GPT-2 options eqdel does not implement: {unsupported}.")
        eos = hf.get("eos_token_id", 50256)
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["n_embd"],
            num_hidden_layers=hf["n_layer"],
            num_attention_heads=hf["n_head"],
            intermediate_size=hf.get("n_inner"),
            max_position_embeddings=hf.get("n_positions", 1024),
            layer_norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            hidden_act=hf.get("activation_function", "gelu_new"),
            initializer_range=hf.get("initializer_range", 0.02),
            bos_token_id=hf.get("bos_token_id", 50256),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
        )
        return cls(**{**fields, **overrides})

    def to_hf_config(self) -> dict:
        """The Hugging Face `config.json` dict for this config."""
        return dict(
            architectures=["GPT2LMHeadModel"],
            model_type="gpt2",
            vocab_size=self.vocab_size,
            n_embd=self.hidden_size,
            n_layer=self.num_hidden_layers,
            n_head=self.num_attention_heads,
            n_inner=self.intermediate_size,
            n_positions=self.max_position_embeddings,
            layer_norm_epsilon=self.layer_norm_epsilon,
            activation_function=self.hidden_act,
            initializer_range=self.initializer_range,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            tie_word_embeddings=True,
        )


def _conv1d(n_in, n_out, axes, config, dtype, key) -> Linear:
    """A biased linear layer stored `[in, out]` in checkpoints, as GPT-2's `Conv1D`."""
    return Linear(
        n_in,
        n_out,
        axes=axes,
        use_bias=True,
        checkpoint_transposed=False,
        dtype=dtype,
        initializer_range=config.initializer_range,
        key=key,
    )


class GPT2Attention(eqx.Module):
    """Multi-head causal self-attention with one fused `c_attn` projection."""

    c_attn: Linear
    c_proj: Linear
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:** `config`, `dtype` and `key`, as for
        [`eqdel.models.GPT2LMHeadModel`][]."""
        k_attn, k_proj = jax.random.split(key)
        h = config.hidden_size
        self.c_attn = _conv1d(h, 3 * h, (ax.EMBED, ax.HEAD), config, dtype, k_attn)
        self.c_proj = _conv1d(h, h, (ax.HEAD, ax.EMBED), config, dtype, k_proj)
        self.config = config

    def __call__(
        self,
        x: Float[Array, "batch seq embed"],
        mask: AttentionMask,
        kv: KVLayer | None = None,
        write_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVLayer | None]:
        """As [`eqdel.nn.Attention`][], without rotary embeddings."""
        c = self.config
        batch, seq, _ = x.shape
        q, k, v = (
            t.reshape(batch, seq, c.num_attention_heads, c.head_dim)
            for t in jnp.split(self.c_attn(x), 3, axis=-1)
        )
        if kv is not None:
            kv = kv.write(k, v, write_index)
            k, v = kv.read(q.dtype)
        out = attention(
            q,
            k,
            v,
            mask,
            scale=c.head_dim**-0.5,
            mechanism=c.attn_mechanism,
            block_q=c.block_q,
            block_k=c.block_k,
            shard_computation=c.shard_attention_computation,
        )
        return self.c_proj(out.reshape(batch, seq, c.hidden_size)), kv


class GPT2MLP(eqx.Module):
    """`c_proj(act(c_fc(x)))`."""

    c_fc: Linear
    c_proj: Linear
    hidden_act: str = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:** `config`, `dtype` and `key`, as for
        [`eqdel.models.GPT2LMHeadModel`][]."""
        k_fc, k_proj = jax.random.split(key)
        h, m = config.hidden_size, config.intermediate_size
        self.c_fc = _conv1d(h, m, (ax.EMBED, ax.MLP_INTERMEDIATE), config, dtype, k_fc)
        self.c_proj = _conv1d(m, h, (ax.MLP_INTERMEDIATE, ax.EMBED), config, dtype, k_proj)
        self.hidden_act = config.hidden_act

    def __call__(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch embed"]:
        return self.c_proj(activation(self.hidden_act)(self.c_fc(x)))


class GPT2Block(eqx.Module):
    """Pre-LayerNorm attention and MLP, each with a residual connection."""

    ln_1: LayerNorm
    attn: GPT2Attention
    ln_2: LayerNorm
    mlp: GPT2MLP

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:** `config`, `dtype` and `key`, as for
        [`eqdel.models.GPT2LMHeadModel`][]."""
        k_attn, k_mlp = jax.random.split(key)
        eps = config.layer_norm_epsilon
        self.ln_1 = LayerNorm(config.hidden_size, eps, dtype=dtype)
        self.attn = GPT2Attention(config, dtype=dtype, key=k_attn)
        self.ln_2 = LayerNorm(config.hidden_size, eps, dtype=dtype)
        self.mlp = GPT2MLP(config, dtype=dtype, key=k_mlp)

    def __call__(self, h, mask: AttentionMask, kv=None, write_index=None):
        """`(output, kv, None)` for hidden states `h` `[batch, seq, embed]`."""
        attended, kv = self.attn(self.ln_1(h), mask, kv, write_index)
        h = h + attended
        return h + self.mlp(self.ln_2(h)), kv, None


class GPT2Model(eqx.Module):
    """Token and position embeddings, the stacked blocks and the final LayerNorm."""

    wte: Embedding | Int8Embedding
    wpe: Embedding
    h: GPT2Block | tuple[GPT2Block, ...]
    ln_f: LayerNorm
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:** `config`, `dtype` and `key`, as for
        [`eqdel.models.GPT2LMHeadModel`][]."""
        k_wte, k_wpe, k_h = jax.random.split(key, 3)
        c = config
        init = dict(dtype=dtype, initializer_range=c.initializer_range)
        self.wte = Embedding(c.vocab_size, c.hidden_size, key=k_wte, **init)
        self.wpe = Embedding(c.max_position_embeddings, c.hidden_size, key=k_wpe, **init)
        self.h = stack_layers(lambda k: GPT2Block(c, dtype=dtype, key=k), k_h, c.num_hidden_layers)
        self.ln_f = LayerNorm(c.hidden_size, c.layer_norm_epsilon, dtype=dtype)
        self.config = config

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        position_ids: Int[Array, "batch seq"],
        token_valid: Bool[Array, "batch seq"],
        cache: KVCache | None = None,
        *,
        output_hidden_states: bool = False,
    ):
        """As [`eqdel.models.LlamaModel`][]; the position embeddings are added here."""
        h = h + self.wpe(position_ids).astype(h.dtype)
        h, states, cache, _ = run_decoder_layers(
            self.h,
            lambda block, h, mask, kv, write: block(h, mask, kv, write),
            h,
            token_valid,
            cache,
            self.config,
            output_hidden_states=output_hidden_states,
        )
        h = self.ln_f(h)
        return h, None if states is None else (*states, h), cache, None

    def unstacked(self) -> "GPT2Model":
        """This decoder with one module per layer ([`eqdel.nn.unstack_layers`][])."""
        return eqx.tree_at(lambda d: d.h, self, unstack_layers(self.h))


class GPT2LMHeadModel(CausalLM):
    """GPT-2 with its head tied to the token embeddings."""

    transformer: GPT2Model
    config: GPT2Config = eqx.field(static=True)

    def __init__(self, config: GPT2Config, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key for the random initialisation.
        """
        self.transformer = GPT2Model(config, dtype=dtype, key=key)
        self.config = config

    def get_input_embeddings(self) -> Embedding | Int8Embedding:
        return self.transformer.wte

    def set_input_embeddings(self, embeddings: Embedding | Int8Embedding) -> "GPT2LMHeadModel":
        """A new model with `embeddings` as its token embeddings (and so its head)."""
        return eqx.tree_at(lambda m: m.transformer.wte, self, embeddings)

    def get_output_embeddings(self) -> Embedding | Int8Embedding:
        """The head: the token embeddings, to which it is tied."""
        return self.transformer.wte

    def set_output_embeddings(self, head) -> "GPT2LMHeadModel":
        """**Raises:**

        `ValueError`: GPT-2's head is its token embeddings; use `set_input_embeddings`.
        """
        raise ValueError("GPT-2 ties its head to the token embeddings; use set_input_embeddings.")

    def get_decoder(self) -> GPT2Model:
        return self.transformer

    def set_decoder(self, decoder: GPT2Model) -> "GPT2LMHeadModel":
        """A new model with `decoder` in place of its decoder."""
        return eqx.tree_at(lambda m: m.transformer, self, decoder)

    def head(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        return self.transformer.wte.unembed(h)
