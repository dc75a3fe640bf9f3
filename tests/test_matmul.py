"""The linear layers' matmul: 16-bit products accumulate in float32 and their gradients
equal float32 autodiff rounded to the 16-bit dtype, for `[in, out]` and transposed
`[out, in]` weights."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqdel.nn import activation_dtype
from eqdel.nn._linear import matmul
from eqdel.nn._transpose import tiled_transpose

BF16_ULP = 2.0**-7  # the relative spacing of bfloat16 numbers


def _loss(x, weight, cotangent, transposed):
    out = matmul(x, weight, transposed=transposed)
    return jnp.sum(out.astype(jnp.float32) * cotangent)


@pytest.mark.parametrize("shape", [(130, 96), (7, 5), (128, 192), (97, 64), (1, 3)])
def test_tiled_transpose_is_the_transpose(shape):
    matrix = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    np.testing.assert_array_equal(jax.jit(tiled_transpose)(jnp.asarray(matrix)), matrix.T)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("n_out", [40, 56])  # the weight gradient transposes the narrower
def test_bfloat16_matmul_and_gradients_equal_float32_rounded(getkey, transposed, n_out):
    x = jax.random.normal(getkey(), (3, 7, 48), jnp.float32).astype(jnp.bfloat16)
    shape = (n_out, 48) if transposed else (48, n_out)
    weight = jax.random.normal(getkey(), shape, jnp.float32).astype(jnp.bfloat16)
    cotangent = jax.random.normal(getkey(), (3, 7, n_out), jnp.float32)

    out = matmul(x, weight, transposed=transposed)
    grads = jax.grad(_loss, argnums=(0, 1))(x, weight, cotangent, transposed)

    x32, w32 = x.astype(jnp.float32), weight.astype(jnp.float32)
    want_out = matmul(x32, w32, transposed=transposed)
    # The reference gradient with respect to the bfloat16 output, then through float32.
    want = jax.grad(_loss, argnums=(0, 1))(
        x32, w32, cotangent.astype(jnp.bfloat16).astype(jnp.float32), transposed
    )
    assert out.dtype == jnp.bfloat16 and out.shape == (3, 7, n_out)
    np.testing.assert_allclose(
        np.asarray(out, np.float32), np.asarray(want_out), rtol=BF16_ULP, atol=1e-6
    )
    for got, ref, original in zip(grads, want, (x, weight)):
        assert got.dtype == jnp.bfloat16 and got.shape == original.shape
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(ref), rtol=BF16_ULP, atol=BF16_ULP * scale
        )


def test_float32_matmul_is_the_plain_product(getkey):
    x = jax.random.normal(getkey(), (2, 5, 16))
    weight = jax.random.normal(getkey(), (24, 16))
    np.testing.assert_allclose(
        np.asarray(matmul(x, weight, transposed=True)),
        np.asarray(jnp.einsum("bsi,oi->bso", x, weight)),
        rtol=1e-6,
        atol=1e-6,
    )


@pytest.mark.parametrize("transposed", [False, True])
def test_float32_inputs_to_a_bfloat16_weight_round_once_and_return_float32(getkey, transposed):
    """A 16-bit model keeps float32 activations on CPU (`activation_dtype`): the product
    reads them rounded to the weight's dtype and returns its float32 accumulation."""
    assert activation_dtype(jnp.bfloat16) == jnp.float32
    assert activation_dtype(jnp.float32) == jnp.float32
    x = jax.random.normal(getkey(), (3, 7, 48), jnp.float32)
    shape = (40, 48) if transposed else (48, 40)
    weight = jax.random.normal(getkey(), shape, jnp.float32).astype(jnp.bfloat16)
    cotangent = jax.random.normal(getkey(), (3, 7, 40), jnp.float32)

    out = matmul(x, weight, transposed=transposed)
    grads = jax.grad(_loss, argnums=(0, 1))(x, weight, cotangent, transposed)

    rounded, w32 = x.astype(jnp.bfloat16).astype(jnp.float32), weight.astype(jnp.float32)
    assert out.dtype == jnp.float32
    # Products of bfloat16 numbers are exact in float32: only the summation order differs.
    np.testing.assert_allclose(
        out, matmul(rounded, w32, transposed=transposed), rtol=1e-5, atol=1e-5
    )
    want = jax.grad(_loss, argnums=(0, 1))(
        rounded, w32, cotangent.astype(jnp.bfloat16).astype(jnp.float32), transposed
    )
    for got, ref, dtype in zip(grads, want, (jnp.float32, jnp.bfloat16)):
        assert got.dtype == dtype
        scale = float(jnp.max(jnp.abs(ref)))
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(ref), rtol=BF16_ULP, atol=BF16_ULP * scale
        )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_the_dots_remat_policies_save_16bit_products(getkey, dtype):
    """A 16-bit product's custom gradient hides it from the dots policies; it is named
    for them, so that a rematerialised layer saves it (one product forward, two in the
    backward pass) instead of recomputing it, with the same gradients."""
    from eqdel.nn._stacked import REMAT_POLICIES

    x = jax.random.normal(getkey(), (32, 24), jnp.float32).astype(dtype)
    weight = jax.random.normal(getkey(), (24, 24), jnp.float32).astype(jnp.bfloat16)

    def gradients(policy):
        def layer(x, w):
            return jnp.sum(jnp.tanh(matmul(x, w).astype(jnp.float32)) ** 2)

        return jax.jit(jax.value_and_grad(jax.checkpoint(layer, policy=policy), argnums=(0, 1)))

    def products(policy) -> int:
        return gradients(policy).lower(x, weight).as_text().count("stablehlo.dot_general")

    for name in ("dots_saveable", "checkpoint_dots", "dots_with_no_batch_dims_saveable"):
        assert products(REMAT_POLICIES[name]) == 3, name
    assert products(REMAT_POLICIES["full"]) == 4
    saved = gradients(REMAT_POLICIES["dots_saveable"])(x, weight)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(gradients(None)(x, weight))):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
