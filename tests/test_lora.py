"""LoRA adapters: exactness at init, training only adapters, merging, PEFT files."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from hf_reference import make_hf_model, random_ids

import eqdel
from eqdel.train import causal_lm_loss, init_train_state, make_train_step

TARGETS = ("q_proj", "v_proj", "down_proj")


@pytest.fixture
def base(tmp_path):
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path / "base")
    return tmp_path / "base", eqdel.from_pretrained(tmp_path / "base", progress=False)


def _trained_adapters(model, getkey, steps=5):
    adapted = eqdel.apply_lora(model, rank=4, alpha=8.0, targets=TARGETS, key=getkey())
    optimizer = optax.adam(1e-2)
    trainable = eqdel.lora_filter(adapted)
    state = init_train_state(adapted, optimizer, getkey(), trainable=trainable)
    step = make_train_step(causal_lm_loss, optimizer, trainable=trainable)
    batch = {"input_ids": jnp.asarray(random_ids(4, 12, seed=9))}
    losses = []
    for _ in range(steps):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return state.model, losses


def test_fresh_adapters_change_nothing(base, getkey):
    _, model = base
    adapted = eqdel.apply_lora(model, rank=4, alpha=8.0, targets=TARGETS, key=getkey())
    ids = jnp.asarray(random_ids(2, 7))
    np.testing.assert_array_equal(np.asarray(adapted(ids).logits), np.asarray(model(ids).logits))
    q = adapted.model.layers.self_attn.q_proj
    assert q.lora_A.shape == (2, 32, 4) and q.lora_B.shape == (2, 4, 32)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        eqdel.apply_lora(adapted, rank=4, alpha=8.0, targets=TARGETS, key=getkey())
    with pytest.raises(ValueError, match="No linear layer is called any of"):
        eqdel.apply_lora(model, rank=4, alpha=8.0, targets=("qkv",), key=getkey())


def test_training_moves_only_adapters_and_merge_is_exact(base, getkey):
    _, model = base
    trained, losses = _trained_adapters(model, getkey)
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(
        np.asarray(trained.model.layers.self_attn.q_proj.base.weight),
        np.asarray(model.model.layers.self_attn.q_proj.weight),
    )
    assert float(jnp.abs(trained.model.layers.self_attn.q_proj.lora_B).max()) > 0
    merged = eqdel.merge_lora(trained)
    assert isinstance(merged.model.layers.self_attn.q_proj, eqdel.nn.Linear)
    ids = jnp.asarray(random_ids(2, 7))
    np.testing.assert_allclose(
        np.asarray(merged(ids).logits), np.asarray(trained(ids).logits), rtol=0, atol=1e-5
    )
    with pytest.raises(ValueError, match="carries LoRA adapters; merge_lora"):
        eqdel.save_pretrained(trained, base[0].parent / "nope")


def test_adapters_load_in_peft_and_back(base, getkey, tmp_path):
    path, model = base
    trained, _ = _trained_adapters(model, getkey)
    eqdel.save_lora(trained, tmp_path / "adapter", base_model_name_or_path=str(path))
    hf_base = transformers.AutoModelForCausalLM.from_pretrained(
        path, attn_implementation="eager"
    ).eval()
    peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
    ids = random_ids(2, 9, seed=4)
    with torch.no_grad():
        want = peft_model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(
        np.asarray(trained(jnp.asarray(ids)).logits), want, rtol=0, atol=1e-5
    )
    reloaded = eqdel.load_lora(model, tmp_path / "adapter")
    for a, b in zip(jax.tree.leaves(reloaded), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
