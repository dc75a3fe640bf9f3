"""The Llama family: Llama, Mistral (sliding window) and Qwen2 (q/k/v biases).

One config and one model cover the three; `model_type` decides what config.json says and
which flags the Hugging Face config implies.
"""

import dataclasses
from collections.abc import Mapping

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import axes as ax
from ..attention import attention_mask
from ..nn import (
    Attention,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    run_layers,
    stack_layers,
)
from ._outputs import CausalLMOutput
from ._rope_config import read_rope, write_rope

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
}


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama-family model; field names follow Hugging Face.

    `num_key_value_heads` and `head_dim` default to (and are set to) `num_attention_heads`
    and `hidden_size // num_attention_heads`. `qkv_bias` (Qwen2) puts biases on the query, key
    and value projections only; `attention_bias` (Llama) on all four. `sliding_window`
    applies to the layers `layer_types` marks `"sliding_attention"` (all layers when
    `layer_types` is `None`). `scan_layers` runs the decoder with `lax.scan` (`False`
    unrolls it; the numbers are identical).
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_parameters: tuple = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"
    scan_layers: bool = True

    def __post_init__(self):
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.model_type not in _ARCHITECTURES:
            raise ValueError(
                f"LlamaConfig covers model types {sorted(_ARCHITECTURES)}, not "
                f"{self.model_type!r}."
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})."
            )
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for "
                f"{self.num_hidden_layers} layers."
            )
        if isinstance(self.rope_parameters, Mapping):
            object.__setattr__(
                self, "rope_parameters", tuple(sorted(self.rope_parameters.items()))
            )

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """The sliding window of every layer, `0` for full attention."""
        if self.sliding_window is None:
            return (0,) * self.num_hidden_layers
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    @classmethod
    def from_hf_config(cls, hf: Mapping, **overrides) -> "LlamaConfig":
        """Read a Hugging Face `config.json` dict (either rotary layout).

        **Arguments:**

        - `hf`: the parsed config.json.
        - `**overrides`: fields to set regardless (e.g. `scan_layers=False`).

        **Returns:**

        The config.
        """
        model_type = hf.get("model_type", "llama")
        theta, rope_type, rope_params = read_rope(hf)
        sliding_window = hf.get("sliding_window")
        layer_types = hf.get("layer_types")
        if model_type == "qwen2":
            if not hf.get("use_sliding_window", False):
                sliding_window, layer_types = None, None
            elif layer_types is None:
                start = hf.get("max_window_layers", 28)
                layer_types = [
                    "sliding_attention" if i >= start else "full_attention"
                    for i in range(hf["num_hidden_layers"])
                ]
        elif model_type == "llama":
            sliding_window, layer_types = None, None
        eos = hf.get("eos_token_id")
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads"),
            head_dim=hf.get("head_dim"),
            hidden_act=hf.get("hidden_act", "silu"),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            initializer_range=hf.get("initializer_range", 0.02),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=theta,
            rope_type=rope_type,
            rope_parameters=tuple(
                sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in rope_params.items())
            ),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            qkv_bias=model_type == "qwen2",
            mlp_bias=hf.get("mlp_bias", False),
            sliding_window=sliding_window,
            layer_types=None if layer_types is None else tuple(layer_types),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
            pad_token_id=hf.get("pad_token_id"),
            model_type=model_type,
        )
        fields.update(overrides)
        return cls(**fields)

    def to_hf_config(self) -> dict:
        """The Hugging Face `config.json` dict for this config."""
        hf = dict(
            architectures=[_ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=self.initializer_range,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            bos_token_id=self.bos_token_id,
            eos_token_id=list(self.eos_token_id)
            if isinstance(self.eos_token_id, tuple)
            else self.eos_token_id,
            pad_token_id=self.pad_token_id,
            **write_rope(self.rope_theta, self.rope_type, self._rope_parameters_json()),
        )
        if self.model_type == "qwen2":
            hf.update(
                use_sliding_window=self.sliding_window is not None,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types or ("full_attention",) * self.num_hidden_layers),
            )
        else:
            hf.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
            if self.model_type == "mistral":
                hf["sliding_window"] = self.sliding_window
        return hf

    def _rope_parameters_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_parameters}


class LlamaDecoderLayer(eqx.Module):
    """Pre-norm attention and gated MLP, each with a residual connection."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key.
        """
        k_attn, k_mlp = jax.random.split(key)
        c = config
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.self_attn = Attention(
            c.hidden_size,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            qkv_bias=c.attention_bias or c.qkv_bias,
            o_bias=c.attention_bias,
            dtype=dtype,
            initializer_range=c.initializer_range,
            key=k_attn,
        )
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps, dtype=dtype)
        self.mlp = GatedMLP(
            c.hidden_size,
            c.intermediate_size,
            c.hidden_act,
            use_bias=c.mlp_bias,
            dtype=dtype,
            initializer_range=c.initializer_range,
            key=k_mlp,
        )

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: Bool[Array, "batch seq seq"],
    ) -> Float[Array, "batch seq embed"]:
        """**Arguments:**

        - `h`: hidden states.
        - `cos`, `sin`: rotary tables.
        - `mask`: this layer's attention mask (its sliding window applied).

        **Returns:**

        The layer's output.
        """
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(eqx.Module):
    """Embeddings, the stacked decoder layers and the final norm."""

    embed_tokens: Embedding
    layers: LlamaDecoderLayer
    norm: RMSNorm
    rotary_emb: RotaryEmbedding
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key.
        """
        k_embed, k_layers = jax.random.split(key)
        self.embed_tokens = Embedding(
            config.vocab_size,
            config.hidden_size,
            dtype=dtype,
            initializer_range=config.initializer_range,
            key=k_embed,
        )
        self.layers = stack_layers(
            lambda k: LlamaDecoderLayer(config, dtype=dtype, key=k),
            k_layers,
            config.num_hidden_layers,
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim,
            config.rope_theta,
            rope_type=config.rope_type,
            parameters=dict(config.rope_parameters),
            max_position_embeddings=config.max_position_embeddings,
        )
        self.config = config

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        position_ids: Int[Array, "batch seq"],
        key_valid: Bool[Array, "batch seq"],
        *,
        output_hidden_states: bool = False,
    ) -> tuple[Float[Array, "batch seq embed"], tuple | None]:
        """Run the decoder over embedded tokens.

        **Arguments:**

        - `h`: the input embeddings.
        - `position_ids`: position of every token (for the rotary tables).
        - `key_valid`: `False` at padding.
        - `output_hidden_states`: also return every layer's output.

        **Returns:**

        `(hidden, all_hidden)`: the normed final hidden states, and the per-layer states
        or `None`.
        """
        batch, seq, _ = h.shape
        cos, sin = self.rotary_emb(position_ids)
        index = jnp.broadcast_to(jnp.arange(seq)[None, :], (batch, seq))
        windows = jnp.asarray(self.config.layer_windows, jnp.int32)

        def step(layer, h, window):
            out = layer(h, cos, sin, attention_mask(index, index, key_valid, window))
            return out, out if output_hidden_states else None

        inputs = h
        h, per_layer = run_layers(self.layers, step, h, windows, scan=self.config.scan_layers)
        h = self.norm(h)
        if not output_hidden_states:
            return h, None
        states = (inputs, *(per_layer[i] for i in range(per_layer.shape[0] - 1)), h)
        return h, states


class LlamaForCausalLM(eqx.Module):
    """A Llama, Mistral or Qwen2 causal language model.

    !!! example

        ```python
        config = eqdel.models.LlamaConfig(vocab_size=256, hidden_size=64,
                                          intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2)
        model = eqdel.models.LlamaForCausalLM(config, key=jax.random.key(0))
        logits = model(jnp.array([[1, 2, 3]])).logits   # [1, 3, 256]
        ```
    """

    model: LlamaModel
    lm_head: Linear | None
    config: LlamaConfig = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key for the random initialisation.
        """
        k_model, k_head = jax.random.split(key)
        self.model = LlamaModel(config, dtype=dtype, key=k_model)
        self.lm_head = (
            None
            if config.tie_word_embeddings
            else Linear(
                config.hidden_size,
                config.vocab_size,
                axes=(ax.EMBED, ax.VOCAB),
                dtype=dtype,
                initializer_range=config.initializer_range,
                key=k_head,
            )
        )
        self.config = config

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"] | None = None,
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        inputs_embeds: Float[Array, "batch seq embed"] | None = None,
        output_hidden_states: bool = False,
    ) -> CausalLMOutput:
        """**Arguments:**

        - `input_ids`: token ids (or pass `inputs_embeds`).
        - `attention_mask`: `1`/`True` for real tokens, `0`/`False` for padding.
        - `position_ids`: defaults to `0 .. seq-1` on every row, as transformers does.
        - `inputs_embeds`: embeddings used instead of looking up `input_ids`.
        - `output_hidden_states`: also return the per-layer hidden states.

        **Returns:**

        A [`eqdel.models.CausalLMOutput`][] with `logits` `[batch, seq, vocab]`.
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        h = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        batch, seq, _ = h.shape
        if position_ids is None:
            position_ids = jnp.broadcast_to(jnp.arange(seq)[None, :], (batch, seq))
        if attention_mask is None:
            key_valid = jnp.ones((batch, seq), bool)
        else:
            key_valid = attention_mask.astype(bool)
        h, states = self.model(
            h, position_ids, key_valid, output_hidden_states=output_hidden_states
        )
        logits = self.model.embed_tokens.unembed(h) if self.lm_head is None else self.lm_head(h)
        return CausalLMOutput(logits=logits, hidden_states=states)

    # -- the seed's model methods; setters return a new model -------------------------------

    def get_input_embeddings(self) -> Embedding:
        """The token embedding table."""
        return self.model.embed_tokens

    def set_input_embeddings(self, embeddings: Embedding) -> "LlamaForCausalLM":
        """A new model with `embeddings` as its input embeddings."""
        return eqx.tree_at(lambda m: m.model.embed_tokens, self, embeddings)

    def get_output_embeddings(self) -> Linear | Embedding:
        """The language-model head (the input embeddings when they are tied)."""
        return self.model.embed_tokens if self.lm_head is None else self.lm_head

    def set_output_embeddings(self, head: Linear) -> "LlamaForCausalLM":
        """A new model with `head` as its language-model head.

        **Raises:**

        `ValueError` when the head is tied to the input embeddings.
        """
        if self.lm_head is None:
            raise ValueError(
                "This model ties its head to the input embeddings "
                "(tie_word_embeddings=True); use set_input_embeddings."
            )
        return eqx.tree_at(lambda m: m.lm_head, self, head)

    def get_decoder(self) -> LlamaModel:
        """The decoder: embeddings, layers and final norm."""
        return self.model

    def set_decoder(self, decoder: LlamaModel) -> "LlamaForCausalLM":
        """A new model with `decoder` in place of its decoder."""
        return eqx.tree_at(lambda m: m.model, self, decoder)

    def __repr__(self) -> str:
        c = self.config
        params = sum(x.size for x in jax.tree.leaves(eqx.filter(self, eqx.is_array)))
        dtypes = sorted({str(x.dtype) for x in jax.tree.leaves(eqx.filter(self, eqx.is_array))})
        window = f", sliding_window={c.sliding_window}" if c.sliding_window else ""
        return (
            f"LlamaForCausalLM(model_type={c.model_type!r}, layers={c.num_hidden_layers}, "
            f"hidden={c.hidden_size}, heads={c.num_attention_heads}/{c.num_key_value_heads}x"
            f"{c.head_dim}, mlp={c.intermediate_size}, vocab={c.vocab_size}, "
            f"rope={c.rope_type}{window}, tied={c.tie_word_embeddings}, "
            f"parameters={params:,}, dtype={'/'.join(dtypes)})"
        )
