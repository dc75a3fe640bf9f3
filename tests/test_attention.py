"""Every attention kernel equals the vanilla one, forward and backward, on the cases
models meet: grouped queries, padding, sliding windows, soft-capping, cache offsets and
lengths that are not multiples of the blocks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hf_reference import random_ids

import eqdel
from eqdel.attention import (
    AttentionMask,
    attention,
    chunked_attention,
    ring_attention,
    select_mechanism,
    vanilla_attention,
)
from eqdel.models import LlamaConfig, LlamaForCausalLM
from eqdel.train import causal_lm_loss, init_train_state, make_train_step

CASES = {
    "mha": dict(heads=4, kv_heads=4),
    "gqa-4": dict(heads=8, kv_heads=2),
    "mqa": dict(heads=8, kv_heads=1),
    "left-padding": dict(heads=8, kv_heads=2, padding=5),
    "sliding-window": dict(heads=8, kv_heads=2, window=7),
    "soft-cap": dict(heads=8, kv_heads=2, soft_cap=5.0),
    "everything": dict(heads=8, kv_heads=4, padding=3, window=9, soft_cap=20.0),
}


def inputs(heads, kv_heads, q_len=37, kv_len=None, padding=0, window=0, seed=0):
    kv_len = q_len if kv_len is None else kv_len
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (2, q_len, heads, 16))
    k = jax.random.normal(keys[1], (2, kv_len, kv_heads, 16))
    v = jax.random.normal(keys[2], (2, kv_len, kv_heads, 16))
    cotangent = jax.random.normal(keys[3], q.shape)
    offset = kv_len - q_len  # queries are the last q_len slots, as after a cache
    query_index = jnp.broadcast_to(offset + jnp.arange(q_len), (2, q_len))
    key_index = jnp.broadcast_to(jnp.arange(kv_len), (2, kv_len))
    valid = jnp.ones((2, kv_len), bool).at[1, :padding].set(False)
    return (q, k, v), AttentionMask(query_index, key_index, valid, window), cotangent


def assert_matches_vanilla(kernel, qkv, mask, cotangent, soft_cap=None):
    def loss(fn):
        return lambda *x: jnp.sum(fn(*x, mask, scale=0.25, soft_cap=soft_cap) * cotangent)

    want = vanilla_attention(*qkv, mask, scale=0.25, soft_cap=soft_cap)
    got = jax.jit(lambda *x: kernel(*x, mask, scale=0.25, soft_cap=soft_cap))(*qkv)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    want_grads = jax.grad(loss(vanilla_attention), argnums=(0, 1, 2))(*qkv)
    got_grads = jax.jit(jax.grad(loss(kernel), argnums=(0, 1, 2)))(*qkv)
    for name, g, w in zip("qkv", got_grads, want_grads, strict=True):
        np.testing.assert_allclose(g, w, atol=1e-5, rtol=0, err_msg=f"d{name}")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("blocks", [(8, 16), (16, 5), (64, 64)])
def test_chunked_equals_vanilla(case, blocks):
    spec = dict(CASES[case])
    soft_cap = spec.pop("soft_cap", None)
    qkv, mask, cotangent = inputs(**spec)
    kernel = lambda *a, **kw: chunked_attention(*a, **kw, block_q=blocks[0], block_k=blocks[1])  # noqa: E731
    assert_matches_vanilla(kernel, qkv, mask, cotangent, soft_cap)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("q_len", [150, 300])  # two blocks; four of uneven sizes
def test_aligned_mask_blocks_equal_the_whole_kernel(case, q_len):
    """Told that the keys are the queries (no cache), the vanilla kernel on CPU skips the
    keys after each block of queries; its results, padding rows included, are the whole
    kernel's."""
    spec = dict(CASES[case])
    soft_cap = spec.pop("soft_cap", None)
    qkv, mask, cotangent = inputs(**spec, q_len=q_len)
    aligned = AttentionMask(
        mask.query_index, mask.key_index, mask.key_valid, mask.sliding_window, aligned=True
    )
    kernel = lambda q, k, v, _, **kw: vanilla_attention(q, k, v, aligned, **kw)  # noqa: E731
    assert_matches_vanilla(kernel, qkv, mask, cotangent, soft_cap)


def test_chunked_equals_vanilla_for_a_query_block_at_a_cache_offset():
    qkv, mask, cotangent = inputs(8, 2, q_len=5, kv_len=40, padding=2, window=11)
    unwritten = AttentionMask(
        mask.query_index - 10, mask.key_index, mask.key_valid.at[:, 30:].set(False), 11
    )
    for m in (mask, unwritten):
        kernel = lambda *a, **kw: chunked_attention(*a, **kw, block_q=4, block_k=16)  # noqa: E731
        assert_matches_vanilla(kernel, qkv, m, cotangent)


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("case", ["gqa-4", "mqa", "everything"])
def test_ring_over_sp_equals_vanilla(sp, case):
    spec = dict(CASES[case])
    soft_cap = spec.pop("soft_cap", None)
    qkv, mask, cotangent = inputs(**spec, q_len=40)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 8 // (2 * sp), 2, sp))
    with jax.set_mesh(cfg.mesh()):
        assert_matches_vanilla(ring_attention, qkv, mask, cotangent, soft_cap)


def test_kernel_choice_and_errors_name_the_problem():
    short = jnp.zeros((1, 64, 4, 16))
    long = jnp.zeros((1, 4096, 4, 16))
    assert select_mechanism("auto", short, short) == "vanilla"
    assert select_mechanism("auto", long, long) == "chunked"
    assert select_mechanism("auto", long[:, :1], long) == "vanilla"  # one decode step
    assert select_mechanism("flash", short, short) == "chunked"
    with jax.set_mesh(eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2)).mesh()):
        assert select_mechanism("auto", short, short) == "ring"
        assert select_mechanism("auto", short[:, :1], short) == "vanilla"
        qkv, mask, _ = inputs(4, 4, q_len=37)
        with pytest.raises(ValueError, match="divide by 2; got 37 and 37"):
            attention(*qkv, mask, scale=0.25, mechanism="ring")
    qkv, mask, _ = inputs(4, 4, q_len=8)
    with pytest.raises(ValueError, match="needs a mesh with a 'sp' axis"):
        attention(*qkv, mask, scale=0.25, mechanism="ring")
    with pytest.raises(ValueError, match="cudnn attention needs a GPU; the backend is 'cpu'"):
        attention(*qkv, mask, scale=0.25, mechanism="cudnn")
    with pytest.raises(ValueError, match=r"splash attention .* is not part of eqdel"):
        attention(*qkv, mask, scale=0.25, mechanism="splash")
    with pytest.raises(ValueError, match="Unknown attn_mechanism 'fast'"):
        LlamaConfig(attn_mechanism="fast")


CONFIG = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    sliding_window=6,
    layer_types=("sliding_attention", "full_attention"),
    model_type="mistral",
    attn_mechanism="vanilla",
    block_q=8,
    block_k=8,
)


@pytest.mark.parametrize(
    "mechanism, scan_mlp",
    [("chunked", False), ("ring", False), ("auto", False), ("vanilla", True)],
)
def test_llama_forward_and_train_step_equal_vanilla(mechanism, scan_mlp):
    key = jax.random.key(0)
    reference = LlamaForCausalLM(CONFIG, key=key)
    config = dataclasses.replace(
        CONFIG, attn_mechanism=mechanism, use_scan_mlp=scan_mlp, scan_mlp_chunk_size=5
    )
    model = LlamaForCausalLM(config, key=key)
    ids = jnp.asarray(random_ids(2, 16, vocab=64))
    mask = jnp.ones((2, 16), jnp.int32).at[1, :3].set(0)
    batch = {"input_ids": ids, "attention_mask": mask}
    optimizer = optax.sgd(0.5)
    step = make_train_step(causal_lm_loss, optimizer, donate=False)

    def run(model):
        logits = jax.jit(lambda m: m(ids, attention_mask=mask).logits)(model)
        state, metrics = step(init_train_state(model, optimizer, key), batch)
        return logits, state.model, metrics["loss"]

    want = run(reference)
    with eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2)).activate():  # constrained, too
        got = run(model)
    np.testing.assert_allclose(got[0], want[0], atol=1e-5, rtol=0)
    np.testing.assert_allclose(got[2], want[2], rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-5)


def test_generation_with_the_chunked_kernel_is_token_identical():
    key = jax.random.key(3)
    reference = LlamaForCausalLM(CONFIG, key=key)
    chunked = LlamaForCausalLM(dataclasses.replace(CONFIG, attn_mechanism="chunked"), key=key)
    prompt = jnp.asarray(random_ids(2, 7, vocab=64))
    want = eqdel.generate(reference, prompt, max_new_tokens=12)
    np.testing.assert_array_equal(eqdel.generate(chunked, prompt, max_new_tokens=12), want)


def _constraint_specs(fn, *args) -> list:
    """The partition specs of every sharding constraint in `fn`'s jaxpr."""
    specs = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "sharding_constraint":
                specs.append(eqn.params["sharding"].spec)
            for value in eqn.params.values():
                if isinstance(value, jax.extend.core.ClosedJaxpr):
                    visit(value.jaxpr)
                elif isinstance(value, jax.extend.core.Jaxpr):
                    visit(value)

    visit(jax.make_jaxpr(fn)(*args).jaxpr)
    return specs


def test_hidden_states_and_attention_are_constrained_to_the_rules_inside_activate():
    P = jax.sharding.PartitionSpec
    model = LlamaForCausalLM(CONFIG, key=jax.random.key(0))
    ids = jnp.asarray(random_ids(4, 16, vocab=64))
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    forward = lambda m, i: m(i).logits  # noqa: E731
    assert _constraint_specs(forward, model, ids) == []  # nothing outside activate()
    with cfg.activate():
        specs = _constraint_specs(forward, model, ids)
        sharded = jax.jit(forward)(eqdel.shard(model, cfg), ids)
        quiet = dataclasses.replace(CONFIG, shard_attention_computation=False)
        quiet_specs = _constraint_specs(
            forward, LlamaForCausalLM(quiet, key=jax.random.key(0)), ids
        )
        cache = model.init_cache(4, 17)
        step = lambda m, i: m(i, cache=cache).logits  # noqa: E731
        decode_specs = _constraint_specs(step, model, ids[:, :1])
    # The hidden states entering the layers and leaving each (batch on (dp, fsdp), the
    # sequence on sp, embed on tp); q, k, v and the attention output of the scanned layer
    # (heads on tp). A one-token decode step leaves the sequence unsharded.
    hidden, decode_hidden = P(("dp", "fsdp"), "sp", "tp"), P(("dp", "fsdp"), None, "tp")
    assert specs == [hidden, *[P(("dp", "fsdp"), "sp", "tp", None)] * 4, hidden]
    assert quiet_specs == [hidden, hidden]  # shard_attention_computation=False
    assert decode_specs == [
        decode_hidden,
        *[P(("dp", "fsdp"), None, "tp", None)] * 4,
        decode_hidden,
    ]
    np.testing.assert_allclose(sharded, jax.jit(forward)(model, ids), atol=1e-5, rtol=0)
