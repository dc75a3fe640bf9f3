"""Weight quantization: int8 and NF4 modules, agreement with the float model, memory,
sharding, generation, dequantization, QLoRA and clear errors."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_reference import random_ids
from tiny import WORD_LLAMA, corpus_file, train_tokenizer

import eqdel
from eqdel._gptq import GPTQ_DAMPING, gptq_round, input_grams
from eqdel._paths import get_path
from eqdel._quant import (
    NF4_LEVELS,
    _same_inputs,
    fitted_nf4_scales,
    int4_values,
    int8_scales,
    int8_values,
    nf4_codes,
    nf4_scales,
    nf4_values,
    per_input,
)
from eqdel.models import LlamaForCausalLM
from eqdel.nn import Linear
from eqdel.train import batches, causal_lm_loss, init_train_state, make_train_step, pack, tokenize


@pytest.fixture(scope="module")
def trained():
    """The demo's tiny Llama after 60 steps on the embedded corpus: random weights give
    near-uniform logits, where top-1 agreement measures only ties."""
    texts = corpus_file().read_text().splitlines()
    tokenizer = train_tokenizer(texts, 512)
    config = dataclasses.replace(WORD_LLAMA, vocab_size=tokenizer.get_vocab_size())
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    optimizer = optax.adamw(3e-3)
    state = init_train_state(model, optimizer, jax.random.key(1))
    step = make_train_step(causal_lm_loss, optimizer)
    data = batches(pack(tokenize(texts, tokenizer), 32, eos_token_id=1), 8, seed=0)
    for _ in range(60):
        state, _ = step(state, next(data))
    return state.model


def agreement_and_kl(model, quantized, ids):
    forward = jax.jit(lambda m: m(ids).logits)
    want, got = forward(model), forward(quantized)
    log_p, log_q = jax.nn.log_softmax(want), jax.nn.log_softmax(got)
    kl = jnp.mean(jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1))
    return float(jnp.mean(want.argmax(-1) == got.argmax(-1))), float(kl)


def linear_bytes(model) -> int:
    layers = eqx.filter(model.model.layers, eqx.is_array)
    return sum(x.nbytes for x in jax.tree.leaves(layers) if x.ndim >= 3)


def test_int8_agrees_with_float_and_takes_a_quarter(trained):
    ids = jnp.asarray(random_ids(16, 32, vocab=trained.config.vocab_size, seed=2))
    quantized = eqdel.quantize(trained, 8)
    agreement, kl = agreement_and_kl(trained, quantized, ids)
    assert agreement >= 0.99 and kl < 1e-3
    assert isinstance(quantized.model.layers.self_attn.q_proj, eqdel.Int8Linear)
    assert quantized.model.layers.self_attn.q_proj.codes.dtype == jnp.int8
    assert isinstance(quantized.lm_head, Linear)  # the head and embeddings stay float
    # int8 codes plus one float32 scale per output channel of each layer
    assert linear_bytes(quantized) / linear_bytes(trained) == pytest.approx(0.25, abs=0.01)


def test_nf4_codes_round_trip_and_take_an_eighth_plus_scales(trained):
    layer = Linear(256, 96, axes=(None, None), key=jax.random.key(0))
    nf4 = eqdel.NF4Linear(layer, group_size=64)
    assert nf4.codes.shape == (128, 96) and nf4.codes.dtype == jnp.uint8
    assert nf4.scales.shape == (4, 96)
    error = nf4.weight(jnp.float32) - layer.weight
    assert float(jnp.sqrt(jnp.mean(error**2) / jnp.mean(layer.weight**2))) < 0.1
    quantized = eqdel.quantize(trained, 4, group_size=32)
    ratio = linear_bytes(quantized) / linear_bytes(trained)
    assert ratio == pytest.approx(1 / 8 + 1 / 32, abs=0.01)  # codes, and a scale per 32
    ids = jnp.asarray(random_ids(16, 32, vocab=trained.config.vocab_size, seed=2))
    _, kl = agreement_and_kl(trained, quantized, ids)
    assert kl < 0.05


def test_nf4_codes_are_the_nearest_levels():
    levels = np.asarray(NF4_LEVELS, np.float32)
    w = jax.random.normal(jax.random.key(0), (300, 70)) * 0.6
    want = np.abs(np.asarray(w)[..., None] - levels).argmin(-1)
    np.testing.assert_array_equal(nf4_codes(w, jnp.float32(1.0)), want)
    np.testing.assert_array_equal(nf4_codes(jnp.asarray(levels), jnp.float32(1.0)), np.arange(16))


def test_nf4_values_are_the_levels_of_the_codes():
    w = jax.random.normal(jax.random.key(3), (300, 70)) * 0.6
    scales = jax.random.uniform(jax.random.key(4), (1, 70), minval=0.2, maxval=1.0)
    codes = np.asarray(nf4_codes(w, scales))
    want = np.asarray(NF4_LEVELS, np.float32)[codes] * np.asarray(scales)
    np.testing.assert_array_equal(nf4_values(w, scales), want)


def block_errors(w, scales, importance, group_size):
    error = importance[:, None] * (w - nf4_values(w, per_input(scales, group_size, len(w)))) ** 2
    return error.reshape(-1, group_size, w.shape[-1]).sum(1)


@pytest.mark.parametrize("weighted", [False, True])
def test_fitted_nf4_scales_round_every_block_at_least_as_well(weighted):
    w = jax.random.t(jax.random.key(0), 4.0, (128, 48))  # heavy tails, as trained weights
    importance = jax.random.exponential(jax.random.key(1), (128,)) if weighted else None
    fitted = fitted_nf4_scales(w, 16, importance)
    absmax = nf4_scales(w, 16)
    assert bool(jnp.all((fitted <= absmax) & (fitted >= 0.5 * absmax - 1e-6)))
    weights = jnp.ones(128) if importance is None else importance
    fitted_error = block_errors(w, fitted, weights, 16)
    absmax_error = block_errors(w, absmax, weights, 16)
    assert bool(jnp.all(fitted_error <= absmax_error * (1 + 1e-6)))
    assert float(fitted_error.sum()) < 0.95 * float(absmax_error.sum())
    if weighted:  # the importance changes the choice, for the better
        unweighted = block_errors(w, fitted_nf4_scales(w, 16), weights, 16)
        assert float(fitted_error.sum()) < 0.95 * float(unweighted.sum())


@pytest.fixture(scope="module")
def sampled_prompts(trained):
    """Text the model itself writes (temperature 1 from random first tokens): prompts
    like the ones it will be given, unlike uniformly random ids, where its top choices
    are near ties."""
    starts = jnp.asarray(random_ids(16, 1, vocab=trained.config.vocab_size, seed=3))
    return eqdel.generate(
        trained, starts, max_new_tokens=31, do_sample=True, temperature=1.0, key=jax.random.key(5)
    )


def test_input_grams_sum_each_layers_inputs(trained):
    ids = jnp.asarray(random_ids(4, 16, vocab=trained.config.vocab_size, seed=4))
    paths = [("model", "layers", "self_attn", "q_proj"), ("model", "layers", "mlp", "up_proj")]
    q_gram, up_gram = input_grams(trained, paths, ids)
    assert q_gram.shape == up_gram.shape == (4, 64, 64)
    states = trained(ids, output_hidden_states=True).hidden_states
    for i in range(4):
        layer = jax.tree.map(lambda x, i=i: x[i], trained.model.layers)
        x = layer.input_layernorm(states[i]).reshape(-1, 64)
        np.testing.assert_allclose(q_gram[i], x.T @ x, rtol=1e-5, atol=1e-4)
    assert not np.allclose(q_gram, up_gram)  # the MLP reads the post-attention norm


@pytest.mark.parametrize("scheme", ["int8", "int8 in groups", "nf4", "int4"])
def test_gptq_rounding_lowers_output_error_and_stays_on_the_grid(scheme):
    rng = np.random.RandomState(0)
    mixing = rng.randn(64, 64) * rng.exponential(1.0, 64)  # correlated, uneven inputs
    x = jnp.asarray(rng.randn(512, 64) @ mixing, jnp.float32)
    layer = Linear(64, 32, axes=(None, None), key=jax.random.key(1))
    if scheme == "int8":
        nearest = eqdel.Int8Linear(layer)
        scales, group_size = nearest.scales[None, :], 64
        values, build = int8_values, lambda lin: eqdel.Int8Linear(lin, nearest.scales)
    elif scheme == "int8 in groups":
        nearest = eqdel.Int8Linear(layer, group_size=16)
        scales, group_size = nearest.scales, 16
        values, build = int8_values, lambda lin: eqdel.Int8Linear(lin, nearest.scales, 16)
    elif scheme == "int4":
        nearest = eqdel.Int4Linear(layer, 16)
        ranges = (nearest.scales, nearest.offsets)
        scales, group_size = ranges, 16
        values, build = int4_values, lambda lin: eqdel.Int4Linear(lin, 16, ranges)
    else:
        nearest = eqdel.NF4Linear(layer, 16)
        scales, group_size = nearest.scales, 16
        values, build = nf4_values, lambda lin: eqdel.NF4Linear(lin, 16, nearest.scales)
    rounded = gptq_round(layer.weight, x.T @ x, scales, group_size, values)
    again = build(eqx.tree_at(lambda m: m.weight, layer, rounded))
    # On the grid: rounding again gives every value back (int4's `code * scale + offset`
    # may round differently where it is fused into one multiply-add: by 1e-8, where codes
    # are 1e-3 apart).
    atol = 1e-6 * float(jnp.abs(rounded).max()) if scheme == "int4" else 0
    np.testing.assert_allclose(again.weight(jnp.float32), rounded, rtol=0, atol=atol)

    def output_error(w):
        return float(jnp.linalg.norm(x @ (w - layer.weight)))

    assert output_error(rounded) < 0.8 * output_error(nearest.weight(jnp.float32))


def _gptq_one_row_at_a_time(weight, gram, scales, values, damping=GPTQ_DAMPING):
    """GPTQ as the paper states it, in float64: round input rows in order of activity,
    each row's error spread over every row after it at once."""
    weight, gram, scales = (np.asarray(a, np.float64) for a in (weight, gram, scales))
    order = np.argsort(-np.diagonal(gram), kind="stable")
    hessian = gram[order][:, order]
    hessian += damping * np.mean(np.diagonal(hessian)) * np.eye(len(hessian))
    factor = np.linalg.cholesky(np.linalg.inv(hessian)).T
    w, rounded = weight[order].copy(), np.zeros_like(weight)
    for i in range(len(w)):
        q = np.asarray(values(jnp.asarray(w[i], jnp.float32), jnp.asarray(scales[order][i])))
        rounded[i] = q
        w[i + 1 :] -= np.outer(factor[i, i + 1 :], (w[i] - q) / factor[i, i])
    return rounded[np.argsort(order)]


@pytest.mark.parametrize("n_in", [256, 300, 257])  # blocks of 32, of 30, of one row
def test_gptq_in_blocks_equals_one_row_at_a_time(n_in):
    rng = np.random.RandomState(1)
    x = rng.randn(4 * n_in, n_in) @ (rng.randn(n_in, n_in) * rng.exponential(1.0, n_in))
    gram = jnp.asarray(x.T @ x, jnp.float32)
    weight = jnp.asarray(rng.randn(n_in, 24) * 0.05, jnp.float32)
    scales = int8_scales(weight)[None, :]
    ours = np.asarray(gptq_round(weight, gram, scales, n_in, int8_values))
    per_weight = jnp.broadcast_to(scales, weight.shape)
    reference = _gptq_one_row_at_a_time(weight, gram, per_weight, int8_values)
    # The same rounding, but for the rare value float32 leaves within rounding of a tie.
    assert np.mean(ours == reference) > 0.995
    error = lambda w: np.linalg.norm(x @ (w - np.asarray(weight)))  # noqa: E731
    assert error(ours) == pytest.approx(error(reference), rel=0.01)


def test_gptq_rounds_layers_that_read_the_same_inputs_together(trained):
    calibration = jnp.asarray(random_ids(8, 16, vocab=trained.config.vocab_size, seed=13))
    names = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    paths = [("model", "layers", "self_attn", n) for n in names[:4]]
    paths += [("model", "layers", "mlp", n) for n in names[4:]]
    layers = [get_path(trained, p) for p in paths]
    grams = input_grams(trained, paths, calibration)
    assert _same_inputs(layers, grams) == [[0, 1, 2], [3], [4, 5], [6]]
    # Each output column rounds on its own: together or alone, the same codes.
    quantized = eqdel.quantize(trained, 8, calibration=calibration, progress=False)
    for path, layer, gram in zip(paths, layers, grams):
        scales = int8_scales(layer.weight)
        n_in = layer.weight.shape[-2]
        alone = gptq_round(layer.weight, gram, scales[..., None, :], n_in, int8_values)
        together = get_path(quantized, path).weight(jnp.float32)
        assert np.mean(np.asarray(together) == np.asarray(alone)) > 0.999, path


def test_calibrated_quantization_agrees_better(trained, sampled_prompts):
    calibration = jnp.asarray(random_ids(64, 32, vocab=trained.config.vocab_size, seed=11))
    random_prompts = jnp.asarray(random_ids(16, 32, vocab=trained.config.vocab_size, seed=2))
    nearest = eqdel.quantize(trained, 4, group_size=16)
    calibrated = eqdel.quantize(trained, 4, group_size=16, calibration=calibration)
    assert isinstance(calibrated.model.layers.mlp.down_proj, eqdel.NF4Linear)
    for prompts in (random_prompts, sampled_prompts):
        _, kl_nearest = agreement_and_kl(trained, nearest, prompts)
        _, kl_calibrated = agreement_and_kl(trained, calibrated, prompts)
        assert kl_calibrated < 0.85 * kl_nearest
    agreement, _ = agreement_and_kl(trained, calibrated, sampled_prompts)
    assert agreement >= 0.95
    int8 = eqdel.quantize(trained, 8, calibration=calibration)
    assert agreement_and_kl(trained, int8, sampled_prompts)[0] >= 0.99


def test_calibrated_quantization_of_a_sharded_model_is_the_same(trained):
    calibration = jnp.asarray(random_ids(8, 16, vocab=trained.config.vocab_size, seed=12))
    want = eqdel.quantize(trained, 4, group_size=16, calibration=calibration)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    paths = [("model", "layers", "mlp", "down_proj")]
    with cfg.activate():
        sharded = eqdel.shard(trained, cfg)
        got = eqdel.quantize(sharded, 4, group_size=16, calibration=calibration)
        (gram,) = input_grams(sharded, paths, calibration)
    (unsharded,) = input_grams(trained, paths, calibration)
    scale = float(jnp.abs(unsharded).max())
    np.testing.assert_allclose(gram, unsharded, rtol=1e-5, atol=1e-6 * scale)
    codes = got.model.layers.self_attn.q_proj.codes
    assert codes.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "sp"), "tp")
    # Sums over devices round differently, which may tip a code sitting on a tie.
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.mean(np.asarray(a) != np.asarray(b)) < 1e-3


SCHEMES = [(8, None, None), (8, None, 32), (4, "nf4", 32), (4, "int4", 32)]


@pytest.mark.parametrize(("bits", "scheme", "group_size"), SCHEMES)
def test_quantized_models_shard_generate_and_dequantize(trained, bits, scheme, group_size):
    quantized = eqdel.quantize(trained, bits, scheme=scheme, group_size=group_size)
    ids = jnp.asarray(random_ids(4, 8, vocab=trained.config.vocab_size))
    forward = jax.jit(lambda m: m(ids).logits)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.shard(quantized, cfg)
    codes = sharded.model.layers.self_attn.q_proj.codes
    assert codes.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "sp"), "tp")
    want = forward(quantized)
    # Sums over devices round in another order; this trained model's logits reach about
    # 8, where float32's spacing is 1e-6, so the bound is a few ulps of the largest logit.
    scale = float(jnp.abs(want).max())
    np.testing.assert_allclose(forward(sharded), want, atol=2e-6 * scale, rtol=0)
    # int4's `code * scale + offset` rounds once where the compiler fuses it into one
    # multiply-add and twice where it does not, so the dequantised weights may differ from
    # those inside the compiled forward pass in their last bit.
    atol = 2e-6 * scale if scheme == "int4" else 0
    np.testing.assert_allclose(
        forward(eqdel.dequantize(quantized)), forward(quantized), atol=atol, rtol=0
    )
    tokens = eqdel.generate(sharded, ids[:, :5], max_new_tokens=6)
    np.testing.assert_array_equal(tokens, eqdel.generate(quantized, ids[:, :5], max_new_tokens=6))


def test_dequantize_reaches_the_layers_of_the_generation_form(trained):
    quantized = eqdel.quantize(trained, 8)
    ids = jnp.asarray(random_ids(2, 6, vocab=trained.config.vocab_size))
    plain = eqdel.dequantize(quantized.for_generation())
    assert not any(
        isinstance(leaf, jax.Array) and leaf.dtype == jnp.int8 for leaf in jax.tree.leaves(plain)
    )
    np.testing.assert_array_equal(
        plain(ids).logits, eqdel.dequantize(quantized).for_generation()(ids).logits
    )


@pytest.mark.parametrize("scheme", ["nf4", "int4"])
def test_qlora_trains_adapters_on_a_frozen_quantized_base(trained, scheme):
    quantized = eqdel.quantize(trained, 4, scheme=scheme, group_size=32)
    model = eqdel.apply_lora(quantized, 4, 8.0, ("q_proj", "v_proj"), key=jax.random.key(3))
    trainable = eqdel.lora_filter(model)
    optimizer = optax.adamw(1e-2)
    state = init_train_state(model, optimizer, jax.random.key(4), trainable=trainable)
    step = make_train_step(causal_lm_loss, optimizer, trainable=trainable)
    batch = {"input_ids": jnp.asarray(random_ids(4, 16, vocab=model.config.vocab_size, seed=7))}
    losses = []
    for _ in range(20):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.8 * losses[0]
    base = state.model.model.layers.self_attn.q_proj.base
    np.testing.assert_array_equal(base.codes, quantized.model.layers.self_attn.q_proj.codes)
    ids = batch["input_ids"]
    merged = eqdel.merge_lora(state.model)
    np.testing.assert_allclose(merged(ids).logits, state.model(ids).logits, atol=1e-5, rtol=0)


def test_bad_quantization_requests_are_named(trained):
    with pytest.raises(ValueError, match=r"bits must be 8 .* or 4 .*, not 3"):
        eqdel.quantize(trained, 3)
    with pytest.raises(ValueError, match=r"group_size must be at least 1, not 0"):
        eqdel.quantize(trained, 4, group_size=0)
    with pytest.raises(ValueError, match=r"int4 group_size must be even, not 15"):
        eqdel.quantize(trained, 4, scheme="int4", group_size=15)
    with pytest.raises(ValueError, match=r"8-bit quantization is one of \('int8',\), not 'int4'"):
        eqdel.quantize(trained, 8, scheme="int4")
    with pytest.raises(ValueError, match="already quantized"):
        eqdel.quantize(eqdel.quantize(trained, 8), 8)
    with pytest.raises(ValueError, match="no quantized layers"):
        eqdel.dequantize(trained)


def _by_blocks(w: np.ndarray, group_size: int, rounded) -> np.ndarray:
    """`w` (numpy) with every block of `group_size` inputs (the last one partial) replaced
    by `rounded(block)`."""
    blocks = [w[start : start + group_size] for start in range(0, len(w), group_size)]
    return np.concatenate([rounded(block) for block in blocks])


@pytest.mark.parametrize(("n_in", "group_size"), [(100, 32), (61, 16), (61, 61), (64, 7)])
def test_nf4_takes_any_shape_with_a_last_partial_group(n_in, group_size):
    layer = Linear(n_in, 24, axes=(None, None), key=jax.random.key(5))
    w = np.asarray(layer.weight)
    levels = np.asarray(NF4_LEVELS, np.float32)

    def rounded(block):  # by the block's absolute maximum
        absmax = np.abs(block).max(0)
        return levels[np.abs(block[..., None] / absmax[:, None] - levels).argmin(-1)] * absmax

    want = _by_blocks(w, group_size, rounded)
    nf4 = eqdel.NF4Linear(layer, group_size)
    assert nf4.codes.shape == (-(-n_in // 2), 24)
    assert nf4.scales.shape == (-(-n_in // group_size), 24)
    np.testing.assert_allclose(nf4.weight(jnp.float32), want, rtol=1e-6, atol=0)


@pytest.mark.parametrize(("n_in", "group_size"), [(100, 32), (61, 16), (64, 7)])
def test_int8_in_groups_takes_any_shape_with_a_last_partial_group(n_in, group_size):
    layer = Linear(n_in, 24, axes=(None, None), key=jax.random.key(5))
    w = np.asarray(layer.weight)

    def rounded(block):  # by the block's absolute maximum over 127
        step = np.abs(block).max(0) / 127
        return np.round(block / step) * step

    want = _by_blocks(w, group_size, rounded)
    int8 = eqdel.Int8Linear(layer, group_size=group_size)
    assert int8.codes.shape == (n_in, 24) and int8.codes.dtype == jnp.int8
    assert int8.scales.shape == (-(-n_in // group_size), 24)
    np.testing.assert_allclose(int8.weight(jnp.float32), want, rtol=1e-6, atol=0)
    assert int8.weight(jnp.float32).shape == w.shape
    with pytest.raises(ValueError, match="int8 group_size must be at least 1, not 0"):
        eqdel.Int8Linear(layer, group_size=0)


@pytest.mark.parametrize(("n_in", "group_size"), [(100, 32), (61, 16), (62, 62), (64, 8)])
def test_int4_takes_any_shape_with_a_last_partial_group(n_in, group_size):
    layer = Linear(n_in, 24, axes=(None, None), key=jax.random.key(6))
    w = np.asarray(layer.weight)

    def rounded(block):  # from the block's minimum up
        low, step = block.min(0), (block.max(0) - block.min(0)) / 15
        return np.clip(np.round((block - low) / step), 0, 15) * step + low

    want = _by_blocks(w, group_size, rounded)
    int4 = eqdel.Int4Linear(layer, group_size)
    groups = -(-n_in // group_size)
    assert int4.codes.shape == (groups * group_size // 2, 24)
    assert int4.scales.shape == int4.offsets.shape == (groups, 24)
    np.testing.assert_allclose(int4.weight(jnp.float32), want, rtol=1e-6, atol=1e-7)
    x = jax.random.normal(jax.random.key(7), (3, 5, n_in))
    np.testing.assert_allclose(int4(x), x @ want, rtol=0, atol=1e-5)


def test_quantizing_layers_that_groups_do_not_divide_warns_and_round_trips(trained, tmp_path):
    warning = r"layers with 64 inputs: groups of 24 leave a last group of 16"
    with pytest.warns(UserWarning, match=warning):
        quantized = eqdel.quantize(trained, 4, group_size=24)
    eqdel.save_pretrained(quantized, tmp_path / "q")
    again = eqdel.from_pretrained(tmp_path / "q", progress=False)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(quantized), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("bits", "scheme", "group_size"), SCHEMES)
def test_quantized_save_load_round_trip_is_exact(trained, bits, scheme, group_size, tmp_path):
    import json

    quantized = eqdel.quantize(trained, bits, scheme=scheme, group_size=group_size)
    eqdel.save_pretrained(quantized, tmp_path / "q")
    recorded = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert recorded["quant_method"] == "eqdel" and recorded["bits"] == bits
    assert recorded["scheme"] == (scheme or "int8") and recorded["group_size"] == group_size
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    for sharding in (None, cfg):
        again = eqdel.from_pretrained(tmp_path / "q", sharding=sharding, progress=False)
        assert type(again.model.layers.mlp.up_proj) is type(quantized.model.layers.mlp.up_proj)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(quantized), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    recorded["quant_method"] = "gptq"
    config = json.loads((tmp_path / "q" / "config.json").read_text())
    config["quantization_config"] = recorded
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization 'gptq' is not supported"):
        eqdel.from_pretrained(tmp_path / "q", progress=False)


def test_int8_embeddings_round_each_group_of_a_row(trained):
    """`embeddings=True`: the token table as int8 codes with a scale per 32 entries of a
    row, each entry within half a step of its float value; alone with `targets=[]`."""
    quantized = eqdel.quantize(trained, 8, embeddings=True)
    table = quantized.model.embed_tokens
    assert isinstance(table, eqdel.Int8Embedding) and table.codes.dtype == jnp.int8
    assert isinstance(quantized.model.layers.self_attn.q_proj, eqdel.Int8Linear)
    vocab, embed = trained.model.embed_tokens.weight.shape
    assert table.scales.shape == (vocab, embed // 32)
    error = jnp.abs(table.weight(jnp.float32) - trained.model.embed_tokens.weight)
    steps = jnp.repeat(table.scales, 32, axis=-1)
    assert bool(jnp.all(error <= steps / 2 * (1 + 1e-6)))
    ids = jnp.asarray(random_ids(16, 32, vocab=vocab, seed=2))
    agreement, kl = agreement_and_kl(trained, quantized, ids)
    assert agreement >= 0.99 and kl < 1e-3
    only = eqdel.quantize(trained, 8, targets=[], embeddings=True)
    assert isinstance(only.model.embed_tokens, eqdel.Int8Embedding)
    assert isinstance(only.model.layers.self_attn.q_proj, Linear)
    with pytest.raises(ValueError, match="already quantized"):
        eqdel.quantize(only, 8)


def test_int8_embeddings_feed_a_tied_head_save_load_and_dequantize(trained, tmp_path):
    import json

    config = dataclasses.replace(trained.config, tie_word_embeddings=True)
    tied = LlamaForCausalLM(config, key=jax.random.key(3))
    quantized = eqdel.quantize(tied, 4, scheme="int4", group_size=32, embeddings=True)
    assert (
        tied.lm_head is None and quantized.get_output_embeddings() is quantized.model.embed_tokens
    )
    ids = jnp.asarray(random_ids(4, 8, vocab=config.vocab_size))
    forward = jax.jit(lambda m: m(ids).logits)
    plain = eqdel.dequantize(quantized)
    assert type(plain.model.embed_tokens) is eqdel.nn.Embedding
    scale = float(jnp.abs(forward(quantized)).max())
    np.testing.assert_allclose(forward(plain), forward(quantized), atol=2e-6 * scale, rtol=0)
    tokens = eqdel.generate(quantized, ids[:, :5], max_new_tokens=6)
    np.testing.assert_array_equal(tokens, eqdel.generate(plain, ids[:, :5], max_new_tokens=6))

    eqdel.save_pretrained(quantized, tmp_path / "q")
    recorded = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert recorded["embedding_group_size"] == 32 and recorded["scheme"] == "int4"
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    for sharding in (None, cfg):
        again = eqdel.from_pretrained(tmp_path / "q", sharding=sharding, progress=False)
        assert isinstance(again.model.embed_tokens, eqdel.Int8Embedding)
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(quantized), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    assert again.model.embed_tokens.codes.sharding.spec != (None, None)
