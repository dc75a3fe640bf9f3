"""`eqdel.finetune` and `eqdel finetune`: resuming equals one straight run, LoRA runs
write adapters, and the outputs a user looks at are there."""

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from tiny import WORD_LLAMA, corpus_file, train_tokenizer

import eqdel
from eqdel._finetune import FinetuneOptions, finetune
from eqdel.models import LlamaForCausalLM
from eqdel.train import latest_train_step

OPTIONS = FinetuneOptions(steps=6, batch_size=4, block_size=16, learning_rate=3e-3, warmup_steps=2)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("base")
    tokenizer = train_tokenizer(corpus_file().read_text().splitlines(), 300)
    config = WORD_LLAMA.__class__(
        **{**vars(WORD_LLAMA), "vocab_size": tokenizer.get_vocab_size(), "num_hidden_layers": 2}
    )
    eqdel.save_pretrained(LlamaForCausalLM(config, key=jax.random.key(0)), path)
    tokenizer.save(str(path / "tokenizer.json"))
    return path


def weights(path):
    model = eqdel.from_pretrained(path, progress=False)
    return [np.asarray(x) for x in jax.tree.leaves(model)]


def test_interrupted_run_resumes_to_the_same_model(base, tmp_path, monkeypatch):
    straight = finetune(base, corpus_file(), tmp_path / "straight", OPTIONS, progress=False)
    assert straight.losses[-1] < straight.losses[0]

    import eqdel._finetune

    real = eqdel._finetune.make_train_step

    def dies_at_step_five(*args, **kwargs):
        step = real(*args, **kwargs)

        def run(state, batch):
            if int(state.step) == 5:  # step 5 was logged; the last save was step 4
                raise KeyboardInterrupt
            return step(state, batch)

        return run

    saving = FinetuneOptions(**{**vars(OPTIONS), "save_every": 2})
    with monkeypatch.context() as patch:
        patch.setattr(eqdel._finetune, "make_train_step", dies_at_step_five)
        with pytest.raises(KeyboardInterrupt):
            finetune(base, corpus_file(), tmp_path / "resumed", saving, progress=False)
    again = finetune(base, corpus_file(), tmp_path / "resumed", saving, progress=False)
    assert len(again.losses) == 2  # steps 5 and 6 only
    np.testing.assert_array_equal(again.losses, straight.losses[4:])
    for a, b in zip(weights(again.model_dir), weights(straight.model_dir), strict=True):
        np.testing.assert_array_equal(a, b)
    records = [json.loads(line) for line in again.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert (again.model_dir / "tokenizer.json").is_file()
    assert again.plot_file.read_bytes().startswith(b"\x89PNG")


def test_cli_lora_run_writes_adapter_and_merged_model(base, tmp_path):
    out = tmp_path / "lora"
    command = [sys.executable, "-m", "eqdel._cli", "finetune", str(base), str(corpus_file())]
    flags = ["--steps", "5", "--batch-size", "4", "--block-size", "16", "--lora-rank", "4"]
    flags += ["--learning-rate", "1e-2", "--output", str(out)]
    done = subprocess.run(command + flags, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss " in done.stdout and f"adapter: {out / 'adapter'}" in done.stdout
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    trained, original = weights(out / "model"), weights(base)
    changed = [not np.array_equal(a, b) for a, b in zip(trained, original, strict=True)]
    assert any(changed) and not all(changed)  # attention merged in, the rest untouched
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 5


def test_cli_errors_name_the_problem(base, tmp_path):
    command = [sys.executable, "-m", "eqdel._cli", "finetune"]
    no_tokenizer = subprocess.run(
        [*command, str(tmp_path), str(corpus_file())], capture_output=True, text=True
    )
    assert no_tokenizer.returncode == 2 and "no tokenizer.json" in no_tokenizer.stderr
    too_big = subprocess.run(
        [
            *command,
            str(base),
            str(corpus_file()),
            "--block-size",
            "4096",
            "--output",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert too_big.returncode == 2 and "do not fill one block of 4096" in too_big.stderr


KILLED_RUN = """
import json, sys
import jax
jax.config.update("jax_platforms", "cpu")
from eqdel._finetune import FinetuneOptions, finetune
from tiny import corpus_file
base, output, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
finetune(base, corpus_file(), output, FinetuneOptions(**options), progress=False)
"""


def test_run_killed_at_a_random_moment_resumes_bit_identically(base, tmp_path):
    options = {**vars(OPTIONS), "steps": 10, "save_every": 1}
    straight = finetune(
        base, corpus_file(), tmp_path / "straight", FinetuneOptions(**options), progress=False
    )
    killed = tmp_path / "killed"
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_RUN, str(base), str(killed), json.dumps(options)],
        cwd=Path(__file__).parent,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while latest_train_step(killed / "checkpoints") is None:
            assert child.poll() is None and time.monotonic() < deadline, child.stderr.read()
            time.sleep(0.005)
        time.sleep(random.uniform(0, 0.3))
        assert child.poll() is None, "the run ended before the kill; kill sooner"
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=60)
    finally:
        child.kill()
    done = latest_train_step(killed / "checkpoints")
    assert done < options["steps"]
    again = finetune(base, corpus_file(), killed, FinetuneOptions(**options), progress=False)
    np.testing.assert_array_equal(again.losses, straight.losses[done:])
    for a, b in zip(weights(again.model_dir), weights(straight.model_dir), strict=True):
        np.testing.assert_array_equal(a, b)
    records = [json.loads(line) for line in again.metrics_file.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, options["steps"] + 1))
