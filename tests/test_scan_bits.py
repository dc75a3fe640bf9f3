"""The scanned form of 16-bit stacks: layers read as bits, gradients packed in pairs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eqdel.nn._scan_bits import read_scanned, scanned_form


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("width", [6, 7])
def test_gradients_through_the_scanned_form_equal_plain_slicing_bit_for_bit(dtype, width):
    """Each layer's gradient, rounded to the stack's dtype, lands in the packed stand-in
    and comes back unchanged, also for an odd last dimension (a padded pair) and for
    pairs whose second value is zero (a subnormal float32, which arithmetic could flush)."""
    keys = jax.random.split(jax.random.key(0), 3)
    stack = jax.random.normal(keys[0], (4, 5, width)).astype(dtype)
    bias = jax.random.normal(keys[1], (4, width)).astype(dtype)
    x = jax.random.normal(keys[2], (3, 5))

    every_other = (jnp.arange(width) % 2 == 0)[None]  # odd columns get zero gradients

    def layer(h, weights):
        w, b = weights
        out = jnp.tanh(h @ w.astype(jnp.float32) + b.astype(jnp.float32)[None])
        return jnp.where(every_other, out, 0.0)[:, :5] + h, None

    def plain(arrays):
        return jnp.sum(jax.lax.scan(layer, x, arrays)[0] ** 2)

    def scanned(arrays):
        body = lambda h, each: layer(h, read_scanned(each))  # noqa: E731
        return jnp.sum(jax.lax.scan(body, x, scanned_form(arrays))[0] ** 2)

    got = jax.jit(jax.grad(scanned))((stack, bias))
    want = jax.jit(jax.grad(plain))((stack, bias))
    for g, w in zip(got, want, strict=True):
        assert g.dtype == w.dtype == dtype
        np.testing.assert_array_equal(np.asarray(g).view(np.uint16), np.asarray(w).view(np.uint16))
        values = np.asarray(g, np.float32)
        assert np.all(values[..., 1::2] == 0) and np.all(values[..., :5:2] != 0)
