"""Gemma and Gemma 2: the Llama decoder with what Google changed.

Gemma scales the input embeddings by `sqrt(hidden_size)`, uses `(1 + weight)` RMSNorms, a
gelu-tanh MLP and a head tied to the embeddings. Gemma 2 adds soft-capping of attention
scores and of the output logits, a query scale from `query_pre_attn_scalar`, sliding
windows on alternating layers, and norms after attention and around the MLP.
"""

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._cache import KVLayer
from ..attention import AttentionMask
from ..nn import RMSNorm
from ._llama import LlamaConfig, LlamaDecoderLayer, llama_attention, llama_mlp, llama_norm

_GEMMA_ARCHITECTURES = {"gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM"}
_SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


@dataclasses.dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """A Gemma or Gemma 2 config; the fields beyond [`eqdel.models.LlamaConfig`][] are
    Gemma 2's and keep Hugging Face's names. `layer_types` defaults to Gemma 2's
    alternation (sliding windows on even layers)."""

    hidden_act: str = "gelu_pytorch_tanh"
    tie_word_embeddings: bool = True
    model_type: str = "gemma"
    query_pre_attn_scalar: int | float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    ARCHITECTURES: ClassVar[dict[str, str]] = _GEMMA_ARCHITECTURES
    norm_offset: ClassVar[float] = 1.0

    def __post_init__(self):
        super().__post_init__()
        if not self.tie_word_embeddings:
            raise ValueError("Gemma ties its head to the input embeddings.")
        if self.model_type == "gemma2" and self.layer_types is None:
            alternating = tuple(
                "sliding_attention" if i % 2 == 0 else "full_attention"
                for i in range(self.num_hidden_layers)
            )
            object.__setattr__(self, "layer_types", alternating)

    def embedding_scale(self) -> float:
        return self.hidden_size**0.5

    def attention_scale(self) -> float | None:
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    def attention_soft_cap(self) -> float | None:
        return self.attn_logit_softcapping

    def logit_soft_cap(self) -> float | None:
        return self.final_logit_softcapping

    def decoder_layer(self, *, dtype, key: PRNGKeyArray) -> eqx.Module:
        if self.model_type == "gemma2":
            return Gemma2DecoderLayer(self, dtype=dtype, key=key)
        return LlamaDecoderLayer(self, dtype=dtype, key=key)

    @classmethod
    def from_hf_config(cls, hf: Mapping, **overrides) -> "GemmaConfig":
        """Read a Hugging Face Gemma or Gemma 2 `config.json` dict.

        **Arguments:**

        - `hf`: the parsed config.json.
        - `**overrides`: fields to set regardless.

        **Returns:**

        The config.
        """
        gemma2 = hf.get("model_type") == "gemma2"
        fields = dict(
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act", "gelu_pytorch_tanh"),
            head_dim=hf.get("head_dim", 256),
            tie_word_embeddings=True,
            sliding_window=hf.get("sliding_window") if gemma2 else None,
            layer_types=tuple(hf["layer_types"]) if gemma2 and hf.get("layer_types") else None,
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar") if gemma2 else None,
            **{name: _float_or_none(hf.get(name)) if gemma2 else None for name in _SOFT_CAPS},
        )
        base = dataclasses.asdict(LlamaConfig.from_hf_config({**hf, "model_type": "llama"}))
        return cls(**{**base, **fields, "model_type": hf["model_type"], **overrides})

    def to_hf_config(self) -> dict:
        """The Hugging Face `config.json` dict for this config."""
        hf = super().to_hf_config()
        hf.update(hidden_activation=self.hidden_act, tie_word_embeddings=True)
        if self.model_type == "gemma2":
            hf.update(
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types),
                query_pre_attn_scalar=self.query_pre_attn_scalar,
                **{name: getattr(self, name) for name in _SOFT_CAPS},
            )
        return hf


class Gemma2DecoderLayer(eqx.Module):
    """Gemma 2's layer: each of attention and MLP is normed before and after, then added
    to the residual stream."""

    input_layernorm: RMSNorm
    self_attn: eqx.Module
    post_attention_layernorm: RMSNorm
    pre_feedforward_layernorm: RMSNorm
    mlp: eqx.Module
    post_feedforward_layernorm: RMSNorm

    def __init__(self, config: GemmaConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key.
        """
        # The attention and MLP are Llama's; only the norms around them differ.
        k_attn, k_mlp = jax.random.split(key)
        self.self_attn = llama_attention(config, dtype=dtype, key=k_attn)
        self.mlp = llama_mlp(config, dtype=dtype, key=k_mlp)
        self.input_layernorm = llama_norm(config, dtype=dtype)
        self.post_attention_layernorm = llama_norm(config, dtype=dtype)
        self.pre_feedforward_layernorm = llama_norm(config, dtype=dtype)
        self.post_feedforward_layernorm = llama_norm(config, dtype=dtype)

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        kv: KVLayer | None = None,
        write_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVLayer | None, None]:
        """As [`eqdel.models.LlamaDecoderLayer`][]."""
        attended, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, write_index)
        h = h + self.post_attention_layernorm(attended)
        mlp = self.mlp(self.pre_feedforward_layernorm(h))
        return h + self.post_feedforward_layernorm(mlp), kv, None
