"""What a causal language model returns."""

import equinox as eqx
from jaxtyping import Array, Float

from .._cache import KVCache


class CausalLMOutput(eqx.Module):
    """**Fields:**

    - `logits`: `[batch, seq, vocab]` next-token logits (for the last positions only
        when the call was given `logits_to_keep`).
    - `hidden_states`: when asked for, the embeddings and the output of every layer (the
        last one after the final norm), each `[batch, seq, embed]`; otherwise `None`.
    - `cache`: the updated [`eqdel.KVCache`][] when one was passed in.
    - `router_logits`: for mixture-of-experts models, every layer's router logits
        `[layers, batch, seq, experts]` (for [`eqdel.models.load_balancing_loss`][]).
    """

    logits: Float[Array, "batch positions vocab"]
    hidden_states: tuple[Float[Array, "batch seq embed"], ...] | None = None
    cache: KVCache | None = None
    router_logits: Float[Array, "layers batch seq experts"] | None = None
