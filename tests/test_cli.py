import os
import re
import subprocess
import sys

import eqdel


def run(*args, timeout=300, env=None):
    return subprocess.run(
        [sys.executable, "-m", "eqdel._cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def tiny_checkpoint(directory):
    """A random tiny Llama saved with a word-level tokenizer of `w0` to `w95`; returns the
    words and the tokenizer."""
    from hf_reference import make_hf_model
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = [f"w{i}" for i in range(96)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    make_hf_model("llama").save_pretrained(directory)
    tokenizer.save(str(directory / "tokenizer.json"))
    return words, tokenizer


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"eqdel {eqdel.__version__}"


def test_the_command_reruns_with_huge_pages_only_when_asked(monkeypatch):
    from eqdel import _cli

    reruns = []
    monkeypatch.setattr(_cli, "rerun_with_huge_pages", reruns.append)
    monkeypatch.setattr(_cli, "main", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["eqdel", "--version"])
    monkeypatch.delenv("EQDEL_HUGE_PAGES", raising=False)
    assert _cli.console_main() == 0 and reruns == []
    monkeypatch.setenv("EQDEL_HUGE_PAGES", "1")
    assert _cli.console_main() == 0
    assert reruns == [["-m", "eqdel._cli", "--version"]]


def test_inspect_mesh():
    out = run("inspect-mesh", "--devices", "8", "--axis-dims", "2,-1,2,1")
    assert out.returncode == 0, out.stderr
    assert "8 devices, mesh {'dp': 2, 'fsdp': 2, 'tp': 2, 'sp': 1}" in out.stdout


def test_inspect_mesh_bad_dims_is_a_clear_error():
    out = run("inspect-mesh", "--devices", "8", "--axis-dims", "3,-1,1,1")
    assert out.returncode == 2
    assert "needs a multiple of 3 devices; found 8" in out.stderr


def test_demo_shards_chats_fine_tunes_and_chats_again(smollm2_file):
    out = run("demo", timeout=900)
    assert out.returncode == 0, out.stderr
    assert "mesh (dp=1, fsdp=2, tp=2, sp=2)" in out.stdout
    assert ".model.layers.self_attn.q_proj.weight" in out.stdout
    difference = float(out.stdout.split("single device| logits on 64 tokens = ")[1].split()[0])
    # The mesh splits the products' sums, so the float32 logits differ from one device's by
    # rounding: under 1e-4 on an Intel host, 1.03e-4 on an AMD Zen 4 one, where one
    # device's float32 logits on this text are themselves up to 9.4e-5 from float64
    # (tests/test_real_model.py).
    assert difference <= 2e-4
    before, after = out.stdout.split("LoRA fine-tuning on ")
    assert "assistant: The capital of Germany is Berlin." in before
    assert "Quill" not in before
    first, last = after.split("\nloss ")[1].split()[0:3:2]
    assert float(last) < 0.3 * float(first)
    assert "assistant: I am Quill" in after  # a question the instruction set does not hold
    perplexities = re.findall(r"perplexity on perplexity.txt.*: ([\d.]+)", out.stdout)
    assert len(perplexities) == 2 and 10 < float(perplexities[0]) < 30


def test_generate_streams_text_from_a_checkpoint(tmp_path):
    import jax.numpy as jnp

    _, tokenizer = tiny_checkpoint(tmp_path)

    out = run("generate", str(tmp_path), "--prompt", "w5 w17 w3", "--max-new-tokens", "6")
    assert out.returncode == 0, out.stderr
    model = eqdel.from_pretrained(tmp_path, progress=False)
    tokens = [
        int(t) for t in eqdel.generate(model, jnp.asarray([[5, 17, 3]]), max_new_tokens=6)[0]
    ]
    eos = model.config.eos_token_id
    end = tokens.index(eos, 3) + 1 if eos in tokens[3:] else len(tokens)
    assert out.stdout.strip() == tokenizer.decode(tokens[:end])

    missing = run("generate", str(tmp_path / "nowhere"), "--prompt", "w1")
    assert missing.returncode == 2 and "no tokenizer.json" in missing.stderr


def test_quantize_writes_the_gptq_model_that_quantize_returns(tmp_path):
    import jax.numpy as jnp
    import numpy as np

    from eqdel._quant import quantization_config

    source = tmp_path / "float"
    words, _ = tiny_checkpoint(source)
    ids = np.random.RandomState(3).randint(0, 96, 300)
    (tmp_path / "calibration.txt").write_text(" ".join(words[i] for i in ids))
    env = {**os.environ, "EQDEL_CACHE": str(tmp_path / "cache")}
    command = ["quantize", str(source), str(tmp_path / "q")]
    options = ["--scheme", "nf4", "--group-size", "16", "--calibration-tokens", "280"]
    options += ["--calibration", str(tmp_path / "calibration.txt")]
    out = run(*command, *options, env=env)
    assert out.returncode == 0, out.stderr
    assert "nf4 (groups of 16), GPTQ on 256 tokens of calibration.txt" in out.stdout

    model = eqdel.from_pretrained(source, progress=False)
    expected = eqdel.quantize(
        model, 4, group_size=16, calibration=jnp.asarray(ids[:256].reshape(4, 64))
    )
    written = eqdel.from_pretrained(tmp_path / "q", progress=False)
    assert (tmp_path / "q" / "tokenizer.json").exists()
    assert quantization_config(written) == quantization_config(expected)
    prompt = jnp.asarray([ids[:12]])
    np.testing.assert_array_equal(written(prompt).logits, expected(prompt).logits)
    assert any((tmp_path / "cache" / "jax").iterdir())  # the programs, compiled once

    empty = tmp_path / "empty.txt"
    empty.write_text("")
    refused = run(*command, "--calibration", str(empty), env=env)
    assert refused.returncode == 2 and "calibration text holds no tokens" in refused.stderr
