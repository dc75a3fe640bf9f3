"""The CPU kernels for products of a few rows: the same products and gradients as XLA's
for every weight kind and shape, used in a compiled decode loop on the stored codes, and
a warning, not a failure, when they cannot be built."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tiny import TINY_LLAMA

import eqdel
from eqdel._quant import Int4Linear, Int8Embedding, Int8Linear, NF4Linear
from eqdel.models import LlamaForCausalLM
from eqdel.nn import Embedding, Linear, _few_rows
from eqdel.nn._linear import matmul

pytestmark = pytest.mark.skipif(
    not _few_rows.available(),
    reason="eqdel's CPU kernels are opt-in (EQDEL_CPU_KERNELS=1) and need a C++ compiler",
)

# (rows, inputs, outputs, group size): one row (decode), the most rows, outputs that are
# not whole vectors of 16, inputs that are not whole groups (or odd), and a weight deep
# enough to be split into chunks over the threads.
SHAPES = [(1, 96, 40, 64), (16, 37, 19, 8), (5, 1536, 200, 32), (3, 576, 960, 64)]


def _runs_a_kernel(fn, *args) -> bool:
    return "eqdel_few_rows" in str(jax.make_jaxpr(fn)(*args))


def _float64_product(rows, weight):
    return np.asarray(rows, np.float64) @ np.asarray(weight, np.float64)


def _quantized_layers(key, n_in, n_out, group):
    linear = Linear(n_in, n_out, axes=(None, None), use_bias=True, key=key)
    return [
        Int8Linear(linear),
        Int8Linear(linear, group_size=group),
        NF4Linear(linear, group),
        Int4Linear(linear, group),
    ]


@pytest.mark.parametrize("rows, n_in, n_out, group", SHAPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_float_weights_give_the_product(getkey, rows, n_in, n_out, group, dtype, transposed):
    x = jax.random.normal(getkey(), (rows, n_in), jnp.float32)
    weight = (0.05 * jax.random.normal(getkey(), (n_in, n_out), jnp.float32)).astype(dtype)
    stored = weight.T if transposed else weight

    def product(x, w):
        return matmul(x, w, transposed=transposed)

    assert _runs_a_kernel(product, x, stored)
    out = jax.jit(product)(x, stored)
    rounded = x.astype(dtype).astype(jnp.float32)
    assert out.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(out), _float64_product(rounded, weight.astype(jnp.float32)), atol=1e-5
    )


@pytest.mark.parametrize("rows, n_in, n_out, group", SHAPES)
def test_quantized_layers_give_the_product_of_their_dequantised_weight(
    getkey, rows, n_in, n_out, group
):
    x = jax.random.normal(getkey(), (rows, n_in), jnp.float32)
    for layer in _quantized_layers(getkey(), n_in, n_out, group):
        assert _runs_a_kernel(layer, x)
        out = eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
        want = _float64_product(x, layer.weight(jnp.float32)) + np.asarray(layer.bias)
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)


@pytest.mark.parametrize("rows, n_in, group", [(2, 61, 7), (1, 64, 61), (3, 45, 1)])
def test_nf4_groups_of_odd_size_split_a_byte_between_two_scales(getkey, rows, n_in, group):
    x = jax.random.normal(getkey(), (rows, n_in), jnp.float32)
    layer = NF4Linear(Linear(n_in, 40, axes=(None, None), key=getkey()), group)
    assert _runs_a_kernel(layer, x)
    out = eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
    np.testing.assert_allclose(
        np.asarray(out), _float64_product(x, layer.weight(jnp.float32)), atol=1e-5
    )


@pytest.mark.parametrize(
    "rows, vocab, embed, group", [(1, 1000, 576, 32), (16, 37, 40, 7), (5, 300, 64, 24)]
)
def test_int8_embeddings_as_a_head_give_the_product(getkey, rows, vocab, embed, group):
    """A tied head on int8 embeddings: groups of whole vectors of 16 inputs, and groups
    that split a vector (or leave a last, smaller group)."""
    x = jax.random.normal(getkey(), (rows, embed), jnp.float32)
    table = Int8Embedding(Embedding(vocab, embed, key=getkey()), group)
    assert _runs_a_kernel(table.unembed, x)
    out = eqx.filter_jit(lambda table, x: table.unembed(x))(table, x)
    want = _float64_product(x, table.weight(jnp.float32).T)
    np.testing.assert_allclose(np.asarray(out), want, atol=1e-5)
    cotangent = jax.random.normal(getkey(), out.shape, jnp.float32)

    def loss(x):
        return jnp.sum(table.unembed(x) * cotangent)

    grad = jax.grad(loss)(x)
    np.testing.assert_allclose(
        np.asarray(grad), _float64_product(cotangent, table.weight(jnp.float32)), atol=1e-5
    )


def _random_case(rng):
    """A product of a random size, weight kind and layout."""
    rows = int(rng.integers(1, _few_rows.MAX_ROWS + 1))
    n_in = int(rng.choice([1, 2, 3, 5, 16, 17, 63, 64, 65, 130, 257, 700, 1536]))
    n_out = int(rng.choice([1, 2, 3, 15, 16, 17, 40, 100, 513, 1030, 3000]))
    kind = str(rng.choice(["float32", "bfloat16", "int8", "nf4", "int4"]))
    group = int(rng.choice([2, 4, 8, 32, 64] if kind == "int4" else [3, 7, 32, 61, 64]))
    return rows, n_in, n_out, kind, group, bool(rng.integers(2))


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_and_kinds_give_the_product(seed):
    rng = np.random.default_rng(seed)
    for _ in range(12):
        rows, n_in, n_out, kind, group, transposed = _random_case(rng)
        x = jnp.asarray(rng.normal(size=(rows, n_in)), jnp.float32)
        linear = Linear(n_in, n_out, axes=(None, None), key=jax.random.key(int(rng.integers(99))))
        if kind in ("float32", "bfloat16"):
            weight = linear.weight.astype(kind)
            stored = weight.T if transposed else weight
            out = jax.jit(functools.partial(matmul, transposed=transposed))(x, stored)
            want = _float64_product(x.astype(kind).astype(jnp.float32), weight.astype(jnp.float32))
        else:
            layer = {"int8": Int8Linear, "nf4": NF4Linear, "int4": Int4Linear}[kind]
            layer = layer(linear) if kind == "int8" else layer(linear, group)
            out = eqx.filter_jit(lambda layer, x: layer(x))(layer, x)
            want = _float64_product(x, layer.weight(jnp.float32))
        case = f"{rows} x {n_in} x {n_out}, {kind}, group {group}, transposed {transposed}"
        np.testing.assert_allclose(np.asarray(out), want, atol=1e-5, err_msg=case)


def test_gradients_equal_those_through_xla(getkey, monkeypatch):
    """Through a kernel, gradients reach the inputs, a float weight and a quantized
    layer's scales and offsets as they do through XLA's product."""
    x = jax.random.normal(getkey(), (4, 96), jnp.float32)
    cotangent = jax.random.normal(getkey(), (4, 40), jnp.float32)
    linear = Linear(96, 40, axes=(None, None), use_bias=True, key=getkey())
    modules = [linear, *_quantized_layers(getkey(), 96, 40, 32)]

    def grads(module):
        def loss(module, x):
            return jnp.sum(module(x) * cotangent)

        return eqx.filter_grad(loss)(module, x), jax.grad(loss, argnums=1)(module, x)

    through_kernels = [grads(module) for module in modules]
    monkeypatch.setattr(_few_rows, "usable", lambda rows, weight: False)
    for module, got in zip(modules, through_kernels):
        assert not _runs_a_kernel(module, x)
        want = grads(module)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_quantized_decode_reads_the_codes_and_generates_as_dequantised(monkeypatch):
    """The compiled decode loop runs the int8 products through the kernel, on the codes,
    and greedy tokens equal the dequantised model's through XLA."""
    quantized = eqdel.quantize(LlamaForCausalLM(TINY_LLAMA, key=jax.random.key(0)), 8)
    model = quantized.for_generation()
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (1, 6)), jnp.int32)
    args = dict(max_new_tokens=8, eos_token_id=[])

    arrays, static = eqx.partition(model, eqx.is_array)

    def decode(arrays, ids):
        return eqdel.generate(eqx.combine(arrays, static), ids, **args)

    program = jax.jit(decode).lower(arrays, ids).compile().as_text()
    assert "eqdel_few_rows_int8" in program
    got = eqdel.generate(model, ids, **args)

    monkeypatch.setattr(_few_rows, "usable", lambda rows, weight: False)
    want = eqdel.generate(eqdel.dequantize(quantized).for_generation(), ids, **args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_compiler_that_fails_leaves_products_with_xla(monkeypatch, tmp_path):
    monkeypatch.setenv("EQDEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("EQDEL_CPU_KERNELS", "1")
    with pytest.warns(UserWarning, match="CPU kernels are unavailable"):
        assert not _few_rows.available.__wrapped__()
    monkeypatch.setenv("EQDEL_CPU_KERNELS", "0")
    assert not _few_rows.available.__wrapped__()
