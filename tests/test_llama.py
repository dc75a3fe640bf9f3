"""The Llama family against transformers: logits, round trips, sharding."""

import dataclasses

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import transformers
from hf_reference import hf_logits, make_hf_model, random_ids
from jax.sharding import NamedSharding

import eqdel
from eqdel.models import LlamaConfig, LlamaForCausalLM

TOL = 1e-5

ROPE_CASES = {
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    },
    "longrope": {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0, 1.1, 1.2, 1.3],
        "long_factor": [1.5, 2.0, 2.5, 3.0],
        "original_max_position_embeddings": 8,
    },
}

CASES = {
    "llama-mha": ("llama", dict(num_key_value_heads=4)),
    "llama-gqa-tied": ("llama", dict(tie_word_embeddings=True)),
    "llama-head-dim": ("llama", dict(head_dim=16)),
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "llama-mqa-gelu": ("llama", dict(num_key_value_heads=1, hidden_act="gelu_pytorch_tanh")),
    **{
        f"llama-rope-{name}": ("llama", dict(rope_parameters=params, max_position_embeddings=8))
        for name, params in ROPE_CASES.items()
    },
    "mistral-window": ("mistral", dict(sliding_window=4)),
    "qwen2": ("qwen2", dict()),
    "qwen2-window-layers": (
        "qwen2",
        dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    ),
    "qwen3": ("qwen3", dict(head_dim=16)),
    "phi3": ("phi3", dict(pad_token_id=0, sliding_window=5)),
    "phi3-longrope": (
        "phi3",
        dict(
            pad_token_id=0,
            rope_parameters=ROPE_CASES["longrope"],
            original_max_position_embeddings=8,
            max_position_embeddings=32,
        ),
    ),
    "gemma": ("gemma", dict(head_dim=16)),
    "gemma2": (
        "gemma2",
        dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=12, final_logit_softcapping=3.0),
    ),
    "qwen3-bias-window": (
        "qwen3",
        dict(attention_bias=True, use_sliding_window=True, sliding_window=3, max_window_layers=1),
    ),
}


def load(tmp_path, hf_model, **kwargs):
    hf_model.save_pretrained(tmp_path / "hf")
    return eqdel.from_pretrained(tmp_path / "hf", progress=False, **kwargs)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, tmp_path):
    model_type, overrides = CASES[case]
    hf_model = make_hf_model(model_type, **overrides)
    model = load(tmp_path, hf_model)
    ids = random_ids(2, 12)
    got = np.asarray(jax.jit(lambda m, i: m(i).logits)(model, jnp.asarray(ids)))
    np.testing.assert_allclose(got, hf_logits(hf_model, ids), rtol=0, atol=TOL)


@pytest.mark.parametrize(
    "model_type", ["llama", "mistral", "qwen2", "qwen3", "phi3", "gemma", "gemma2"]
)
def test_padded_batch_matches_transformers(model_type, tmp_path):
    window = 4 if model_type in ("mistral", "gemma2", "phi3") else None
    extra = dict(pad_token_id=0) if model_type == "phi3" else {}
    hf_model = make_hf_model(model_type, sliding_window=window, **extra)
    model = load(tmp_path, hf_model)
    ids = random_ids(3, 10, seed=1)
    mask = np.ones_like(ids)
    mask[1, :3] = 0  # left padding
    mask[2, 7:] = 0  # right padding
    got = np.asarray(model(jnp.asarray(ids), attention_mask=jnp.asarray(mask)).logits)
    want = hf_logits(hf_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], rtol=0, atol=TOL)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_scan_and_unrolled_layers_are_identical(kv_heads, tmp_path):
    hf_model = make_hf_model("llama", num_key_value_heads=kv_heads, num_hidden_layers=3)
    scanned = load(tmp_path, hf_model)
    unrolled = eqdel.from_pretrained(tmp_path / "hf", progress=False, scan_layers=False)
    ids = jnp.asarray(random_ids(2, 9))
    a = np.asarray(jax.jit(lambda m: m(ids).logits)(scanned))
    b = np.asarray(jax.jit(lambda m: m(ids).logits)(unrolled))
    # Equal up to float32 rounding: XLA fuses a scan body and straight-line code differently.
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    np.testing.assert_allclose(b, hf_logits(hf_model, np.asarray(ids)), rtol=0, atol=TOL)
    np.testing.assert_allclose(a, hf_logits(hf_model, np.asarray(ids)), rtol=0, atol=TOL)


def test_unstacked_layers_equal_stacked_with_and_without_cache(tmp_path):
    model = load(tmp_path, make_hf_model("llama", num_hidden_layers=3))
    split = model.unstacked()
    assert isinstance(split.model.layers, tuple) and len(split.model.layers) == 3
    ids = jnp.asarray(random_ids(2, 9))
    call = jax.jit(lambda m, i, c: m(i, cache=c))
    stacked_out = call(model, ids, model.init_cache(2, 12))
    split_out = call(split, ids, model.init_cache(2, 12).unstacked())
    np.testing.assert_allclose(split_out.logits, stacked_out.logits, rtol=0, atol=1e-6)
    assert isinstance(split_out.cache.layers, tuple)
    for got, want in zip(
        jax.tree.leaves(split_out.cache.stacked()), jax.tree.leaves(stacked_out.cache)
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    token = jnp.asarray(random_ids(2, 1))
    # Each form accepts the other's cache and returns the cache in the form it was given.
    mixed = call(split, token, stacked_out.cache)
    assert not isinstance(mixed.cache.layers, tuple)
    np.testing.assert_allclose(
        mixed.logits, call(model, token, stacked_out.cache).logits, rtol=0, atol=1e-6
    )


def test_bfloat16_scan_reads_layers_in_place_and_equals_unstacked(tmp_path):
    """A bfloat16 model keeps float32 activations on CPU; its scan slices each layer out
    of the stacked weights without a float32 copy of the stack, and its gradients equal
    the unstacked model's."""
    load(tmp_path, make_hf_model("llama", num_hidden_layers=3))
    model = eqdel.from_pretrained(tmp_path / "hf", dtype="bfloat16", progress=False)
    f32 = eqdel.from_pretrained(tmp_path / "hf", progress=False)
    ids = jnp.asarray(random_ids(2, 9))
    forward = jax.jit(lambda m: m(ids).logits)
    logits = forward(model)
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(logits, forward(f32), rtol=0, atol=0.05)
    hlo = forward.lower(model).compile().as_text()
    for leaf in jax.tree.leaves(model.model.layers):
        assert leaf.dtype == jnp.bfloat16
        assert f"f32[{','.join(map(str, leaf.shape))}]" not in hlo, leaf.shape

    def loss(m):
        return jnp.mean(jax.nn.log_softmax(m(ids).logits)[..., 0])

    stacked = jax.jit(jax.grad(loss))(model)
    unstacked = jax.jit(jax.grad(loss))(model.unstacked())
    layers = jax.tree.map(lambda *each: jnp.stack(each), *unstacked.model.layers)
    unstacked = eqx.tree_at(lambda m: m.model.layers, unstacked, layers)
    for got, want in zip(jax.tree.leaves(stacked), jax.tree.leaves(unstacked), strict=True):
        assert got.dtype == jnp.bfloat16
        scale = float(jnp.max(jnp.abs(want.astype(jnp.float32))))
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=0, atol=scale / 64
        )


def test_hidden_states_and_inputs_embeds_match_transformers(tmp_path):
    import torch

    hf_model = make_hf_model("llama", num_hidden_layers=3)
    model = load(tmp_path, hf_model)
    ids = random_ids(2, 6)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids), output_hidden_states=True).hidden_states
    out = model(jnp.asarray(ids), output_hidden_states=True)
    assert len(out.hidden_states) == len(ref) == 4
    for got, want in zip(out.hidden_states, ref):
        np.testing.assert_allclose(np.asarray(got), want.numpy(), rtol=0, atol=TOL)
    embeds = model.get_input_embeddings()(jnp.asarray(ids))
    np.testing.assert_array_equal(
        np.asarray(model(inputs_embeds=embeds).logits), np.asarray(out.logits)
    )
    last = model(jnp.asarray(ids), output_hidden_states=True, logits_to_keep=2)
    assert last.logits.shape == (2, 2, out.logits.shape[-1])
    np.testing.assert_allclose(
        np.asarray(last.logits), np.asarray(out.logits[:, -2:]), rtol=0, atol=1e-6
    )
    assert len(last.hidden_states) == 4 and last.hidden_states[-1].shape[1] == 6


@pytest.mark.parametrize(
    "case",
    [
        "llama-gqa-tied",
        "mistral-window",
        "qwen2",
        "qwen3-bias-window",
        "gemma",
        "gemma2",
        "phi3-longrope",
        "llama-rope-yarn",
    ],
)
def test_save_then_transformers_loads_identical(case, tmp_path):
    model_type, overrides = CASES[case]
    hf_model = make_hf_model(model_type, **overrides)
    model = load(tmp_path, hf_model)
    eqdel.save_pretrained(model, tmp_path / "ours", max_shard_size="20KB")
    assert (tmp_path / "ours" / "model.safetensors.index.json").is_file()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    assert type(reloaded) is type(hf_model)
    ids = random_ids(2, 12, seed=3)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))
    ours = np.asarray(model(jnp.asarray(ids)).logits)
    np.testing.assert_allclose(ours, hf_logits(reloaded, ids), rtol=0, atol=TOL)


def test_eqdel_round_trip_is_exact(tmp_path, getkey):
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        qkv_bias=True,
        model_type="qwen2",
    )
    model = LlamaForCausalLM(config, key=getkey())
    eqdel.save_pretrained(model, tmp_path / "m")
    again = eqdel.from_pretrained(tmp_path / "m", progress=False)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert again.config == config


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "phi3", "gemma", "gemma2"])
def test_sharded_model_matches_single_device(model_type, tmp_path):
    sizes = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0)
    hf_model = make_hf_model(model_type, **sizes)
    single = load(tmp_path, hf_model)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.from_pretrained(tmp_path / "hf", sharding=cfg, progress=False)
    mesh = cfg.mesh()
    specs = eqdel.partition_specs(sharded, cfg)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    for leaf, spec in zip(jax.tree.leaves(sharded), jax.tree.leaves(specs, is_leaf=is_spec)):
        assert leaf.sharding == NamedSharding(mesh, spec)
    attn = sharded.model.layers.self_attn
    q = (attn.q_proj or attn.qkv_proj).weight  # Phi-3 fuses q, k and v
    assert q.sharding.spec == jax.sharding.PartitionSpec(None, ("fsdp", "sp"), "tp")
    assert q.addressable_shards[0].data.shape == (2, 8, q.shape[2] // 2)  # [layers, 32/4, /2]
    ids = jnp.asarray(random_ids(4, 8))
    forward = jax.jit(lambda m, i: m(i).logits)
    np.testing.assert_allclose(
        np.asarray(forward(sharded, ids)), np.asarray(forward(single, ids)), rtol=0, atol=TOL
    )


def test_config_reads_both_rope_layouts():
    base = dict(
        model_type="llama",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
    )
    old = LlamaConfig.from_hf_config(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 4.0}}
    )
    new = LlamaConfig.from_hf_config(
        {**base, "rope_parameters": {"rope_type": "linear", "rope_theta": 5e5, "factor": 4.0}}
    )
    assert old == new
    assert (old.rope_theta, old.rope_type, dict(old.rope_parameters)) == (
        5e5,
        "linear",
        {"factor": 4.0},
    )
    assert LlamaConfig.from_hf_config(new.to_hf_config()) == new


def test_model_methods_return_new_models(getkey):
    config = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
    )
    model = LlamaForCausalLM(config, key=getkey())
    other = LlamaForCausalLM(config, key=getkey())
    swapped = model.set_input_embeddings(other.get_input_embeddings())
    assert swapped.get_input_embeddings().weight is other.get_input_embeddings().weight
    assert model.get_input_embeddings().weight is not other.get_input_embeddings().weight
    head = model.set_output_embeddings(other.lm_head).get_output_embeddings()
    assert head.weight is other.lm_head.weight
    decoder = model.set_decoder(other.get_decoder()).get_decoder()
    assert decoder.norm.weight is other.get_decoder().norm.weight
    text = repr(model)
    assert text.startswith("LlamaForCausalLM(model_type='llama', layers=2, hidden=8")
    assert "parameters=" in text and len(text) < 300
    tied = LlamaForCausalLM(
        dataclasses.replace(config, tie_word_embeddings=True),
        key=getkey(),
    )
    assert tied.get_output_embeddings().weight is tied.get_input_embeddings().weight
    with pytest.raises(ValueError, match="ties its head"):
        tied.set_output_embeddings(other.lm_head)
