"""Compiled generation: one prefill, then a `lax.while_loop` of one-token decode steps."""

import dataclasses
from collections.abc import Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Int, PRNGKeyArray

from ._generation_config import GenerationConfig
from ._placement import on_one_device
from ._sampling import next_tokens


class DecodeState(eqx.Module):
    """Everything the decode loop carries from one token to the next."""

    tokens: Int[Array, "batch total"]
    length: Int[Array, ""]
    finished: Bool[Array, " batch"]
    key: PRNGKeyArray
    model_kwargs: dict


def _seen(tokens, valid, vocab: int):
    """Which vocabulary entries occur at the valid (fed, non-padding) places of `tokens`."""
    batch = tokens.shape[0]
    return jnp.zeros((batch, vocab), bool).at[jnp.arange(batch)[:, None], tokens].max(valid)


def _choose(logits, tokens, valid, finished, config: GenerationConfig, key, pad):
    logits = eqx.error_if(
        logits,
        ~jnp.all(jnp.isfinite(logits)),
        "generate: the model's logits hold NaN or inf; its weights or activations "
        "overflow (a float16 model, a diverged fine-tune?).",
    )
    seen = None
    if config.repetition_penalty != 1.0:
        seen = _seen(tokens, valid, logits.shape[-1])
    chosen = next_tokens(logits, seen, config, key)
    chosen = jnp.where(finished, pad, chosen)
    eos = jnp.asarray(config.eos_token_id or (-1,), jnp.int32)
    return chosen, finished | jnp.isin(chosen, eos)


def _pad_id(config: GenerationConfig) -> int:
    if config.pad_token_id is not None:
        return config.pad_token_id
    return config.eos_token_id[0] if config.eos_token_id else 0


def prefill(
    model, input_ids, attention_mask, config: GenerationConfig, key, logits_to_keep: int = 0
) -> DecodeState:
    """Run the prompt through the model and choose the first new token; with
    `logits_to_keep=1` the head runs on the last position alone (see `_prefill_logits`)."""
    batch, prompt = input_ids.shape
    total = prompt + config.max_new_tokens
    kwargs = model.prepare_inputs_for_generation(input_ids, total, attention_mask)
    out = model(input_ids, **kwargs, logits_to_keep=logits_to_keep)
    pad = _pad_id(config)
    tokens = jnp.full((batch, total), pad, jnp.int32).at[:, :prompt].set(input_ids)
    key, sub = jax.random.split(key)
    length = jnp.asarray(prompt, jnp.int32)
    chosen, finished = _choose(
        out.logits[:, -1], tokens, out.cache.valid, jnp.zeros((batch,), bool), config, sub, pad
    )
    tokens = tokens.at[:, prompt].set(chosen)
    kwargs = model.update_inputs_for_generation(out, kwargs)
    return DecodeState(tokens, length + 1, finished, key, kwargs)


def decode_step(model, state: DecodeState, config: GenerationConfig) -> DecodeState:
    """Feed the last chosen token and choose the next one."""
    last = jax.lax.dynamic_slice_in_dim(state.tokens, state.length - 1, 1, axis=1)
    out = model(last, **state.model_kwargs)
    key, sub = jax.random.split(state.key)
    chosen, finished = _choose(
        out.logits[:, -1],
        state.tokens,
        out.cache.valid,
        state.finished,
        config,
        sub,
        _pad_id(config),
    )
    tokens = jax.lax.dynamic_update_slice_in_dim(state.tokens, chosen[:, None], state.length, 1)
    kwargs = model.update_inputs_for_generation(out, state.model_kwargs)
    return DecodeState(tokens, state.length + 1, finished, key, kwargs)


def _prefill_logits(model) -> int:
    """The prefill's `logits_to_keep`: the last position's alone, unless the model spans
    several devices (or is traced, which hides where it lies). The head on every
    position holds `prompt x vocab` float32 logits a row and costs time (SmolLM2 in
    bfloat16, 8 prompts of 16 tokens: prefill and first step 117 -> 100 ms). On a mesh,
    XLA's CPU runtime deadlocked in an all-reduce of the program that keeps one position
    (SmolLM2 on `fsdp=2, tp=2, sp=2`, 8 devices on 2 cores), so it keeps them all."""
    return 1 if on_one_device(model) else 0


@eqx.filter_jit
def _generate(model, input_ids, attention_mask, key, config: GenerationConfig, logits_to_keep):
    state = prefill(model, input_ids, attention_mask, config, key, logits_to_keep)
    total = input_ids.shape[1] + config.max_new_tokens
    if jax.default_backend() == "cpu":
        model, state = _generation_form(model, state)

    def running(state):
        return (state.length < total) & ~jnp.all(state.finished)

    state = jax.lax.while_loop(running, lambda s: decode_step(model, s, config), state)
    return state.tokens


def _generation_form(model, state: DecodeState):
    """The model and cache with one array per layer for the decode steps (see
    `CausalLM.for_generation`); no copy when the model is in that form already."""
    kwargs = dict(state.model_kwargs, cache=state.model_kwargs["cache"].unstacked())
    return model.for_generation(), dataclasses.replace(state, model_kwargs=kwargs)


def _check_prompt(model, input_ids, attention_mask) -> None:
    """Refuse prompts the model cannot continue, naming what is wrong."""
    if input_ids.ndim != 2 or input_ids.shape[1] == 0:
        raise ValueError(
            f"input_ids must be [batch, prompt] with at least one token, not {input_ids.shape}."
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask {attention_mask.shape} must have the shape of input_ids "
            f"{input_ids.shape}."
        )
    if isinstance(input_ids, jax.core.Tracer):
        return
    vocab = model.config.vocab_size
    ids = np.asarray(input_ids)
    if ids.min() < 0 or ids.max() >= vocab:
        bad = ids[(ids < 0) | (ids >= vocab)][0]
        raise ValueError(f"input_ids holds token {bad}, outside the vocabulary [0, {vocab}).")
    if attention_mask is not None and not isinstance(attention_mask, jax.core.Tracer):
        empty = np.flatnonzero(~np.asarray(attention_mask).astype(bool).any(axis=1))
        if empty.size:
            raise ValueError(f"prompt row {empty[0]} is all padding (attention_mask is 0).")


def _config(model, generation_config, overrides) -> GenerationConfig:
    base = generation_config or GenerationConfig.from_model_config(model.config)
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if v is not None})


def generate(
    model,
    input_ids: Int[Array, "batch prompt"],
    attention_mask: Int[Array, "batch prompt"] | Bool[Array, "batch prompt"] | None = None,
    *,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    eos_token_id: int | list[int] | tuple[int, ...] | None = None,
    pad_token_id: int | None = None,
    generation_config: GenerationConfig | None = None,
    key: PRNGKeyArray | None = None,
) -> Int[Array, "batch total"]:
    """Generate tokens after (left-padded) prompts in one compiled loop.

    The prompt is run once to fill the cache, then a `lax.while_loop` decodes one token
    per step with no Python in between, stopping early once every row has emitted an end
    token. Rows that have finished emit `pad_token_id`.

    **Arguments:**

    - `model`: a causal LM from `eqdel.models`.
    - `input_ids`: prompts, left-padded to one length.
    - `attention_mask`: `0` at padding.
    - `max_new_tokens`, `do_sample`, `temperature`, `top_k`, `top_p`, `min_p`,
        `repetition_penalty`, `eos_token_id`, `pad_token_id`: as in
        [`eqdel.GenerationConfig`][]; each overrides `generation_config`.
    - `generation_config`: defaults for the above (end and pad tokens from the model
        config when not given).
    - `key`: randomness for sampling (`jax.random.key(0)` if not given).

    **Returns:**

    `[batch, prompt + max_new_tokens]` token ids: the prompts, then the new tokens (pad
    after a row's end token).

    **Raises:**

    `ValueError` for an empty prompt, a token outside the vocabulary, a row that is all
    padding or an `attention_mask` of another shape; an error naming the cause when the
    logits turn NaN or inf.
    """
    config = _config(
        model,
        generation_config,
        dict(
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repetition_penalty=repetition_penalty,
            eos_token_id=eos_token_id,
            pad_token_id=pad_token_id,
        ),
    )
    _check_prompt(model, input_ids, attention_mask)
    key = jax.random.key(0) if key is None else key
    return _generate(model, input_ids, attention_mask, key, config, _prefill_logits(model))


def stream_generate(
    model,
    input_ids: Int[Array, "batch prompt"],
    attention_mask: Int[Array, "batch prompt"] | Bool[Array, "batch prompt"] | None = None,
    *,
    key: PRNGKeyArray | None = None,
    generation_config: GenerationConfig | None = None,
    **overrides,
) -> Iterator[Int[Array, " batch"]]:
    """As [`eqdel.generate`][], yielding each step's tokens (`[batch]`) as soon as they
    are chosen, for interactive use. Each step is one compiled call; the tokens equal
    those of `generate` with the same arguments."""
    config = _config(model, generation_config, overrides)
    _check_prompt(model, input_ids, attention_mask)
    key = jax.random.key(0) if key is None else key
    prompt = input_ids.shape[1]
    state = _jit_prefill(model, input_ids, attention_mask, config, key, _prefill_logits(model))
    for step in range(config.max_new_tokens):
        if step:
            state = _jit_decode_step(model, state, config)
        yield state.tokens[:, prompt + step]
        if bool(jnp.all(state.finished)):
            return


_jit_prefill = eqx.filter_jit(prefill)
_jit_decode_step = eqx.filter_jit(decode_step)
