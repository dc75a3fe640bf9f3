"""Mixtral: top-2 of 4 experts, exact to transformers, sharded over ep, with the
router's auxiliary loss."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_logits, make_hf_model, random_ids

import eqdel
from eqdel.models import load_balancing_loss

TOL = 1e-5
EXPERTS = dict(num_local_experts=4, num_experts_per_tok=2)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("mixtral")
    hf_model = make_hf_model("mixtral", **EXPERTS, sliding_window=6)
    hf_model.save_pretrained(path)
    return hf_model, path


def test_logits_padded_batch_and_aux_loss_match_transformers(checkpoint):
    hf_model, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    ids = random_ids(3, 10, seed=1)
    mask = np.ones_like(ids)
    mask[1, :3] = 0
    out = jax.jit(lambda m, i, a: m(i, attention_mask=a))(model, jnp.asarray(ids), mask)
    want = hf_logits(hf_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out.logits)[real], want[real], rtol=0, atol=TOL)
    assert out.router_logits.shape == (2, 3, 10, 4)
    with torch.no_grad():
        hf = hf_model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True
        )
    aux = load_balancing_loss(out.router_logits, 2, jnp.asarray(mask))
    np.testing.assert_allclose(float(aux), float(hf.aux_loss), rtol=1e-5)


def test_greedy_generation_is_token_identical(checkpoint):
    hf_model, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    prompt = random_ids(2, 6, seed=2)
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor(prompt),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        ).numpy()
    got = eqdel.generate(model, jnp.asarray(prompt), max_new_tokens=10, eos_token_id=[])
    np.testing.assert_array_equal(np.asarray(got), want)


def test_save_then_transformers_loads_identical(checkpoint, tmp_path):
    hf_model, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    eqdel.save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    ids = random_ids(2, 9, seed=3)
    np.testing.assert_array_equal(hf_logits(reloaded, ids), hf_logits(hf_model, ids))


@pytest.mark.parametrize("dims", [(1, 2, 2, 2), (2, 1, 2, 1, 2)])
def test_sharded_over_experts_equals_single_device(checkpoint, dims):
    _, path = checkpoint
    names = ("dp", "fsdp", "tp", "sp") if len(dims) == 4 else ("dp", "fsdp", "tp", "sp", "ep")
    cfg = eqdel.ShardingConfig(axis_dims=dims, axis_names=names)
    single = eqdel.from_pretrained(path, progress=False)
    sharded = eqdel.from_pretrained(path, sharding=cfg, progress=False)
    w1 = sharded.model.layers.block_sparse_moe.experts.w1.weight  # [layers, experts, in, out]
    if "ep" in names:
        assert w1.sharding.spec[1] == "ep"
        assert w1.addressable_shards[0].data.shape[1] == 2  # 4 experts over ep=2
    ids = jnp.asarray(random_ids(4, 8))
    forward = jax.jit(lambda m, i: m(i).logits)
    np.testing.assert_allclose(forward(sharded, ids), forward(single, ids), rtol=0, atol=TOL)


def test_train_step_with_aux_loss_on_an_expert_mesh_equals_single_device(checkpoint):
    import optax

    from eqdel.train import causal_lm_loss, init_train_state, make_train_step

    _, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    coef = model.config.router_aux_loss_coef

    ids = jnp.asarray(random_ids(4, 8, seed=5))
    plain, count = causal_lm_loss(model, {"input_ids": ids}, router_aux_loss_coef=0.0)
    with_aux, _ = causal_lm_loss(model, {"input_ids": ids})
    aux = load_balancing_loss(model(ids).router_logits, 2)
    np.testing.assert_allclose(with_aux / count, plain / count + coef * aux, rtol=1e-6)

    optimizer = optax.sgd(0.5)
    step = make_train_step(causal_lm_loss, optimizer, donate=False)
    batch = {"input_ids": ids}
    single, _ = step(init_train_state(model, optimizer, jax.random.key(0)), batch)
    cfg = eqdel.ShardingConfig(
        axis_dims=(2, 1, 2, 1, 2), axis_names=("dp", "fsdp", "tp", "sp", "ep")
    )
    state = eqdel.shard(init_train_state(model, optimizer, jax.random.key(0)), cfg)
    sharded, _ = step(state, batch)
    moved = single.model.model.layers.block_sparse_moe.experts.w1.weight
    assert not np.allclose(moved, model.model.layers.block_sparse_moe.experts.w1.weight)
    for a, b in zip(jax.tree.leaves(sharded.model), jax.tree.leaves(single.model), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
