"""Turning next-token logits into tokens: penalties, warpers, greedy and sampling."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

from ._generation_config import GenerationConfig

_NEG_INF = -jnp.inf


def repetition_penalty(
    logits: Float[Array, "batch vocab"], seen: Bool[Array, "batch vocab"], penalty: float
) -> Float[Array, "batch vocab"]:
    """Make tokens already in the sequence less likely (transformers' rule: divide a
    positive logit by `penalty`, multiply a negative one)."""
    penalised = jnp.where(logits > 0, logits / penalty, logits * penalty)
    return jnp.where(seen, penalised, logits)


def allowed_tokens(
    logits: Float[Array, "batch vocab"], config: GenerationConfig
) -> Bool[Array, "batch vocab"]:
    """The tokens top-k, top-p and min-p leave to sample from (the top token always
    stays), given logits already divided by the temperature."""
    keep = jnp.ones(logits.shape, bool)
    vocab = logits.shape[-1]
    if 0 < config.top_k < vocab:
        kth = jax.lax.top_k(logits, config.top_k)[0][:, -1:]
        keep &= logits >= kth
    if config.top_p < 1.0:
        masked = jnp.where(keep, logits, _NEG_INF)
        order = jnp.argsort(-masked, axis=-1)
        sorted_probs = jnp.take_along_axis(jax.nn.softmax(masked, axis=-1), order, axis=-1)
        before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
        keep_sorted = before < config.top_p
        rows = jnp.arange(logits.shape[0])[:, None]
        keep &= jnp.zeros_like(keep).at[rows, order].set(keep_sorted)
    if config.min_p > 0.0:
        probs = jax.nn.softmax(jnp.where(keep, logits, _NEG_INF), axis=-1)
        keep &= probs >= config.min_p * jnp.max(probs, axis=-1, keepdims=True)
    return keep


def next_tokens(
    logits: Float[Array, "batch vocab"],
    seen: Bool[Array, "batch vocab"] | None,
    config: GenerationConfig,
    key: PRNGKeyArray,
) -> Int[Array, " batch"]:
    """Pick one token per row.

    **Arguments:**

    - `logits`: next-token logits.
    - `seen`: tokens already in each row; needed when `config.repetition_penalty` is
        not `1.0`.
    - `config`: the sampling controls.
    - `key`: randomness for sampling.

    **Returns:**

    The chosen token of every row.
    """
    logits = logits.astype(jnp.float32)
    if config.repetition_penalty != 1.0:
        logits = repetition_penalty(logits, seen, config.repetition_penalty)
    if config.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / config.temperature
    logits = jnp.where(allowed_tokens(logits, config), logits, _NEG_INF)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)
