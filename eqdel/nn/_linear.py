"""A dense layer whose weight is stored `[in, out]` and carries semantic axes."""

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._field import field
from ._broadcast import trailing


def matmul(
    x: Float[Array, "*batch in_features"], weight: Float[Array, "in_features out_features"]
) -> Float[Array, "*batch out_features"]:
    """`x @ weight`; on the CPU backend with the leading dimensions of `x` flattened into
    one.

    Flattened, the weight's gradient is one matmul contracting a single dimension of
    tokens. Contracting `[batch, seq]` as two dimensions, XLA's CPU backend first copies
    both operands into transposed layouts, which makes a linear layer's forward and
    backward pass nearly twice as slow. Other backends keep `x @ weight` as written: on a
    mesh that shards both `batch` and `seq`, the flattened form partitions with more
    collectives.

    **Arguments:**

    - `x`: inputs with any leading dimensions.
    - `weight`: a 2-D `[in, out]` weight.

    **Returns:**

    The product, with the leading dimensions of `x`.
    """
    if jax.default_backend() != "cpu":
        return x @ weight
    rows = x.reshape(-1, x.shape[-1]) @ weight
    return rows.reshape(*x.shape[:-1], weight.shape[-1])


class Linear(eqx.Module):
    """`y = x @ weight + bias` over the last dimension of `x`.

    The weight is `[in_features, out_features]`; its semantic axes are given at
    construction because a layer's role decides them (a query projection is
    `(EMBED, HEAD)`, an output projection `(HEAD, EMBED)`).
    """

    weight: Float[Array, "in_features out_features"] = field(axes=lambda self: self.axes)
    bias: Float[Array, " out_features"] | None = field(axes=lambda self: self.axes[1:])
    axes: tuple = eqx.field(static=True)
    checkpoint_transposed: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axes: tuple,
        use_bias: bool = False,
        checkpoint_transposed: bool = True,
        dtype=jnp.float32,
        initializer_range: float = 0.02,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `in_features`, `out_features`: the sizes of the input and output.
        - `axes`: the weight's two semantic axes, `(input axis, output axis)`.
        - `use_bias`: whether to add a bias.
        - `checkpoint_transposed`: whether checkpoints store the weight `[out, in]`, as
            PyTorch's `nn.Linear` does (`False`: `[in, out]`, GPT-2's `Conv1D`).
        - `dtype`: parameter dtype.
        - `initializer_range`: standard deviation of the normal weight initialisation.
        - `key`: a `jax.random` key.
        """
        self.weight = initializer_range * jax.random.normal(
            key, (in_features, out_features), dtype
        )
        self.bias = jnp.zeros((out_features,), dtype) if use_bias else None
        self.axes = tuple(axes)
        self.checkpoint_transposed = checkpoint_transposed

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        """**Arguments:**

        - `x`: inputs with any leading dimensions.

        **Returns:**

        The projection, with `x`'s leading dimensions.
        """
        y = matmul(x, self.weight)
        if self.bias is not None:
            y = y + trailing(self.bias, y.ndim)
        return y
