"""What every eqdel causal language model shares: the call, and the generation protocol
[`eqdel.generate`][] drives."""

import abc
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .. import axes as ax
from .._cache import KVCache
from .._host_memory import collapse_into_huge_pages
from .._placement import constrain
from ..attention import AttentionMask
from ..nn import activation_dtype, fuse_projections, run_layers
from ._outputs import CausalLMOutput

_HIDDEN_AXES = (ax.BATCH, ax.LENGTH, ax.EMBED)


def _settle(h: Float[Array, "batch seq embed"]) -> Float[Array, "batch seq embed"]:
    """Inside `ShardingConfig.activate()`, constrain hidden states to the activation
    rules (the sequence unsharded for a one-token step). Without it, parameters sharded
    on `embed` over the mesh axes that carry the batch or the sequence leave the
    partitioner to reconcile the two in every layer, replicating whole activations
    where it cannot."""
    return constrain(h, _HIDDEN_AXES, mode=1)


def run_decoder_layers(
    layers: eqx.Module | tuple[eqx.Module, ...],
    call: Callable,
    h: Float[Array, "batch seq embed"],
    token_valid: Bool[Array, "batch seq"],
    cache: KVCache | None,
    config,
    *,
    output_hidden_states: bool = False,
):
    """Run stacked decoder layers over embedded tokens, with or without a cache: the
    part of every decoder that is not the family's own.

    **Arguments:**

    - `layers`: the stacked layers, or a tuple of one module per layer.
    - `call`: `call(layer, h, mask, kv, write_index) -> (h, kv, router_logits)`.
    - `h`: the embedded tokens.
    - `token_valid`: `False` at padding.
    - `cache`: a [`eqdel.KVCache`][]; the tokens are written after its `length` slots
        and attend to everything valid before them.
    - `config`: the model config (`layer_windows`, `scan_layers`, `remat_policy`).
    - `output_hidden_states`: also return the input and every layer's output but the last.

    **Returns:**

    `(hidden, states, cache, router_logits)`: the last layer's output (before any final
    norm), the states (or `None`), the updated cache (or `None`) and the stacked router
    logits (or `None`).
    """
    batch, seq, _ = h.shape
    h = _settle(h)
    offsets = jnp.broadcast_to(jnp.arange(seq)[None, :], (batch, seq))
    if cache is None:
        query_index, key_index, key_valid, kv, write = offsets, offsets, token_valid, None, None
    else:
        write = cache.length
        query_index = write + offsets
        key_index = jnp.broadcast_to(jnp.arange(cache.max_length)[None, :], cache.valid.shape)
        key_valid = jax.lax.dynamic_update_slice(cache.valid, token_valid, (0, write))
        kv = cache.layers
    windows = jnp.asarray(config.layer_windows, jnp.int32)
    unstacked = isinstance(layers, tuple)
    cache_unstacked = cache is not None and isinstance(cache.layers, tuple)
    if unstacked:
        if not cache_unstacked and kv is not None:
            kv = cache.unstacked().layers
        xs = tuple(zip(windows, kv or (None,) * len(layers), strict=True))
    else:
        xs = (windows, cache.stacked().layers if cache_unstacked else kv)

    def step(layer, h, inputs):
        window, layer_kv = inputs
        mask = AttentionMask(query_index, key_index, key_valid, window, aligned=cache is None)
        out, layer_kv, router_logits = call(layer, h, mask, layer_kv, write)
        out = _settle(out)
        return out, (out if output_hidden_states else None, layer_kv, router_logits)

    inputs = h
    h, ys = run_layers(layers, step, h, xs, scan=config.scan_layers, remat=config.remat_policy)
    if unstacked:
        per_layer, kv, router_logits = (tuple(y) for y in zip(*ys, strict=True))
        router_logits = None if router_logits[0] is None else jnp.stack(router_logits)
    else:
        per_layer, kv, router_logits = ys
    if cache is not None:
        cache = KVCache(kv, key_valid, write + seq)
        cache = cache.unstacked() if cache_unstacked else cache.stacked()
    states = None
    if output_hidden_states:
        states = (inputs, *(per_layer[i] for i in range(len(per_layer) - 1)))
    return h, states, cache, router_logits


class CausalLM(eqx.Module):
    """A decoder-only language model. A family provides its fields, a `config` (with
    `num_hidden_layers`, `num_key_value_heads`, `head_dim` and `quantize_kv_cache`) and
    the three methods below; the call and the generation methods come from here.

    The decoder is called `decoder(embeddings, position_ids, token_valid, cache)` and
    returns `(hidden, all_hidden, cache, router_logits)`, as
    [`eqdel.models.LlamaModel`][] does.
    """

    @abc.abstractmethod
    def get_input_embeddings(self):
        """The token embedding table."""

    @abc.abstractmethod
    def get_decoder(self):
        """The decoder: embeddings (and positions), layers and final norm."""

    @abc.abstractmethod
    def head(self, h: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """Logits from final (normed) hidden states."""

    def __call__(
        self,
        input_ids: Int[Array, "batch seq"] | None = None,
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
        position_ids: Int[Array, "batch seq"] | None = None,
        inputs_embeds: Float[Array, "batch seq embed"] | None = None,
        cache: KVCache | None = None,
        output_hidden_states: bool = False,
        logits_to_keep: int = 0,
    ) -> CausalLMOutput:
        """**Arguments:**

        - `input_ids`: token ids (or pass `inputs_embeds`).
        - `attention_mask`: `1`/`True` for real tokens, `0`/`False` for padding.
        - `position_ids`: defaults to `0 .. seq-1` on every row (after the cache's
            `length` slots when a cache is given), as transformers does.
        - `inputs_embeds`: embeddings used instead of looking up `input_ids`.
        - `cache`: a [`eqdel.KVCache`][] from [`eqdel.models.CausalLM.init_cache`][]
            or a previous call; `attention_mask` then covers the new tokens only.
        - `output_hidden_states`: also return the per-layer hidden states.
        - `logits_to_keep`: make logits for the last `logits_to_keep` positions only
            (`0`: every position), as in transformers; generation's prefill keeps one.

        **Returns:**

        A [`eqdel.models.CausalLMOutput`][] with `logits` `[batch, seq, vocab]`
        (`[batch, logits_to_keep, vocab]` when that is set).
        """
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids and inputs_embeds.")
        h = self.get_input_embeddings()(input_ids) if inputs_embeds is None else inputs_embeds
        h = h.astype(activation_dtype(h.dtype))
        batch, seq, _ = h.shape
        if position_ids is None:
            start = 0 if cache is None else cache.length
            position_ids = jnp.broadcast_to(start + jnp.arange(seq)[None, :], (batch, seq))
        if attention_mask is None:
            token_valid = jnp.ones((batch, seq), bool)
        else:
            token_valid = attention_mask.astype(bool)
        h, states, cache, router_logits = self.get_decoder()(
            h, position_ids, token_valid, cache, output_hidden_states=output_hidden_states
        )
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        return CausalLMOutput(
            logits=self.head(h), hidden_states=states, cache=cache, router_logits=router_logits
        )

    def unstacked(self) -> "CausalLM":
        """This model with its decoder layers split into one module each, run one after
        another rather than by `lax.scan`: the form the decode loop of
        [`eqdel.generate`][] uses, where each step then reads every layer's weights in
        place (slicing stacked weights inside the loop copies them on every step). The
        results equal the stacked model's."""
        return eqx.tree_at(lambda m: m.get_decoder(), self, self.get_decoder().unstacked())

    def for_generation(self) -> "CausalLM":
        """This model in the form the decode loop of [`eqdel.generate`][] runs on the
        CPU backend: one module per layer (`unstacked`), and the projections that read
        one input made one product ([`eqdel.nn.fuse_projections`][]). Its outputs equal
        this model's.

        On the CPU backend, slicing a layer out of stacked weights inside a loop copies
        it on every pass, so `generate` builds this form from a stacked model on each
        call: a copy of the decoder's weights, written to fresh memory. Build it once
        and pass it to `generate` or `stream_generate` to skip that copy (and the page
        faults of fresh memory). Train and save the original: this form's parameters
        are not laid out as the checkpoint's.

        On Linux, the weights of the form built here (not in a traced call) are moved
        onto transparent huge pages, which a decode step streams about 6% faster
        (`eqdel._host_memory.collapse_into_huge_pages`; 0.05-0.4 s once for
        SmolLM2-135M)."""
        model = fuse_projections(self.unstacked())
        collapse_into_huge_pages(model)
        return model

    # -- generation -------------------------------------------------------------------------

    def init_cache(
        self, batch_size: int, max_length: int, dtype=None, *, quantize: bool | None = None
    ) -> KVCache:
        """An empty [`eqdel.KVCache`][] for `batch_size` rows of up to `max_length` tokens.

        **Arguments:**

        - `batch_size`, `max_length`: the cache's size.
        - `dtype`: the cache dtype; by default that of the model's activations
            ([`eqdel.nn.activation_dtype`][]): the parameters' dtype, but float32 for a
            16-bit model on CPU, whose attention computes in float32 (there a 16-bit
            cache decoded no faster and rounded the keys and values).
        - `quantize`: int8 storage; `config.quantize_kv_cache` by default.
        """
        c = self.config
        if dtype is None:
            dtype = activation_dtype(self.get_input_embeddings().dtype)
        return KVCache.empty(
            c.num_hidden_layers,
            batch_size,
            max_length,
            c.num_key_value_heads,
            c.head_dim,
            dtype,
            quantize=c.quantize_kv_cache if quantize is None else quantize,
        )

    def prepare_inputs_for_generation(
        self,
        input_ids: Int[Array, "batch seq"],
        max_length: int,
        attention_mask: Int[Array, "batch seq"] | Bool[Array, "batch seq"] | None = None,
    ) -> dict:
        """Keyword arguments for the prefill call on a (left-padded) prompt.

        **Arguments:**

        - `input_ids`: the prompt.
        - `max_length`: prompt plus new tokens; the size of the fresh cache.
        - `attention_mask`: `0` at padding; all ones by default.

        **Returns:**

        `dict(attention_mask=..., position_ids=..., cache=...)`: position ids count real
        tokens only (the mask's cumulative sum), so left padding does not shift them.
        """
        batch, seq = input_ids.shape
        if attention_mask is None:
            attention_mask = jnp.ones((batch, seq), jnp.int32)
        mask = attention_mask.astype(jnp.int32)
        position_ids = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0)
        return dict(
            attention_mask=mask,
            position_ids=position_ids,
            cache=self.init_cache(batch, max_length),
        )

    def update_inputs_for_generation(self, model_outputs: CausalLMOutput, model_kwargs: dict):
        """Keyword arguments for the next one-token decode call.

        **Arguments:**

        - `model_outputs`: the previous call's output (its cache is carried on).
        - `model_kwargs`: the previous call's keyword arguments.

        **Returns:**

        A new dict: the updated cache, the next position of every row, a mask of ones.
        """
        positions = model_kwargs["position_ids"][:, -1:] + 1
        return dict(
            attention_mask=jnp.ones_like(positions),
            position_ids=positions,
            cache=model_outputs.cache,
        )
