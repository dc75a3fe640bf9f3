"""GPT-2: learned positions, LayerNorms and Conv1D weights, exact to transformers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from hf_reference import hf_logits, random_ids

import eqdel

TOL = 1e-5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=96,
        n_embd=32,
        n_layer=2,
        n_head=4,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    hf_model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for name, p in hf_model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.copy_(
                    torch.randn_like(p) * 0.1 + (1.0 if "ln_" in name and "weight" in name else 0)
                )
    path = tmp_path_factory.mktemp("gpt2")
    hf_model.save_pretrained(path)
    return hf_model, path


def test_logits_and_padded_batch_match_transformers(checkpoint):
    hf_model, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    ids = random_ids(3, 10, seed=1)
    mask = np.ones_like(ids)
    mask[2, 7:] = 0  # right padding (GPT-2 counts positions from the first token)
    got = jax.jit(lambda m, i, a: m(i, attention_mask=a).logits)(model, jnp.asarray(ids), mask)
    want = hf_logits(hf_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(got)[real], want[real], rtol=0, atol=TOL)


def test_greedy_generation_and_round_trip(checkpoint, tmp_path):
    hf_model, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    prompt = random_ids(2, 5, seed=2)
    with torch.no_grad():
        want = hf_model.generate(
            torch.tensor(prompt),
            max_new_tokens=10,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        ).numpy()
    got = eqdel.generate(model, jnp.asarray(prompt), max_new_tokens=10, eos_token_id=[])
    np.testing.assert_array_equal(np.asarray(got), want)
    eqdel.save_pretrained(model, tmp_path / "ours")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "ours", attn_implementation="eager"
    ).eval()
    np.testing.assert_array_equal(hf_logits(reloaded, prompt), hf_logits(hf_model, prompt))


def test_sharded_equals_single_device(checkpoint):
    _, path = checkpoint
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    single = eqdel.from_pretrained(path, progress=False)
    sharded = eqdel.from_pretrained(path, sharding=cfg, progress=False)
    ids = jnp.asarray(random_ids(4, 8))
    forward = jax.jit(lambda m, i: m(i).logits)
    np.testing.assert_allclose(forward(sharded, ids), forward(single, ids), rtol=0, atol=TOL)


def test_model_methods(checkpoint):
    _, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    bigger = eqdel.nn.Embedding(96, 32, key=jax.random.key(1))
    swapped = model.set_input_embeddings(bigger)
    assert swapped.get_output_embeddings().weight is bigger.weight
    assert swapped.get_decoder().wte.weight is bigger.weight
    with pytest.raises(ValueError, match="ties its head"):
        model.set_output_embeddings(bigger)


def test_int8_token_embeddings_feed_the_tied_head(checkpoint):
    """`embeddings=True` quantizes the token table (which the head reads), not the
    learned positions; the model computes and generates as its dequantised form."""
    _, path = checkpoint
    model = eqdel.from_pretrained(path, progress=False)
    quantized = eqdel.quantize(model, 8, targets=[], embeddings=True)
    assert isinstance(quantized.transformer.wte, eqdel.Int8Embedding)
    assert isinstance(quantized.transformer.wpe, eqdel.nn.Embedding)
    plain = eqdel.dequantize(quantized)
    ids = jnp.asarray(random_ids(2, 10, seed=3))
    forward = jax.jit(lambda m: m(ids).logits)
    np.testing.assert_allclose(forward(quantized), forward(plain), rtol=0, atol=TOL)
    np.testing.assert_array_equal(
        eqdel.generate(quantized, ids[:, :4], max_new_tokens=6),
        eqdel.generate(plain, ids[:, :4], max_new_tokens=6),
    )


def test_unsupported_attention_variants_are_refused():
    with pytest.raises(ValueError, match="does not implement: \\['reorder_and_upcast_attn'\\]"):
        eqdel.models.GPT2Config.from_hf_config(
            dict(vocab_size=8, n_embd=8, n_layer=1, n_head=2, reorder_and_upcast_attn=True)
        )
