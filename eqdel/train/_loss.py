"""Causal language-model cross-entropy, computed in token chunks."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from ..models import load_balancing_loss
from ..nn import activation_dtype

IGNORE_INDEX = -100
"""Label value excluded from the loss, as in transformers."""


def _chunks(hidden, labels, weights, chunk_size: int):
    """Pad to a multiple of `chunk_size` tokens (with zero weight) and split into
    `[chunks, chunk_size, ...]`."""
    tokens = hidden.shape[0]
    chunks = -(-tokens // chunk_size)
    pad = chunks * chunk_size - tokens
    hidden = jnp.pad(hidden, ((0, pad), (0, 0)))
    labels = jnp.pad(labels, (0, pad))
    weights = jnp.pad(weights, (0, pad))
    return (
        hidden.reshape(chunks, chunk_size, -1),
        labels.reshape(chunks, chunk_size),
        weights.reshape(chunks, chunk_size),
    )


def _softmax_terms(logits, labels):
    """Each token's softmax over the vocabulary, its log-partition and its label's logit.

    The exponentials are written out once, then summed, and the softmax reuses them. XLA's
    CPU backend sums fast what is written out, but slowly what it computes inside the sum:
    for `[1024, 49152]` float32 logits, log-sum-exp alone took 165-190 ms, and it plus
    the softmax took 243-257 ms, against 165-171 ms this way."""
    logits = logits.astype(jnp.float32)
    peak = jnp.max(logits, axis=-1, keepdims=True)
    exps = jnp.exp(logits - peak)
    sums = jnp.sum(exps, axis=-1, keepdims=True)
    log_z = (peak + jnp.log(sums))[:, 0]
    picked = jnp.take_along_axis(logits, labels[:, None], axis=-1)[:, 0]
    return exps / sums, log_z, picked


@eqx.filter_custom_vjp
def _fused_cross_entropy(head_and_hidden, labels, weights, chunk_size):
    head, hidden = head_and_hidden

    def chunk_loss(args):
        h, y, w = args
        _, log_z, picked = _softmax_terms(head(h), y)
        return jnp.sum((log_z - picked) * w)

    return jnp.sum(jax.lax.map(chunk_loss, _chunks(hidden, labels, weights, chunk_size)))


@_fused_cross_entropy.def_fwd
def _fused_cross_entropy_fwd(perturbed, head_and_hidden, labels, weights, chunk_size):
    """The loss and its gradient in one pass over the chunks: each chunk's logits are
    made once, turned into `weights * (softmax - onehot)` and pulled back through the
    head, so the backward pass has no matmul of its own left to do."""
    head, hidden = head_and_hidden
    head_perturbed, _ = perturbed
    diff_head, static_head = eqx.partition(head, head_perturbed)
    tokens = hidden.shape[0]

    def chunk(grad_head, args):
        h, y, w = args
        out, pull_back = jax.vjp(lambda d, h: eqx.combine(d, static_head)(h), diff_head, h)
        probs, log_z, picked = _softmax_terms(out, y)
        onehot = jax.nn.one_hot(y, probs.shape[-1], dtype=jnp.float32)
        grad_head_chunk, grad_h = pull_back(((probs - onehot) * w[:, None]).astype(out.dtype))
        grad_head = jax.tree.map(jnp.add, grad_head, grad_head_chunk)
        return grad_head, (jnp.sum((log_z - picked) * w), grad_h)

    zero = jax.tree.map(jnp.zeros_like, diff_head)
    grad_head, (sums, grad_hidden) = jax.lax.scan(
        chunk, zero, _chunks(hidden, labels, weights, chunk_size)
    )
    grad_hidden = grad_hidden.reshape(-1, hidden.shape[-1])[:tokens]
    return jnp.sum(sums), (grad_head, grad_hidden)


@_fused_cross_entropy.def_bwd
def _fused_cross_entropy_bwd(
    residuals, grad_loss, perturbed, head_and_hidden, labels, weights, chunk_size
):
    grad_head, grad_hidden = residuals
    _, hidden_perturbed = perturbed
    scaled_head = jax.tree.map(lambda g: g * grad_loss.astype(g.dtype), grad_head)
    scaled_hidden = grad_hidden * grad_loss.astype(grad_hidden.dtype) if hidden_perturbed else None
    return scaled_head, scaled_hidden


def chunked_cross_entropy(
    head,
    hidden: Float[Array, "tokens embed"],
    labels: Int[Array, " tokens"],
    weights: Float[Array, " tokens"],
    *,
    chunk_size: int = 1024,
) -> Float[Array, ""]:
    """Summed, weighted cross-entropy of `head(hidden)` against `labels`, without holding
    float32 logits for more than `chunk_size` tokens at once.

    Under differentiation the gradient is computed in the same pass as the loss: each
    chunk's logits are made once and pulled straight back through `head`, which saves
    the head matmul that recomputing them in the backward pass would cost. Only
    reverse-mode differentiation is defined.

    **Arguments:**

    - `head`: maps `[n, embed]` hidden states to `[n, vocab]` logits (a module, its
        method or a closure; gradients reach every array it reads).
    - `hidden`, `labels`, `weights`: one entry per predicted token.
    - `chunk_size`: tokens per chunk.

    **Returns:**

    `sum(weights * -log p(labels))`.
    """
    # As a closure-converted function the head's pytree holds exactly the arrays it
    # reads, closed over or not: a bound method's module would bring the whole model.
    example = jax.ShapeDtypeStruct((chunk_size, hidden.shape[-1]), hidden.dtype)
    head = eqx.filter_closure_convert(head, example)
    return _fused_cross_entropy((head, hidden), labels, weights, chunk_size)


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
    # The activations' dtype, as the model's own call has it: on CPU a 16-bit model
    # trains with float32 activations between its 16-bit products, and its head writes
    # float32 logits.
    embeds = embeds.astype(activation_dtype(embeds.dtype))
    hidden, _, _, router_logits = model.get_decoder()(embeds, positions, valid)
    target_weights = weights[:, 1:].astype(jnp.float32)
    targets = jnp.where(weights[:, 1:], labels[:, 1:], 0)
    head_input = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    loss_sum = chunked_cross_entropy(
        model.head,
        head_input,
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
