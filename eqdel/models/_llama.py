"""The Llama family: Llama, Mistral (sliding window), Qwen2 (q/k/v biases), Qwen3
(per-head q/k norms) and Phi-3 (fused q/k/v and gate/up projections).

One config and one model cover the three; `model_type` decides what config.json says and
which flags the Hugging Face config implies.
"""

import dataclasses
from collections.abc import Mapping
from typing import ClassVar

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from .. import axes as ax
from .._cache import KVCache, KVLayer
from .._generation_config import GenerationConfig
from .._quant import Int8Embedding
from ..attention import ATTENTION_MECHANISMS, AttentionMask
from ..nn import (
    REMAT_POLICIES,
    Attention,
    Embedding,
    GatedMLP,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    stack_layers,
    unstack_layers,
)
from ..nn._rotary import freeze_parameters
from ._causal_lm import CausalLM, run_decoder_layers
from ._rope_config import read_rope, write_rope

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}
_MISTRAL_WINDOWS = ("mistral", "phi3")  # one sliding_window for every layer
_QWEN_WINDOWS = ("qwen2", "qwen3")  # windows set by use_sliding_window / max_window_layers


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and options of a Llama-family model; field names follow Hugging Face.

    `num_key_value_heads` and `head_dim` default to (and are set to) `num_attention_heads`
    and `hidden_size // num_attention_heads`. `qkv_bias` (Qwen2) puts biases on the query, key
    and value projections only; `attention_bias` (Llama, Qwen3) on all four. `qk_norm`
    (Qwen3) normalises queries and keys per head before the rotation. `fused_projections`
    (Phi-3) stores the q/k/v and the gate/up projections as one linear layer each. `sliding_window`
    applies to the layers `layer_types` marks `"sliding_attention"` (all layers when
    `layer_types` is `None`). `scan_layers` runs the decoder with `lax.scan` (`False`
    unrolls it; the numbers agree to float rounding). `quantize_kv_cache` makes
    `init_cache` store keys and values as int8 with a scale per token and head.
    `remat_policy` rematerialises each decoder layer in the backward pass (a name from
    `eqdel.nn.REMAT_POLICIES`). `attn_mechanism` names the attention kernel (one of
    `eqdel.attention.ATTENTION_MECHANISMS`; `block_q`/`block_k` are the chunked kernel's
    blocks; `shard_attention_computation` constrains the attention's inputs and output
    to the activation rules inside `ShardingConfig.activate()`). `use_scan_mlp` applies
    the MLP to `scan_mlp_chunk_size` tokens at a time, capping its activation memory with
    the same numbers. `generation_config` holds the sampling defaults the checkpoint came
    with (its `generation_config.json`), which [`eqdel.generate`][] and
    [`eqdel.save_pretrained`][] use. These last options are eqdel's own and are not
    written to `config.json`.
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
    rope_parameters: Mapping | tuple = ()
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    fused_projections: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    model_type: str = "llama"
    scan_layers: bool = True
    quantize_kv_cache: bool = False
    remat_policy: str = "none"
    attn_mechanism: str = "auto"
    block_q: int = 128
    block_k: int = 128
    shard_attention_computation: bool = True
    use_scan_mlp: bool = False
    scan_mlp_chunk_size: int = 1024
    generation_config: GenerationConfig | None = None

    ARCHITECTURES: ClassVar[dict[str, str]] = _ARCHITECTURES
    """The Hugging Face class name of every `model_type` this config covers."""

    def __post_init__(self):
        if self.attn_mechanism not in ATTENTION_MECHANISMS:
            raise ValueError(
                f"Unknown attn_mechanism {self.attn_mechanism!r}; known: {ATTENTION_MECHANISMS}."
            )
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(
                f"Unknown remat_policy {self.remat_policy!r}; known: {sorted(REMAT_POLICIES)}."
            )
        if self.num_key_value_heads is None:
            object.__setattr__(self, "num_key_value_heads", self.num_attention_heads)
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.model_type not in self.ARCHITECTURES:
            raise ValueError(
                f"{type(self).__name__} covers model types {sorted(self.ARCHITECTURES)}, "
                f"not {self.model_type!r}."
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
        object.__setattr__(self, "rope_parameters", freeze_parameters(self.rope_parameters))

    @property
    def layer_windows(self) -> tuple[int, ...]:
        """The sliding window of every layer, `0` for full attention."""
        if self.sliding_window is None:
            return (0,) * self.num_hidden_layers
        types = self.layer_types or ("sliding_attention",) * self.num_hidden_layers
        return tuple(self.sliding_window if t == "sliding_attention" else 0 for t in types)

    # Where other families differ from Llama; their configs override these.

    norm_offset: ClassVar[float] = 0.0
    """Added to every RMSNorm weight (`1.0`: Gemma's `(1 + weight)`)."""

    def embedding_scale(self) -> float | None:
        """The factor the input embeddings are multiplied by (`None`: none)."""
        return None

    def attention_scale(self) -> float | None:
        """The attention score scale (`None`: `head_dim ** -0.5`)."""
        return None

    def attention_soft_cap(self) -> float | None:
        """The soft cap of the attention scores (`None`: none)."""
        return None

    def logit_soft_cap(self) -> float | None:
        """The soft cap of the output logits (`None`: none)."""
        return None

    def decoder_layer(self, *, dtype, key: PRNGKeyArray) -> eqx.Module:
        """One decoder layer of this family."""
        return LlamaDecoderLayer(self, dtype=dtype, key=key)

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
        if model_type in _QWEN_WINDOWS:
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
            rope_parameters=rope_params,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", False),
            qkv_bias=model_type == "qwen2",
            qk_norm=model_type == "qwen3",
            fused_projections=model_type == "phi3",
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
            architectures=[self.ARCHITECTURES[self.model_type]],
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
        if self.model_type in _QWEN_WINDOWS:
            hf.update(
                use_sliding_window=self.sliding_window is not None,
                sliding_window=self.sliding_window,
                layer_types=list(self.layer_types or ("full_attention",) * self.num_hidden_layers),
            )
        if self.model_type != "qwen2":
            hf.update(attention_bias=self.attention_bias, mlp_bias=self.mlp_bias)
            if self.model_type in _MISTRAL_WINDOWS:
                hf["sliding_window"] = self.sliding_window
            original = dict(self.rope_parameters).get("original_max_position_embeddings")
            if self.model_type == "phi3" and original is not None:
                hf["original_max_position_embeddings"] = original  # Phi-3 reads it here
        return hf

    def _rope_parameters_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.rope_parameters}


def llama_norm(c: LlamaConfig, *, dtype) -> RMSNorm:
    """A decoder RMSNorm of the family of `c` (Gemma's is `(1 + weight)`)."""
    return RMSNorm(c.hidden_size, c.rms_norm_eps, offset=c.norm_offset, dtype=dtype)


def llama_attention(c: LlamaConfig, *, dtype, key: PRNGKeyArray) -> Attention:
    """The self-attention every decoder layer built from `c` uses."""
    return Attention(
        c.hidden_size,
        c.num_attention_heads,
        c.num_key_value_heads,
        c.head_dim,
        qkv_bias=c.attention_bias or c.qkv_bias,
        o_bias=c.attention_bias,
        scale=c.attention_scale(),
        soft_cap=c.attention_soft_cap(),
        qk_norm_eps=c.rms_norm_eps if c.qk_norm else None,
        fused_qkv=c.fused_projections,
        mechanism=c.attn_mechanism,
        block_q=c.block_q,
        block_k=c.block_k,
        shard_computation=c.shard_attention_computation,
        dtype=dtype,
        initializer_range=c.initializer_range,
        key=key,
    )


def llama_mlp(c: LlamaConfig, *, dtype, key: PRNGKeyArray) -> GatedMLP:
    """The dense gated MLP of a decoder layer built from `c`."""
    return GatedMLP(
        c.hidden_size,
        c.intermediate_size,
        c.hidden_act,
        use_bias=c.mlp_bias,
        fused=c.fused_projections,
        dtype=dtype,
        initializer_range=c.initializer_range,
        key=key,
    )


class LlamaDecoderLayer(eqx.Module):
    """Pre-norm attention and gated MLP, each with a residual connection."""

    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: GatedMLP
    mlp_chunk_size: int | None = eqx.field(static=True)

    def __init__(self, config: LlamaConfig, *, dtype=jnp.float32, key: PRNGKeyArray):
        """**Arguments:**

        - `config`: the model config.
        - `dtype`: parameter dtype.
        - `key`: a `jax.random` key.
        """
        k_attn, k_mlp = jax.random.split(key)
        self.input_layernorm = llama_norm(config, dtype=dtype)
        self.self_attn = llama_attention(config, dtype=dtype, key=k_attn)
        self.post_attention_layernorm = llama_norm(config, dtype=dtype)
        self.mlp = llama_mlp(config, dtype=dtype, key=k_mlp)
        c = config
        self.mlp_chunk_size = c.scan_mlp_chunk_size if c.use_scan_mlp else None

    def __call__(
        self,
        h: Float[Array, "batch seq embed"],
        cos: Float[Array, "batch seq rotary_dim"],
        sin: Float[Array, "batch seq rotary_dim"],
        mask: AttentionMask,
        kv: KVLayer | None = None,
        write_index: Int[Array, ""] | None = None,
    ) -> tuple[Float[Array, "batch seq embed"], KVLayer | None, None]:
        """**Arguments:**

        - `h`: hidden states.
        - `cos`, `sin`: rotary tables.
        - `mask`: this layer's attention mask (its sliding window applied).
        - `kv`, `write_index`: this layer's cache and where to write, as in
            [`eqdel.nn.Attention`][].

        **Returns:**

        `(output, kv, None)`: the layer's output, its cache and (as a dense layer) no
        router logits.
        """
        attended, kv = self.self_attn(self.input_layernorm(h), cos, sin, mask, kv, write_index)
        h = h + attended
        return h + self._mlp(self.post_attention_layernorm(h)), kv, None

    def _mlp(self, x: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
        """The MLP, over `mlp_chunk_size` tokens at a time when that is set."""
        seq = x.shape[1]
        if self.mlp_chunk_size is None or seq <= self.mlp_chunk_size:
            return self.mlp(x)
        chunks = -(-seq // self.mlp_chunk_size)
        padded = jnp.pad(x, ((0, 0), (0, chunks * self.mlp_chunk_size - seq), (0, 0)))
        blocks = jnp.moveaxis(padded.reshape(x.shape[0], chunks, -1, x.shape[2]), 1, 0)
        out = jax.lax.map(self.mlp, blocks)
        return jnp.moveaxis(out, 0, 1).reshape(x.shape[0], -1, x.shape[2])[:, :seq]


class LlamaModel(eqx.Module):
    """Embeddings, the stacked decoder layers and the final norm."""

    embed_tokens: Embedding | Int8Embedding
    layers: eqx.Module | tuple[eqx.Module, ...]
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
            lambda k: config.decoder_layer(dtype=dtype, key=k), k_layers, config.num_hidden_layers
        )
        self.norm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, offset=config.norm_offset, dtype=dtype
        )
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
        token_valid: Bool[Array, "batch seq"],
        cache: KVCache | None = None,
        *,
        output_hidden_states: bool = False,
    ) -> tuple[Float[Array, "batch seq embed"], tuple | None, KVCache | None, Array | None]:
        """Run the decoder over embedded tokens.

        **Arguments:**

        - `h`: the input embeddings.
        - `position_ids`: position of every token (for the rotary tables).
        - `token_valid`: `False` at padding.
        - `cache`: a [`eqdel.KVCache`][]: the tokens are written after its `length`
            slots and attend to everything valid before them.
        - `output_hidden_states`: also return every layer's output.

        **Returns:**

        `(hidden, all_hidden, cache, router_logits)`: the normed final hidden states, the
        per-layer states (or `None`), the updated cache (or `None`) and, for
        mixture-of-experts layers, their router logits `[layers, batch, seq, experts]`
        (else `None`).
        """
        if (scale := self.config.embedding_scale()) is not None:
            h = h * jnp.asarray(scale, h.dtype)
        cos, sin = self.rotary_emb(position_ids)
        h, states, cache, router_logits = run_decoder_layers(
            self.layers,
            lambda layer, h, mask, kv, write: layer(h, cos, sin, mask, kv, write),
            h,
            token_valid,
            cache,
            self.config,
            output_hidden_states=output_hidden_states,
        )
        h = self.norm(h)
        if output_hidden_states:
            states = (*states, h)
        return h, states, cache, router_logits

    def unstacked(self) -> "LlamaModel":
        """This decoder with one module per layer ([`eqdel.nn.unstack_layers`][])."""
        return eqx.tree_at(lambda d: d.layers, self, unstack_layers(self.layers))


class LlamaForCausalLM(CausalLM):
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

    def head(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """Logits from final (normed) hidden states: the LM head, or the transposed
        embeddings when they are tied."""
        logits = self.model.embed_tokens.unembed(h) if self.lm_head is None else self.lm_head(h)
        if (cap := self.config.logit_soft_cap()) is not None:
            logits = cap * jnp.tanh(logits / cap)
        return logits

    # -- the seed's model methods; setters return a new model -------------------------------

    def get_input_embeddings(self) -> Embedding | Int8Embedding:
        """The token embedding table."""
        return self.model.embed_tokens

    def set_input_embeddings(self, embeddings: Embedding | Int8Embedding) -> "LlamaForCausalLM":
        """A new model with `embeddings` as its input embeddings."""
        return eqx.tree_at(lambda m: m.model.embed_tokens, self, embeddings)

    def get_output_embeddings(self) -> Linear | Embedding | Int8Embedding:
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
