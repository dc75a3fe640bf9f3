"""Token embeddings, with the transposed path for tied language-model heads."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .. import axes as ax
from .._field import field
from . import _few_rows
from ._linear import matmul


class Embedding(eqx.Module):
    """A `[vocab, embed]` lookup table."""

    weight: Float[Array, "vocab embed"] = field(axes=(ax.VOCAB, ax.EMBED))

    def __init__(
        self,
        vocab_size: int,
        embed_size: int,
        *,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `vocab_size`: number of tokens.
        - `embed_size`: size of each embedding.
        - `dtype`: parameter dtype.
        - `initializer_range`: standard deviation of the normal initialisation.
        - `key`: a `jax.random` key.
        """
        self.weight = initializer_range * jax.random.normal(key, (vocab_size, embed_size), dtype)

    @property
    def dtype(self) -> jnp.dtype:
        """The dtype of the embeddings it gives."""
        return self.weight.dtype

    def __call__(self, ids: Int[Array, "*batch"]) -> Float[Array, "*batch embed"]:
        """**Arguments:**

        - `ids`: token ids.

        **Returns:**

        Their embeddings.
        """
        if _few_rows.gather_usable(self.weight):  # the kernels exist only on CPU
            return _few_rows.gather(self.weight, ids)
        return jnp.take(self.weight, ids, axis=0)

    def unembed(self, x: Float[Array, "*batch embed"]) -> Float[Array, "*batch vocab"]:
        """Logits against the table, for language-model heads tied to the embeddings.

        **Arguments:**

        - `x`: hidden states.

        **Returns:**

        `x @ weight.T`.
        """
        return matmul(x, self.weight, transposed=True)
