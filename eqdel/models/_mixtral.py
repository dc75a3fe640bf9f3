"""Mixtral: the Mistral decoder with its MLP replaced by a sparse mixture of experts."""

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .._cache import KVLayer
from ..attention import AttentionMask
from ..nn import RMSNorm, SparseMoE
from ._llama import LlamaConfig, llama_attention, llama_norm


@dataclasses.dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    """A Mixtral config: [`eqdel.models.LlamaConfig`][] plus the experts.
    `router_aux_loss_coef` is the weight Hugging Face gives
    [`eqdel.models.load_balancing_loss`][] in training."""

    model_type: str = "mixtral"
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001

    ARCHITECTURES: ClassVar[dict[str, str]] = {"mixtral": "MixtralForCausalLM"}

    def decoder_layer(self, *, dtype, key: PRNGKeyArray) -> eqx.Module:
        return MixtralDecoderLayer(self, dtype=dtype, key=key)

    @classmethod
    def from_hf_config(cls, hf: Mapping, **overrides) -> "MixtralConfig":
        """Read a Hugging Face Mixtral `config.json` dict.

        **Arguments:**

        - `hf`: the parsed config.json.
        - `**overrides`: fields to set regardless.

        **Returns:**

        The config.
        """
        base = dataclasses.asdict(LlamaConfig.from_hf_config({**hf, "model_type": "mistral"}))
        experts = dict(
            num_local_experts=hf.get("num_local_experts", 8),
            num_experts_per_tok=hf.get("num_experts_per_tok", 2),
            router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
        )
        return cls(**{**base, **experts, "model_type": "mixtral", **overrides})

    def to_hf_config(self) -> dict:
        """The Hugging Face `config.json` dict for this config."""
        hf = super().to_hf_config()
        hf.update(
            sliding_window=self.sliding_window,
            num_local_experts=self.num_local_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            router_aux_loss_coef=self.router_aux_loss_coef,
        )
        return hf


class MixtralDecoderLayer(eqx.Module):
    """Pre-norm attention, then a pre-norm sparse mixture of experts."""

    input_layernorm: RMSNorm
    self_attn: eqx.Module
    post_attention_layernorm: RMSNorm
    block_sparse_moe: SparseMoE

    def __init__(self, config: MixtralConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key.
        """
        k_attn, k_moe = jax.random.split(key)
        self.input_layernorm = llama_norm(config, dtype=dtype)
        self.self_attn = llama_attention(config, dtype=dtype, key=k_attn)
        self.post_attention_layernorm = llama_norm(config, dtype=dtype)
        self.block_sparse_moe = SparseMoE(
            config.hidden_size,
            config.intermediate_size,
            config.num_local_experts,
            config.num_experts_per_tok,
            config.hidden_act,
            dtype=dtype,
            initializer_range=config.initializer_range,
            key=k_moe,
        )

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        kv: KVLayer | None = None,
        write_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVLayer | None, Float[Array, "batch seq experts"]]:
        """As [`eqdel.models.LlamaDecoderLayer`][], returning the router logits too."""
        attended, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, write_index)
        h = h + attended
        out, router_logits = self.block_sparse_moe(self.post_attention_layernorm(h))
        return h + out, kv, router_logits


def load_balancing_loss(
    router_logits: Float[Array, "layers batch seq experts"],
    top_k: int,
    attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
) -> Float[Array, ""]:
    """The Switch Transformer auxiliary loss that keeps the experts evenly used: the
    number of experts times the sum over experts of (share of routed choices) times (mean
    router probability), over every layer's non-padding tokens, as transformers
    computes it. Add `config.router_aux_loss_coef` times it to the training loss.

    **Arguments:**

    - `router_logits`: `CausalLMOutput.router_logits`.
    - `top_k`: experts chosen per token.
    - `attention_mask`: `0` at padding (excluded); all tokens by default.

    **Returns:**

    The scalar loss.
    """
    layers, batch, seq, experts = router_logits.shape
    probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
    _, chosen = jax.lax.top_k(probs, top_k)
    weight = jnp.ones((batch, seq), jnp.float32)
    if attention_mask is not None:
        weight = attention_mask.astype(jnp.float32)
    weight = jnp.broadcast_to(weight, (layers, batch, seq))
    picked = jax.nn.one_hot(chosen, experts, dtype=jnp.float32).sum(axis=-2)
    rows = layers * jnp.sum(weight[0])
    tokens_per_expert = jnp.einsum("lbse,lbs->e", picked, weight) / rows
    prob_per_expert = jnp.einsum("lbse,lbs->e", probs, weight) / rows
    return experts * jnp.sum(tokens_per_expert * prob_per_expert)
