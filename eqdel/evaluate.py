"""How well a causal LM predicts a text."""

import dataclasses
import math
from collections.abc import Sequence

import equinox as eqx
import numpy as np
from jaxtyping import Array, Int
from tqdm.auto import tqdm

from .train import causal_lm_loss


@dataclasses.dataclass(frozen=True)
class Perplexity:
    """The result of [`eqdel.evaluate.perplexity`][].

    **Fields:**

    - `perplexity`: `exp(nll)`.
    - `nll`: the mean negative log-likelihood per scored token, in nats.
    - `tokens`: how many tokens were scored (all but the first).
    - `window`, `stride`: the sliding window used.
    """

    perplexity: float
    nll: float
    tokens: int
    window: int
    stride: int


@eqx.filter_jit
def _window_loss(model, ids, valid, scored):
    batch = {"input_ids": ids, "attention_mask": valid, "loss_mask": scored}
    loss_sum, _ = causal_lm_loss(model, batch, router_aux_loss_coef=0.0)
    return loss_sum


def _windows(length: int, window: int, stride: int):
    """`(begin, end, first_scored)` of every window: each token after the first is scored
    once, in the first window that ends at or after it, with up to `window - 1` tokens of
    context before it."""
    scored_up_to, begin = 0, 0
    while True:
        end = min(begin + window, length)
        yield begin, end, max(scored_up_to, begin + 1)
        if end == length:
            return
        scored_up_to, begin = end, begin + stride


def perplexity(
    model,
    token_ids: Sequence[int] | Int[Array, " length"] | np.ndarray,
    *,
    window: int | None = None,
    stride: int | None = None,
    progress: bool = True,
) -> Perplexity:
    """Perplexity of `model` on a token sequence, with a sliding window as the
    transformers guide computes it: windows of `window` tokens start every `stride`
    tokens, and each scores only the tokens the previous window did not reach, so that
    every token is predicted from at least `window - stride` tokens of context.

    Every window is padded to `window` tokens, so one compiled call serves them all.

    **Arguments:**

    - `model`: a causal LM from `eqdel.models`.
    - `token_ids`: the text's ids, `[length]` with `length >= 2`.
    - `window`: tokens per window (default: the model's context length, at most 1024).
    - `stride`: tokens between window starts (default: half a window).
    - `progress`: show a progress bar over the windows.

    **Returns:**

    A [`eqdel.evaluate.Perplexity`][].
    """
    ids = np.asarray(token_ids, np.int32).reshape(-1)
    if ids.size < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {ids.size}.")
    context = getattr(model.config, "max_position_embeddings", None) or 1024
    window = min(context, 1024) if window is None else window
    stride = max(window // 2, 1) if stride is None else stride
    if window < 2 or window > context:
        raise ValueError(f"window must be in [2, {context}] (the model's context), not {window}.")
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], not {stride}.")
    window = min(window, ids.size)
    spans = list(_windows(ids.size, window, stride))
    total = 0.0
    positions = np.arange(window)
    for begin, end, first in tqdm(spans, disable=not progress, unit="window"):
        chunk = np.zeros(window, np.int32)
        chunk[: end - begin] = ids[begin:end]
        valid = positions < end - begin
        scored = valid & (positions >= first - begin)
        total += float(_window_loss(model, chunk[None], valid[None], scored[None]))
    count = ids.size - 1
    nll = total / count
    return Perplexity(math.exp(nll), nll, count, window, stride)
