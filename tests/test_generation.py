"""Generation against transformers, cached decoding against recomputation, sampling."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import make_hf_model, random_ids
from hypothesis import given, settings, strategies as st

import eqdel
from eqdel._generation import _prefill_logits
from eqdel._sampling import allowed_tokens

PAD = 0


def load(tmp_path, hf_model, **kwargs):
    hf_model.save_pretrained(tmp_path / "hf")
    return eqdel.from_pretrained(tmp_path / "hf", progress=False, **kwargs)


def left_padded_prompts(seed=2):
    ids = random_ids(3, 8, seed=seed)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    mask[2, :5] = 0
    ids[mask == 0] = PAD
    return ids, mask


def hf_generate(hf_model, ids, mask, new, eos=None):
    with torch.no_grad():
        return hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=PAD,
            eos_token_id=eos,
        ).numpy()


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [
        ("llama", {}),
        ("mistral", {"sliding_window": 5}),
        ("qwen2", {}),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}),
        ("qwen3", {"head_dim": 16}),
        ("phi3", {"pad_token_id": 0, "sliding_window": 5}),
        ("gemma", {"head_dim": 16}),
        ("gemma2", {"head_dim": 16, "sliding_window": 4, "final_logit_softcapping": 3.0}),
    ],
)
def test_greedy_matches_transformers_on_left_padded_batch(model_type, overrides, tmp_path):
    hf_model = make_hf_model(model_type, **overrides)
    model = load(tmp_path, hf_model)
    ids, mask = left_padded_prompts()
    new = 14  # 22 tokens in all: well past the sliding windows
    want = hf_generate(hf_model, ids, mask, new)
    got = eqdel.generate(
        model,
        jnp.asarray(ids),
        jnp.asarray(mask),
        max_new_tokens=new,
        eos_token_id=[],
        pad_token_id=PAD,
    )
    np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize(
    ("model_type", "overrides"), [("qwen2", {}), ("phi3", {"pad_token_id": 0})]
)
def test_generation_form_fuses_projections_and_generates_the_same(model_type, overrides, tmp_path):
    hf_model = make_hf_model(model_type, **overrides)
    model = load(tmp_path, hf_model)
    prepared = model.for_generation()
    layer = prepared.model.layers[0]
    assert isinstance(prepared.model.layers, tuple)
    assert layer.self_attn.q_proj is None and layer.self_attn.qkv_proj is not None
    assert (layer.self_attn.qkv_proj.bias is not None) == (model_type == "qwen2")
    assert layer.mlp.gate_proj is None and layer.mlp.gate_up_proj is not None
    # Already in that form: nothing is copied again.
    for a, b in zip(jax.tree.leaves(prepared.for_generation()), jax.tree.leaves(prepared)):
        assert a is b
    ids, mask = left_padded_prompts()
    call = jax.jit(lambda m: m(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)
    np.testing.assert_allclose(call(prepared), call(model), rtol=0, atol=1e-6)
    args = dict(max_new_tokens=10, eos_token_id=[], pad_token_id=PAD)
    got = eqdel.generate(prepared, jnp.asarray(ids), jnp.asarray(mask), **args)
    np.testing.assert_array_equal(np.asarray(got), hf_generate(hf_model, ids, mask, 10))
    streamed = eqdel.stream_generate(prepared, jnp.asarray(ids), jnp.asarray(mask), **args)
    np.testing.assert_array_equal(np.stack(list(streamed), axis=1), np.asarray(got)[:, 8:])


def test_generation_form_leaves_quantized_and_adapted_projections(tmp_path, getkey):
    model = load(tmp_path, make_hf_model("llama"))
    quantized = eqdel.quantize(model, 8).for_generation().model.layers[0]
    assert quantized.self_attn.qkv_proj is None and quantized.mlp.gate_up_proj is None
    adapted = eqdel.apply_lora(model, 2, 4.0, ("q_proj",), key=getkey())
    layer = adapted.for_generation().model.layers[0]
    assert layer.self_attn.qkv_proj is None and type(layer.self_attn.q_proj) is eqdel.LoRALinear
    assert layer.mlp.gate_up_proj is not None  # not adapted, so fused


def test_end_token_stops_rows_and_pads(tmp_path):
    hf_model = make_hf_model("llama")
    model = load(tmp_path, hf_model)
    ids, mask = left_padded_prompts(seed=4)
    free = hf_generate(hf_model, ids, mask, 10)
    eos = [int(free[0, 8 + 2]), int(free[1, 8 + 4])]  # row 0 ends at step 3, row 1 by step 5
    want = hf_generate(hf_model, ids, mask, 10, eos=eos)
    got = np.asarray(
        eqdel.generate(
            model,
            jnp.asarray(ids),
            jnp.asarray(mask),
            max_new_tokens=10,
            eos_token_id=eos,
            pad_token_id=PAD,
        )
    )
    assert got.shape == (3, 18)
    np.testing.assert_array_equal(got[:, : want.shape[1]], want)
    assert (got[:, want.shape[1] :] == PAD).all()
    assert got[0, 8 + 2] == eos[0] and (got[0, 8 + 3 :] == PAD).all()


def test_cached_decoding_equals_recomputation(tmp_path):
    hf_model = make_hf_model("mistral", sliding_window=4)
    model = load(tmp_path, hf_model)
    ids, mask = left_padded_prompts()
    kwargs = model.prepare_inputs_for_generation(jnp.asarray(ids), 16, jnp.asarray(mask))
    step = jax.jit(lambda m, i, kw: m(i, **kw))
    out = step(model, jnp.asarray(ids), kwargs)
    sequence, full_mask = ids, mask
    for _ in range(6):
        token = np.asarray(jnp.argmax(out.logits[:, -1], axis=-1))[:, None]
        sequence = np.concatenate([sequence, token], axis=1)
        full_mask = np.concatenate([full_mask, np.ones_like(token)], axis=1)
        kwargs = model.update_inputs_for_generation(out, kwargs)
        out = step(model, jnp.asarray(token), kwargs)
        positions = np.maximum(np.cumsum(full_mask, axis=1) - 1, 0)
        full = model(
            jnp.asarray(sequence),
            attention_mask=jnp.asarray(full_mask),
            position_ids=jnp.asarray(positions),
        )
        np.testing.assert_allclose(
            np.asarray(out.logits[:, -1]), np.asarray(full.logits[:, -1]), rtol=0, atol=1e-5
        )


def test_generation_on_mesh_equals_single_device(tmp_path):
    hf_model = make_hf_model("llama")
    single = load(tmp_path, hf_model)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.from_pretrained(tmp_path / "hf", sharding=cfg, progress=False)
    ids, mask = left_padded_prompts()
    ids, mask = np.concatenate([ids, ids[:1]]), np.concatenate([mask, mask[:1]])  # batch 4
    cache = eqdel.shard(sharded.init_cache(4, 20), cfg, mode=eqdel.axes.MODE_DECODE)
    assert cache.layers.keys.sharding.spec == jax.sharding.PartitionSpec(
        None, ("dp", "fsdp"), "sp", "tp", None
    )
    # The prefill makes the last position's logits alone on one device, every
    # position's on the mesh.
    assert (_prefill_logits(single), _prefill_logits(sharded)) == (1, 0)
    args = dict(max_new_tokens=8, eos_token_id=[], pad_token_id=PAD)
    want = eqdel.generate(single, jnp.asarray(ids), jnp.asarray(mask), **args)
    got = eqdel.generate(sharded, jnp.asarray(ids), jnp.asarray(mask), **args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    sampled = dict(args, do_sample=True, top_k=8, key=jax.random.key(3))
    np.testing.assert_array_equal(
        np.asarray(eqdel.generate(sharded, jnp.asarray(ids), jnp.asarray(mask), **sampled)),
        np.asarray(eqdel.generate(single, jnp.asarray(ids), jnp.asarray(mask), **sampled)),
    )


def test_sampling_is_reproducible_and_streams(tmp_path):
    model = load(tmp_path, make_hf_model("llama"))
    ids, mask = map(jnp.asarray, left_padded_prompts())
    args = dict(max_new_tokens=6, do_sample=True, temperature=0.8, top_p=0.9, eos_token_id=[])
    a = eqdel.generate(model, ids, mask, key=jax.random.key(7), **args)
    b = eqdel.generate(model, ids, mask, key=jax.random.key(7), **args)
    c = eqdel.generate(model, ids, mask, key=jax.random.key(8), **args)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    streamed = list(eqdel.stream_generate(model, ids, mask, key=jax.random.key(7), **args))
    assert len(streamed) == 6
    np.testing.assert_array_equal(np.stack(streamed, axis=1), np.asarray(a)[:, 8:])


def test_tiny_temperature_equals_greedy(tmp_path):
    model = load(tmp_path, make_hf_model("llama"))
    ids, mask = map(jnp.asarray, left_padded_prompts())
    greedy = eqdel.generate(model, ids, mask, max_new_tokens=6, eos_token_id=[])
    for temperature in (0.0, 1e-4):
        sampled = eqdel.generate(
            model,
            ids,
            mask,
            max_new_tokens=6,
            do_sample=True,
            temperature=temperature,
            eos_token_id=[],
            key=jax.random.key(1),
        )
        np.testing.assert_array_equal(np.asarray(sampled), np.asarray(greedy))


def _reference_allowed(logits: np.ndarray, top_k: int, top_p: float, min_p: float):
    keep = np.ones(logits.shape, bool)
    if 0 < top_k < logits.size:
        keep &= logits >= np.sort(logits)[-top_k]
    if top_p < 1.0:
        masked = np.where(keep, logits, -np.inf)
        probs = np.exp(masked - masked.max())
        probs /= probs.sum()
        order = np.argsort(-masked, kind="stable")
        mass_before = np.cumsum(probs[order]) - probs[order]
        kept = np.zeros_like(keep)
        kept[order[mass_before < top_p]] = True
        keep &= kept
    if min_p > 0.0:
        masked = np.where(keep, logits, -np.inf)
        probs = np.exp(masked - masked.max())
        probs /= probs.sum()
        keep &= probs >= min_p * probs.max()
    return keep


@settings(max_examples=40, deadline=None)
@given(
    # Distinct as float32 and never subnormal: XLA flushes subnormals to zero, which
    # would tie them with 0.0 where NumPy keeps them apart.
    logits=st.lists(
        st.floats(-4, 4, width=32, allow_subnormal=False), min_size=12, max_size=12, unique=True
    ),
    top_k=st.integers(0, 12),
    top_p=st.floats(0.05, 1.0),
    min_p=st.floats(0.0, 0.5),
    seed=st.integers(0, 2**16),
)
def test_samples_never_leave_the_allowed_set(logits, top_k, top_p, min_p, seed):
    config = eqdel.GenerationConfig(do_sample=True, top_k=top_k, top_p=top_p, min_p=min_p)
    row = np.asarray(logits, np.float32)
    allowed = np.asarray(allowed_tokens(jnp.asarray(row)[None], config))[0]
    np.testing.assert_array_equal(allowed, _reference_allowed(row, top_k, top_p, min_p))
    assert allowed[np.argmax(row)]
    from eqdel._sampling import next_tokens

    batch = jnp.broadcast_to(jnp.asarray(row), (256, row.size))
    seen = jnp.zeros(batch.shape, bool)
    picks = np.asarray(next_tokens(batch, seen, config, jax.random.key(seed)))
    assert allowed[picks].all()


def test_repetition_penalty_matches_transformers(tmp_path):
    hf_model = make_hf_model("llama")
    model = load(tmp_path, hf_model)
    ids, mask = left_padded_prompts()
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor(ids),
            attention_mask=torch.tensor(mask),
            max_new_tokens=10,
            do_sample=False,
            repetition_penalty=1.8,
            pad_token_id=PAD,
            eos_token_id=None,
        ).numpy()
    got = eqdel.generate(
        model,
        jnp.asarray(ids),
        jnp.asarray(mask),
        max_new_tokens=10,
        repetition_penalty=1.8,
        eos_token_id=[],
        pad_token_id=PAD,
    )
    np.testing.assert_array_equal(np.asarray(got), want)


def test_generation_config_reads_hf_and_rejects_bad_values(tmp_path):
    (tmp_path / "generation_config.json").write_text(
        '{"do_sample": true, "temperature": 0.7, "top_p": 0.9, "eos_token_id": [2, 7],'
        ' "top_k": null, "transformers_version": "5"}'
    )
    config = eqdel.GenerationConfig.from_pretrained(tmp_path, max_new_tokens=5)
    assert (config.do_sample, config.temperature, config.top_p) == (True, 0.7, 0.9)
    assert config.eos_token_id == (2, 7) and config.top_k == 0 and config.max_new_tokens == 5
    for bad, message in [
        (dict(top_p=0.0), "top_p must be in"),
        (dict(temperature=-1.0), "temperature must be >= 0"),
        (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be positive"),
    ]:
        with pytest.raises(ValueError, match=message):
            eqdel.GenerationConfig(**bad)


@pytest.mark.parametrize(
    ("model_type", "overrides"),
    [("llama", {}), ("mistral", {"sliding_window": 5}), ("qwen2", {})],
)
def test_int8_cache_matches_float_cache(model_type, overrides, tmp_path):
    hf_model = make_hf_model(model_type, **overrides)
    model = load(tmp_path, hf_model)
    quantized = eqdel.from_pretrained(tmp_path / "hf", progress=False, quantize_kv_cache=True)
    ids, mask = map(jnp.asarray, left_padded_prompts())
    args = dict(max_new_tokens=14, eos_token_id=[], pad_token_id=PAD)
    np.testing.assert_array_equal(
        np.asarray(eqdel.generate(quantized, ids, mask, **args)),
        np.asarray(eqdel.generate(model, ids, mask, **args)),
    )
    # One decode step on top of a prefilled cache: logits within 2e-3 of the float cache
    # (measured: at most 6.5e-4 on these models, whose logits reach about 0.37).
    float_kwargs = model.prepare_inputs_for_generation(ids, 24, mask)
    int8_kwargs = quantized.prepare_inputs_for_generation(ids, 24, mask)
    assert int8_kwargs["cache"].layers.keys.dtype == jnp.int8
    float_out, int8_out = model(ids, **float_kwargs), quantized(ids, **int8_kwargs)
    token = jnp.argmax(float_out.logits[:, -1], axis=-1)[:, None]
    float_out = model(token, **model.update_inputs_for_generation(float_out, float_kwargs))
    int8_out = quantized(token, **quantized.update_inputs_for_generation(int8_out, int8_kwargs))
    difference = float(jnp.max(jnp.abs(float_out.logits - int8_out.logits)))
    assert 0 < difference < 2e-3


def test_int8_cache_memory(getkey):
    config = eqdel.models.LlamaConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
    )
    model = eqdel.models.LlamaForCausalLM(config, key=getkey())
    full = model.init_cache(2, 256)
    int8 = model.init_cache(2, 256, quantize=True)
    slots = 2 * 2 * 256 * 2  # layers * batch * length * kv heads
    assert full.nbytes == 2 * slots * 128 * 4 + 2 * 256 + 4  # + valid mask + length
    assert int8.nbytes == 2 * slots * (128 + 4) + 2 * 256 + 4
    assert int8.nbytes / full.nbytes < 0.26  # (128 + 4) / (4 * 128) per slot
