"""SmolLM2-135M-Instruct from its GGUF file, eqdel against transformers reading the same
file: tokenizer, chat template, logits on real text, greedy chat answers, perplexity, and a
checkpoint written by eqdel that transformers loads back."""

import copy
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import eqdel
from eqdel._demo import instructions_file, perplexity_text_file
from eqdel.evaluate import _windows

pytestmark = pytest.mark.real_model

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [
        {"role": "system", "content": "You answer in one sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Hi! Can you help me?"},
        {"role": "assistant", "content": "Of course. What do you need?"},
        {"role": "user", "content": "Give me three tips for learning to cook."},
    ],
]


@pytest.fixture(scope="module")
def reference(smollm2_file):
    """transformers' model and tokenizer from the same GGUF file, float32."""
    directory, name = str(smollm2_file.parent), smollm2_file.name
    model = transformers.AutoModelForCausalLM.from_pretrained(
        directory, gguf_file=name, dtype=torch.float32
    ).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
    return model, tokenizer


@pytest.fixture(scope="module")
def model(smollm2_file):
    return eqdel.from_pretrained(smollm2_file, progress=False)


@pytest.fixture(scope="module")
def tokenizer(smollm2_file):
    return eqdel.load_tokenizer(smollm2_file)


@pytest.fixture(scope="module")
def text_ids(tokenizer):
    return tokenizer.encode(perplexity_text_file().read_text()).ids


def _torch_logits(model, ids) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(np.asarray(ids))).logits.numpy()


_forward = jax.jit(lambda model, ids: model(ids).logits)


def test_config_read_from_the_metadata(model):
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (
        30,
        576,
        1536,
    )
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.rope_theta, config.tie_word_embeddings) == (
        49152,
        100000.0,
        True,
    )
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)


def test_weights_equal_transformers(model, reference):
    """Every dequantised tensor, the query/key row permutation undone, equals the one
    transformers reads from the same file."""
    hf = dict(reference[0].named_parameters())
    layers = model.model.layers
    pairs = {
        "model.embed_tokens.weight": model.model.embed_tokens.weight,
        "model.norm.weight": model.model.norm.weight,
        "model.layers.7.self_attn.q_proj.weight": layers.self_attn.q_proj.weight[7].T,
        "model.layers.7.self_attn.k_proj.weight": layers.self_attn.k_proj.weight[7].T,
        "model.layers.29.mlp.down_proj.weight": layers.mlp.down_proj.weight[29].T,
        "model.layers.0.input_layernorm.weight": layers.input_layernorm.weight[0],
    }
    for name, ours in pairs.items():
        np.testing.assert_array_equal(np.asarray(ours), hf[name].detach().numpy(), err_msg=name)


def test_tokenizer_matches_transformers(tokenizer, reference):
    text = (
        perplexity_text_file().read_text()
        + " In 1984, 12345 people said <|im_start|>hi<|im_end|> naïve café 日本語 🙂\n\n\t  x"
    )
    ours = tokenizer.encode(text).ids
    assert ours == reference[1](text).input_ids
    assert tokenizer.decode(ours, skip_special_tokens=False) == text


def test_chat_template_ids_match_transformers(smollm2_file, tokenizer, reference):
    template = eqdel.load_chat_template(smollm2_file)
    for messages in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            theirs = reference[1].apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False
            )
            assert template.render(messages, add_generation_prompt=add_generation_prompt) == (
                theirs
            )
            assert (
                template.encode(tokenizer, messages, add_generation_prompt=add_generation_prompt)
                == reference[1](theirs, add_special_tokens=False).input_ids
            )


def test_chat_rejects_an_unknown_role(smollm2_file):
    template = eqdel.load_chat_template(smollm2_file)
    with pytest.raises(ValueError, match="message 1 has role 'robot'"):
        template.render([{"role": "user", "content": "hi"}, {"role": "robot", "content": "x"}])


@pytest.mark.parametrize("window", [slice(0, 256), slice(512, 1024)])
def test_logits_as_close_to_exact_as_transformers(model, reference, text_ids, window):
    """Measured against transformers in float64, eqdel's float32 error is within twice
    transformers' own float32 error. How the two compare depends on the CPU's matrix
    product, whose rounding differs by host: on an Intel host the logits were within 1e-4
    of each other on the first window and eqdel's error at most 1.25 times transformers'
    on the second; on an AMD Zen 4 host it was 1.13 and 1.77 times (9.4e-5 against 8.3e-5 and
    2.0e-4 against 1.2e-4), with the layers' hidden states 0.25 to 1.8 times as far from
    float64 as transformers', and XLA's float32 product of `[512, 576] x [576, 1536]`
    2.0 times as far from float64 as numpy's (3.7e-7 against 1.9e-7, relative)."""
    ids = np.asarray([text_ids[window]])
    ours = np.asarray(_forward(model, ids))
    theirs = _torch_logits(reference[0], ids)
    exact = _torch_logits(copy.deepcopy(reference[0]).double(), ids)
    assert np.abs(ours - exact).max() <= 2 * np.abs(theirs - exact).max()


def test_greedy_chat_answers_match_transformers(smollm2_file, model, tokenizer, reference):
    template = eqdel.load_chat_template(smollm2_file)
    hf_model = reference[0]
    for messages in CONVERSATIONS[:3]:
        prompt = template.encode(tokenizer, messages)
        ours = np.asarray(eqdel.generate(model, jnp.asarray([prompt]), max_new_tokens=64))[0]
        with torch.no_grad():
            theirs = hf_model.generate(
                torch.tensor([prompt]), max_new_tokens=64, do_sample=False, pad_token_id=2
            )[0].numpy()
        assert ours[: len(theirs)].tolist() == theirs.tolist(), tokenizer.decode(theirs)
        assert (ours[len(theirs) :] == 2).all()  # after the end token, padding
    answer = tokenizer.decode(ours[len(prompt) :].tolist())
    assert answer.strip(), "an empty answer"


def test_perplexity_matches_transformers(model, reference, text_ids):
    window, stride = 256, 128
    ours = eqdel.evaluate.perplexity(model, text_ids, window=window, stride=stride)
    ids = torch.tensor(text_ids)
    nll = 0.0
    for begin, end, first in _windows(len(text_ids), window, stride):
        with torch.no_grad():
            logits = reference[0](ids[None, begin:end]).logits[0].double()
        log_probs = torch.log_softmax(logits, -1)[first - begin - 1 : end - begin - 1]
        nll -= log_probs.gather(1, ids[first:end, None]).sum().item()
    theirs = math.exp(nll / (len(text_ids) - 1))
    assert ours.tokens == len(text_ids) - 1
    assert abs(ours.perplexity / theirs - 1) <= 1e-3
    assert 10 < ours.perplexity < 30  # English the model reads well


def test_checkpoint_round_trip_loads_in_transformers(
    smollm2_file, model, tokenizer, reference, text_ids, tmp_path
):
    template = eqdel.load_chat_template(smollm2_file)
    out = eqdel.save_pretrained(
        model, tmp_path / "smollm2", tokenizer=tokenizer, chat_template=template
    )
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = np.asarray([text_ids[:128]])
    np.testing.assert_array_equal(_torch_logits(hf_model, ids), _torch_logits(reference[0], ids))
    text = perplexity_text_file().read_text()[:2000]
    assert hf_tokenizer(text).input_ids == reference[1](text).input_ids
    for messages in CONVERSATIONS:
        assert hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        ) == reference[1].apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_model.generation_config.eos_token_id == 2
    assert hf_tokenizer.eos_token == "<|im_end|>"

    again = eqdel.from_pretrained(out, progress=False)
    np.testing.assert_array_equal(
        np.asarray(_forward(again, ids)), np.asarray(_forward(model, ids))
    )
    np.testing.assert_array_equal(
        eqdel.load_tokenizer(out).encode(text).ids, tokenizer.encode(text).ids
    )


def _cli(*args, stdin=None):
    return subprocess.run(
        [sys.executable, "-m", "eqdel._cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_chat_command_answers(smollm2_file):
    out = _cli(
        "chat",
        str(smollm2_file),
        "--max-new-tokens",
        "24",
        stdin="What is the capital of France?\n",
    )
    assert out.returncode == 0, out.stderr
    assert "The capital of France is Paris." in out.stdout


def test_perplexity_command_prints_what_the_function_gives(smollm2_file, model, text_ids):
    out = _cli("perplexity", str(smollm2_file), "--window", "128", "--stride", "128")
    assert out.returncode == 0, out.stderr
    expected = eqdel.evaluate.perplexity(model, text_ids, window=128, stride=128, progress=False)
    assert f"perplexity {expected.perplexity:.4f} " in out.stdout
    assert f"over {expected.tokens} tokens of perplexity.txt, window 128, stride 128" in out.stdout


def test_perplexity_command_scores_the_quantized_model(smollm2_file, model, text_ids):
    out = _cli("perplexity", str(smollm2_file), "--quantize", "int8", "--window", "512")
    assert out.returncode == 0, out.stderr
    scored = eqdel.evaluate.perplexity(
        eqdel.quantize(model, 8), text_ids, window=512, progress=False
    )
    assert f"int8: perplexity {scored.perplexity:.4f} " in out.stdout
    float_model = eqdel.evaluate.perplexity(model, text_ids, window=512, progress=False)
    assert abs(scored.perplexity / float_model.perplexity - 1) < 0.005  # int8 costs little


def test_gguf_blocks_kept_quantized_score_as_the_float_model(smollm2_file, model, text_ids):
    kept = eqdel.from_pretrained(smollm2_file, progress=False, keep_quantized=True)
    layers = kept.model.layers
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        assert isinstance(getattr(layers.self_attn, name), eqdel.Int4Linear)
    for name in ("gate_proj", "up_proj", "down_proj"):
        assert isinstance(getattr(layers.mlp, name), eqdel.Int4Linear)
    # Half a byte per weight, and a float32 scale and offset per 32 weights: 3/16 of float32.
    kept_bytes, float_bytes = (
        sum(x.nbytes for x in jax.tree.leaves(m.model.layers) if x.ndim >= 3)
        for m in (kept, model)
    )
    assert kept_bytes / float_bytes == pytest.approx(3 / 16)
    # The Q8_0 embeddings: a byte per entry and a float32 scale per 32 entries, 9/32.
    table = kept.model.embed_tokens
    assert isinstance(table, eqdel.Int8Embedding) and kept.lm_head is None
    table_bytes = table.codes.nbytes + table.scales.nbytes
    assert table_bytes / model.model.embed_tokens.weight.nbytes == pytest.approx(9 / 32)
    out = _cli("perplexity", str(smollm2_file), "--keep-quantized", "--window", "512")
    assert out.returncode == 0, out.stderr
    scored = eqdel.evaluate.perplexity(kept, text_ids, window=512, progress=False)
    assert f"GGUF blocks kept quantized: perplexity {scored.perplexity:.4f} " in out.stdout
    float_model = eqdel.evaluate.perplexity(model, text_ids, window=512, progress=False)
    assert abs(scored.perplexity / float_model.perplexity - 1) < 1e-5  # the same weights


def test_finetune_reads_conversations_through_the_chat_template(smollm2_file, tmp_path):
    """Two LoRA steps on the embedded instruction set: the run saves a model that carries
    the tokenizer and chat template on."""
    options = eqdel.FinetuneOptions(
        steps=2, batch_size=2, block_size=32, lora_rank=4, text_field="messages"
    )
    result = eqdel.finetune(smollm2_file, instructions_file(), tmp_path, options, progress=False)
    assert len(result.losses) == 2 and all(math.isfinite(loss) for loss in result.losses)
    saved = sorted(p.name for p in result.model_dir.iterdir())
    assert {"tokenizer.json", "chat_template.jinja", "generation_config.json"} <= set(saved)
