"""What a causal language model returns."""

import equinox as eqx
from jaxtyping import Array, Float

from .._cache import KVCache


class CausalLMOutput(eqx.Module):
    """**Fields:**

    - `logits`: `[batch, seq, vocab]` next-token logits.
    - `hidden_states`: when asked for, the embeddings and the output of every layer (the
        last one after the final norm), each `[batch, seq, embed]`; otherwise `None`.
    - `cache`: the updated [`eqdel.KVCache`][] when one was passed in.
    """

    logits: Float[Array, "batch seq vocab"]
    hidden_states: tuple[Float[Array, "batch seq embed"], ...] | None = None
    cache: KVCache | None = None
