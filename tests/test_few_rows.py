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
from eqdel.attention import AttentionMask, vanilla_attention
from eqdel.attention._vanilla import _attention
from eqdel.models import LlamaForCausalLM
from eqdel.nn import Embedding, Linear, _few_rows
from eqdel.nn._linear import matmul

pytestmark = pytest.mark.skipif(
    not _few_rows.available(),
    reason="eqdel's CPU kernels are opt-in (EQDEL_CPU_KERNELS=1) and need a C++ compiler",
)

# (rows, inputs, outputs, group size): one row (decode), the most rows, outputs that are
# not whole vectors of 16, inputs that are not whole groups (or odd), a weight deep
# enough to be split into chunks over the threads, and inputs that leave a remainder
# after the bfloat16 pair products' passes of eight.
SHAPES = [
    (1, 96, 40, 64),
    (16, 37, 19, 8),
    (5, 1536, 200, 32),
    (3, 576, 960, 64),
    (8, 75, 100, 16),
]


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


# (batch, tokens, heads, kv heads, head dim, slots, sliding window): long caches at
# batch 1 (SmolLM2's heads; one key/value head), whose slots are split into spans; several
# tokens and a head dimension that is not whole vectors of 16; one key/value head per
# query head with a sliding window.
ATTENTION_CASES = [
    (1, 1, 9, 3, 64, 1088, 0),
    (1, 2, 2, 1, 32, 1000, 0),
    (3, 4, 4, 2, 20, 37, 0),
    (2, 1, 8, 8, 16, 50, 5),
]


def _attention_inputs(key, batch, tokens, heads, kv_heads, dim, slots, window):
    q_key, k_key, v_key = jax.random.split(key, 3)
    query = jax.random.normal(q_key, (batch, tokens, heads, dim), jnp.float32)
    keys = jax.random.normal(k_key, (batch, slots, kv_heads, dim), jnp.float32)
    values = jax.random.normal(v_key, (batch, slots, kv_heads, dim), jnp.float32)
    # Each row's tokens sit at a different place in the cache, after a padded start;
    # with more than one row, the last row's first token sees nothing (every slot
    # masked), which XLA's attention allows.
    filled = slots - tokens - jnp.arange(batch)
    query_index = filled[:, None] + jnp.arange(tokens)[None, :]
    key_index = jnp.broadcast_to(jnp.arange(slots), (batch, slots))
    key_valid = (key_index >= 3) & (key_index <= query_index[:, -1:])
    if batch > 1:
        key_valid = key_valid.at[-1, : filled[-1] + 1].set(False)
    mask = AttentionMask(query_index, key_index, key_valid, window)
    return query, keys, values, mask


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_decode_attention_on_the_cache_as_stored_gives_xlas(getkey, case):
    query, keys, values, mask = _attention_inputs(getkey(), *case)

    def attend(query, keys, values):
        return vanilla_attention(query, keys, values, mask, scale=0.3)

    assert "eqdel_attention" in str(jax.make_jaxpr(attend)(query, keys, values))
    got = jax.jit(attend)(query, keys, values)
    want = jax.jit(functools.partial(_attention, mask=mask, scale=0.3))(query, keys, values)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    cotangent = jax.random.normal(getkey(), query.shape, jnp.float32)

    def loss(fn, *operands):
        return jnp.sum(fn(*operands) * cotangent)

    got = jax.grad(functools.partial(loss, attend), argnums=(0, 1, 2))(query, keys, values)
    reference = functools.partial(_attention, mask=mask, scale=0.3)
    want = jax.grad(functools.partial(loss, reference), argnums=(0, 1, 2))(query, keys, values)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_attention_the_kernel_does_not_take_stays_with_xla(getkey):
    query, keys, values, mask = _attention_inputs(getkey(), 1, 5, 4, 2, 16, 20, 0)
    for q, k, v, cap in [
        (query, keys, values, None),  # more tokens than a decode step
        (query[:, :1], keys, values, 30.0),  # a soft cap
        (query[:, :1], keys.astype(jnp.bfloat16), values.astype(jnp.bfloat16), None),
    ]:
        part = AttentionMask(mask.query_index[:, : q.shape[1]], mask.key_index, mask.key_valid)
        fn = functools.partial(vanilla_attention, mask=part, scale=0.3, soft_cap=cap)
        assert "eqdel_attention" not in str(jax.make_jaxpr(fn)(q, k, v))


def test_float32_decode_attends_through_the_kernel_with_xlas_tokens(monkeypatch):
    model = LlamaForCausalLM(TINY_LLAMA, key=jax.random.key(3)).for_generation()
    ids = jnp.asarray(np.random.default_rng(1).integers(0, 64, (2, 5)), jnp.int32)
    args = dict(max_new_tokens=8, eos_token_id=[])
    arrays, static = eqx.partition(model, eqx.is_array)

    def decode(arrays, ids):
        return eqdel.generate(eqx.combine(arrays, static), ids, **args)

    assert "eqdel_attention" in jax.jit(decode).lower(arrays, ids).compile().as_text()
    got = eqdel.generate(model, ids, **args)
    monkeypatch.setattr(_few_rows, "attention_usable", lambda *args: False)
    want = eqdel.generate(model, ids, **args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_a_compiler_that_fails_leaves_products_with_xla(monkeypatch, tmp_path):
    monkeypatch.setenv("EQDEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    monkeypatch.setenv("EQDEL_CPU_KERNELS", "1")
    with pytest.warns(UserWarning, match="CPU kernels are unavailable"):
        assert _few_rows._library.__wrapped__() is None
    monkeypatch.setenv("EQDEL_CPU_KERNELS", "0")
    assert _few_rows._library.__wrapped__() is None


needs_openblas = pytest.mark.skipif(
    not _few_rows.gemm_available(), reason="float32 products of many rows need scipy-openblas32"
)


# (rows, inputs, outputs): more rows than outputs (split by rows), more outputs than rows
# (split by columns), sizes that are not whole vectors, and the fewest rows it takes.
GEMM_SHAPES = [(300, 96, 40), (17, 37, 1000), (129, 1, 33), (64, 200, 64)]


@needs_openblas
@pytest.mark.parametrize("rows, n_in, n_out", GEMM_SHAPES)
@pytest.mark.parametrize("transposed", [False, True])
def test_many_float32_rows_give_the_product_through_openblas(
    getkey, rows, n_in, n_out, transposed
):
    x = jax.random.normal(getkey(), (rows, n_in), jnp.float32)
    weight = jax.random.normal(getkey(), (n_in, n_out), jnp.float32)
    stored = weight.T if transposed else weight
    product = functools.partial(matmul, transposed=transposed)
    assert "eqdel_gemm" in str(jax.make_jaxpr(product)(x, stored))
    out = jax.jit(product)(x, stored)
    np.testing.assert_allclose(np.asarray(out), _float64_product(x, weight), rtol=1e-5, atol=1e-4)


@needs_openblas
@pytest.mark.parametrize("transposed", [False, True])
def test_openblas_products_differentiate_as_xlas(getkey, monkeypatch, transposed):
    x = jax.random.normal(getkey(), (40, 24), jnp.float32)
    weight = jax.random.normal(getkey(), (24, 56) if not transposed else (56, 24))

    def loss(x, weight):
        return jnp.sum(jnp.sin(matmul(x, weight, transposed=transposed)))

    def gradients():  # traced afresh for each route
        return jax.jit(lambda x, weight: jax.grad(loss, argnums=(0, 1))(x, weight))

    got = gradients()(x, weight)
    assert "eqdel_gemm" in gradients().lower(x, weight).as_text()
    monkeypatch.setattr(_few_rows, "gemm_usable", lambda rows, weight: False)
    assert "eqdel_gemm" not in gradients().lower(x, weight).as_text()
    want = gradients()(x, weight)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@needs_openblas
def test_the_dots_remat_policies_save_openblas_products(getkey):
    """Under a dots policy a layer's OpenBLAS product is saved for the backward pass, not
    recomputed; under `full` it is recomputed (the gradients are XLA's products)."""
    from eqdel.nn._stacked import REMAT_POLICIES

    x = jax.random.normal(getkey(), (32, 24), jnp.float32)
    weight = jax.random.normal(getkey(), (24, 24), jnp.float32)

    def products(policy: str) -> int:
        layer = jax.checkpoint(lambda x, w: jnp.sum(jnp.tanh(matmul(x, w)) ** 2), policy=policy)
        text = jax.jit(jax.value_and_grad(layer, argnums=(0, 1))).lower(x, weight).as_text()
        return text.count("custom_call @eqdel_gemm(")

    for name in ("dots_saveable", "checkpoint_dots", "dots_with_no_batch_dims_saveable"):
        assert products(REMAT_POLICIES[name]) == 1, name
    assert products(REMAT_POLICIES["full"]) == 2


@needs_openblas
def test_a_model_through_openblas_gives_xlas_logits_and_loss_gradient(monkeypatch):
    model = LlamaForCausalLM(TINY_LLAMA, key=jax.random.key(0))
    ids = jax.random.randint(jax.random.key(1), (2, 24), 0, TINY_LLAMA.vocab_size)

    def loss(model):
        logits = model(ids).logits
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits

    def run(model):  # a new function, so traced afresh for each route
        def fresh(model):
            return loss(model)

        return eqx.filter_jit(eqx.filter_value_and_grad(fresh, has_aux=True))(model)

    assert "eqdel_gemm" in str(eqx.filter_make_jaxpr(loss)(model)[0])
    (_, got_logits), got_grads = run(model)
    monkeypatch.setattr(_few_rows, "gemm_usable", lambda rows, weight: False)
    monkeypatch.setattr(_few_rows, "batched_gemm_usable", lambda a, b: False)
    assert "eqdel_gemm" not in str(eqx.filter_make_jaxpr(loss)(model)[0])
    (_, want_logits), want_grads = run(model)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6)


@needs_openblas
@pytest.mark.parametrize("case", [(2, 24, 6, 2, 16, 40, 0), (1, 9, 4, 4, 8, 9, 3)])
def test_prefill_attention_runs_through_openblas_unless_differentiated(getkey, monkeypatch, case):
    """Attention over more tokens than a decode step takes its two products through
    OpenBLAS, with XLA's output; differentiated, it is XLA's products throughout."""
    query, keys, values, mask = _attention_inputs(getkey(), *case)
    cotangent = jax.random.normal(getkey(), query.shape, jnp.float32)

    def programs():  # new functions, so traced afresh for each route
        def attend(query, keys, values):
            return vanilla_attention(query, keys, values, mask, scale=0.3)

        def loss(*operands):
            return jnp.sum(attend(*operands) * cotangent)

        return jax.jit(attend), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    attend, gradients = programs()
    operands = (query, keys, values)
    assert attend.lower(*operands).as_text().count("custom_call @eqdel_gemm(") == 2
    assert "eqdel_gemm" not in gradients.lower(*operands).as_text()
    got, got_gradients = attend(*operands), gradients(*operands)
    monkeypatch.setattr(_few_rows, "batched_gemm_usable", lambda a, b: False)
    attend, gradients = programs()
    assert "eqdel_gemm" not in attend.lower(*operands).as_text()
    np.testing.assert_allclose(np.asarray(got), np.asarray(attend(*operands)), atol=1e-5)
    for a, b in zip(got_gradients, gradients(*operands)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


def test_a_bfloat16_table_lookup_is_jnp_take(getkey):
    """Copied as stored, with negative ids counted from the end and ids outside the table
    giving NaN rows; differentiated, the gradient of XLA's gather."""
    embedding = Embedding(50, 24, dtype=jnp.bfloat16, key=getkey())
    ids = jnp.array([[0, 49, -1, -50], [-51, 50, 7, 7]])
    assert "eqdel_gather" in str(jax.make_jaxpr(lambda i: embedding(i))(ids))
    np.testing.assert_array_equal(
        np.asarray(eqx.filter_jit(embedding)(ids), np.float32),
        np.asarray(jnp.take(embedding.weight, ids, axis=0), np.float32),
    )

    def loss(rows):
        return jnp.sum(jnp.square(rows.astype(jnp.float32)))

    valid = ids[:, 2:]
    grad = jax.grad(lambda e: loss(e(valid)))(embedding).weight
    expected = jax.grad(lambda w: loss(jnp.take(w, valid, axis=0)))(embedding.weight)
    np.testing.assert_array_equal(np.asarray(grad, np.float32), np.asarray(expected, np.float32))
