"""A dense layer whose weight is stored `[in, out]` and carries semantic axes."""

import functools
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jaxtyping import Array, Float, PRNGKeyArray

from .._field import field
from . import _few_rows
from ._broadcast import trailing
from ._transpose import tiled_transpose

LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
"""The 16-bit float dtypes, whose products on CPU accumulate in float32."""


def _dot(a: Array, b: Array, a_dim: int, b_dim: int) -> Float[Array, "m n"]:
    """Contract dimension `a_dim` of the matrix `a` with `b_dim` of `b`, accumulating and
    returning float32."""
    dims = (((a_dim,), (b_dim,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def activation_dtype(dtype) -> jnp.dtype:
    """The dtype a model whose parameters are `dtype` keeps its activations in.

    On the CPU backend, float32 for 16-bit parameters: XLA's CPU backend computes 16-bit
    elementwise operations in float32 and rounds their results to 16 bits, and its
    16-bit products are fast only when they accumulate in float32, so float32 activations
    between the products are faster and closer to the float32 model. Elsewhere, `dtype`.
    """
    dtype = jnp.dtype(dtype)
    if jax.default_backend() == "cpu" and dtype in LOW_PRECISION:
        return jnp.dtype(jnp.float32)
    return dtype


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _low_precision_matmul(rows: Array, weight: Array, transposed: bool, out_dtype) -> Array:
    """`rows @ weight` (`rows @ weight.T` when `transposed`) in a 16-bit dtype,
    accumulated in float32 and returned as `out_dtype`.

    XLA's CPU backend sends a 16-bit product to the CPU's bfloat16 matrix units (AMX,
    AVX-512 BF16) only when it accumulates in float32 and the left operand contracts its
    last dimension on an operand it does not have to transpose first; otherwise it
    converts both operands to float32, slower than float32 throughout. The input
    gradient is written in that form too. The weight gradient contracts the tokens, the
    leading dimension of both operands: its left operand is therefore transposed first,
    as tiles (`tiled_transpose`), which XLA writes out rather than folding into the
    product. Of the inputs and the output's gradient, the narrower is transposed (for a
    weight `[in, out]` with `in > out`, the gradient comes out `[out, in]` and is
    transposed after). The output's gradient is rounded to the weight's dtype for both.
    """
    return _dot(rows, weight, 1, 1 if transposed else 0).astype(out_dtype)


def _low_precision_matmul_fwd(rows, weight, transposed, out_dtype):
    return _low_precision_matmul(rows, weight, transposed, out_dtype), (rows, weight)


def _low_precision_matmul_bwd(transposed, out_dtype, residuals, grad):
    rows, weight = residuals
    grad = grad.astype(weight.dtype)
    grad_rows = _dot(grad, weight, 1, 0 if transposed else 1)
    if rows.shape[1] > grad.shape[1]:
        grad_weight = _dot(tiled_transpose(grad), rows, 1, 0)  # [out, in]
        swapped = not transposed
    else:
        grad_weight = _dot(tiled_transpose(rows), grad, 1, 0)  # [in, out]
        swapped = transposed
    if swapped:
        # The barrier keeps XLA from folding the transpose into the product, which its
        # CPU backend then cannot run in 16 bits ("Unsupported element type for
        # DotThunk").
        grad_weight = jax.lax.optimization_barrier(grad_weight).T
    return grad_rows.astype(rows.dtype), grad_weight.astype(weight.dtype)


_low_precision_matmul.defvjp(_low_precision_matmul_fwd, _low_precision_matmul_bwd)


def matmul(
    x: Float[Array, "*batch in_features"],
    weight: Float[Array, "in_features out_features"] | Float[Array, "out_features in_features"],
    *,
    transposed: bool = False,
) -> Float[Array, "*batch out_features"]:
    """`x @ weight` (`x @ weight.T` when `transposed`); on the CPU backend with the
    leading dimensions of `x` flattened into one.

    Flattened, the weight's gradient is one matmul contracting a single dimension of
    tokens. Contracting `[batch, seq]` as two dimensions, XLA's CPU backend first copies
    both operands into transposed layouts, which makes a linear layer's forward and
    backward pass nearly twice as slow. With a bfloat16 or float16 weight the product
    accumulates in float32, which is what sends it to the CPU's 16-bit matrix units, and
    a transposed weight is contracted where it lies (XLA converts a transposed 16-bit
    operand to float32). Float32 inputs to a 16-bit weight (see
    [`eqdel.nn.activation_dtype`][]) are rounded to the weight's dtype and the product
    returned in float32. With `EQDEL_CPU_KERNELS=1`, up to 16 float32 rows (a decode
    step) run through a kernel that reads the weight as stored, where XLA would read a
    16-bit weight as a float32 copy, and more float32 rows with a float32 weight through
    OpenBLAS where it is installed.
    Other backends keep `x @ weight` as written: on a mesh that shards both `batch` and
    `seq`, the flattened form partitions with more collectives.

    **Arguments:**

    - `x`: inputs with any leading dimensions.
    - `weight`: a 2-D `[in, out]` weight, or `[out, in]` when `transposed`.
    - `transposed`: whether `weight` is stored `[out, in]` (a tied embedding table).

    **Returns:**

    The product, with the leading dimensions of `x`.
    """
    if jax.default_backend() != "cpu":
        return x @ (weight.T if transposed else weight)
    rows = x.reshape(-1, x.shape[-1])
    product = functools.partial(_xla_product, transposed=transposed)
    if weight.dtype in (jnp.float32, jnp.bfloat16) and _few_rows.usable(rows, weight):
        rows = _few_rows.dense(rows, weight, transposed, product)
    elif _few_rows.gemm_usable(rows, weight):
        rows = _few_rows.gemm(rows, weight, transposed)
    else:
        rows = product(rows, weight)
    return rows.reshape(*x.shape[:-1], rows.shape[-1])


def _xla_product(rows: Float[Array, "m k"], weight: Array, transposed: bool) -> Array:
    """`rows @ weight` (`rows @ weight.T` when `transposed`) as XLA's CPU backend runs
    it fastest (see `matmul`)."""
    if weight.dtype in LOW_PRECISION and rows.dtype in (
        weight.dtype,
        activation_dtype(weight.dtype),
    ):
        product = _low_precision_matmul(rows.astype(weight.dtype), weight, transposed, rows.dtype)
        return _named_for_remat(product)
    return rows @ (weight.T if transposed else weight)


def _named_for_remat(product: Array) -> Array:
    """`product`, named `PRODUCT_NAME` so that the dots remat policies save it (its custom
    gradient hides the product from them). A 16-bit product is named as its bits: XLA's
    CPU backend writes a saved 16-bit value into the scan's stack of them by converting
    the whole stack to float32 and back, on every layer."""
    if product.dtype in LOW_PRECISION:
        return _named_as_bits(product)
    return checkpoint_name(product, _few_rows.PRODUCT_NAME)


def _name_bits(x: Array) -> Array:
    bits = checkpoint_name(jax.lax.bitcast_convert_type(x, jnp.uint16), _few_rows.PRODUCT_NAME)
    return jax.lax.bitcast_convert_type(bits, x.dtype)


@jax.custom_jvp
def _named_as_bits(x: Array) -> Array:
    """`x`, by way of its bits named `PRODUCT_NAME`; differentiated as the identity."""
    return _name_bits(x)


@_named_as_bits.defjvp
def _named_as_bits_jvp(primals, tangents):
    return _name_bits(primals[0]), tangents[0]


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


def concatenated(layers: Sequence[Linear]) -> Linear:
    """One `Linear` whose outputs are those of `layers` one after another.

    **Arguments:**

    - `layers`: `Linear`s over the same inputs, all with or all without a bias.

    **Returns:**

    A `Linear` with the weights (and biases) concatenated along the outputs and the
    first layer's axes and checkpoint layout.
    """
    weight = jnp.concatenate([layer.weight for layer in layers], axis=-1)
    biases = [layer.bias for layer in layers]
    bias = None if biases[0] is None else jnp.concatenate(biases, axis=-1)
    return eqx.tree_at(
        lambda layer: (layer.weight, layer.bias),
        layers[0],
        (weight, bias),
        is_leaf=lambda x: x is None,
    )
