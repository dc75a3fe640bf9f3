"""Causal language-model cross-entropy, computed in token chunks."""

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..models import load_balancing_loss

IGNORE_INDEX = -100
"""Label value excluded from the loss, as in transformers."""


def _chunk_loss(head, h, labels, weights):
    logits = head(h).astype(jnp.float32)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return jnp.sum((log_z - picked) * weights)


def chunked_cross_entropy(
    head,
    hidden: Float[Array, "tokens embed"],
    labels: Int[Array, " tokens"],
    weights: Float[Array, " tokens"],
    *,
    chunk_size: int = 1024,
) -> Float[Array, ""]:
    """Summed, weighted cross-entropy of `head(hidden)` against `labels`, without holding
    float32 logits for more than `chunk_size` tokens at once (forward or backward: each
    chunk's logits are recomputed in the backward pass).

    **Arguments:**

    - `head`: maps `[n, embed]` hidden states to `[n, vocab]` logits.
    - `hidden`, `labels`, `weights`: one entry per predicted token.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `sum(weights * -log p(labels))`.
    """
    tokens = hidden.shape[0]
    chunks = -(-tokens // chunk_size)
    pad = chunks * chunk_size - tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels = jnp.pad(labels, (0, pad))
    weights = jnp.pad(weights, (0, pad))
    per_chunk = jax.checkpoint(lambda args: _chunk_loss(head, *args))
    sums = jax.lax.map(
        per_chunk,
        (
            hidden.reshape(chunks, chunk_size, -1),
            labels.reshape(chunks, chunk_size),
            weights.reshape(chunks, chunk_size),
        ),
    )
    return jnp.sum(sums)


def causal_lm_loss(
    model, batch: dict, *, chunk_size: int = 1024, router_aux_loss_coef: float | None = None
) -> tuple[Array, Array]:
    """Next-token cross-entropy of a causal LM on a batch; for a mixture-of-experts model,
    plus the router's load-balancing loss.

    **Arguments:**

    - `model`: a causal LM from `eqdel.models`.
    - `batch`: `input_ids` `[batch, seq]`; optional `attention_mask` (`0` at padding),
        `labels` (default: `input_ids`; `-100` is ignored) and `loss_mask` (`0` where no
        loss is wanted, e.g. prompt tokens in SFT), all `[batch, seq]`.
    - `chunk_size`: tokens per chunk of the vocabulary projection.
    - `router_aux_loss_coef`: the weight of [`eqdel.models.load_balancing_loss`][] for
        models that route tokens to experts (default: the config's
        `router_aux_loss_coef`; `0` leaves it out). Ignored for dense models.

    **Returns:**

    `(loss_sum, token_count)`: the summed loss and the number of tokens it covers, so that
    accumulating both over micro-batches gives exactly the large-batch mean.
    """
    ids = batch["input_ids"]
    mask = batch.get("attention_mask")
    labels = batch.get("labels", ids)
    valid = jnp.ones(ids.shape, bool) if mask is None else mask.astype(bool)
    weights = valid & (labels != IGNORE_INDEX)
    if "loss_mask" in batch:
        weights &= batch["loss_mask"].astype(bool)
    positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=-1) - 1, 0)
    embeds = model.get_input_embeddings()(ids)
    hidden, _, _, router_logits = model.get_decoder()(embeds, positions, valid)
    target_weights = weights[:, 1:].astype(jnp.float32)
    targets = jnp.where(weights[:, 1:], labels[:, 1:], 0)
    embed = hidden.shape[-1]
    loss_sum = chunked_cross_entropy(
        model.head,
        hidden[:, :-1].reshape(-1, embed),
        targets.reshape(-1),
        target_weights.reshape(-1),
        chunk_size=chunk_size,
    )
    count = jnp.sum(target_weights)
    coef = router_aux_loss_coef
    if router_logits is not None and coef is None:
        coef = model.config.router_aux_loss_coef
    if router_logits is not None and coef:
        # Weighted by the token count, so that loss_sum / count = cross-entropy + coef * aux
        # (over micro-batches: the token-weighted mean of each micro-batch's aux loss).
        aux = load_balancing_loss(router_logits, model.config.num_experts_per_tok, valid)
        loss_sum = loss_sum + coef * aux * count
    return loss_sum, count
