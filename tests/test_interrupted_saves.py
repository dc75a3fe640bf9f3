"""Saves killed at random moments: `save_pretrained`, `eqdel convert` and the train-state
checkpoint each leave the old or the new checkpoint, complete and loadable, never a mix;
the user's own files in the directory survive every kill.

A child process saves two different checkpoints to one place in turn, forever; the test
kills it at a random moment and checks what is on disk. `EQDEL_KILLS` sets the number of
kills per kind of save (default 6)."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import equinox as eqx
import numpy as np
import pytest
from tiny import array_leaves, corpus_file, train_tokenizer

import eqdel
from eqdel.train import latest_train_step, restore_train_state

KILLS = int(os.environ.get("EQDEL_KILLS", "6"))
README = b"# my notes: not eqdel's to touch\n"

# Two checkpoints that differ in config and weights: the config says which one was
# loaded, and the weights must then be that one's.
SETUP = textwrap.dedent(
    """
    import jax
    jax.config.update("jax_platforms", "cpu")
    import equinox as eqx, optax
    from eqdel.models import LlamaConfig, LlamaForCausalLM
    from eqdel.train import init_train_state

    def model(which):
        config = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=3, num_attention_heads=4,
                             rms_norm_eps=(1e-5, 1e-6)[which])
        return LlamaForCausalLM(config, key=jax.random.key(which))

    def train_state(step):
        state = init_train_state(model(0), optax.adamw(1e-3), jax.random.key(1))
        bumped = jax.tree.map(lambda x: x + step, eqx.filter(state.model, eqx.is_array))
        return eqx.tree_at(lambda s: (s.step, s.model), state,
                           (state.step + step, eqx.combine(bumped, state.model)))
    """
)

CHILD = SETUP + textwrap.dedent(
    """
    import sys, time
    import eqdel
    from eqdel._cli import main
    from eqdel.train import save_train_state

    kind, out, sources = sys.argv[1], sys.argv[2], sys.argv[3:]
    models = [model(0), model(1)]

    def save(i):
        if kind == "save_pretrained":
            eqdel.save_pretrained(models[i % 2], out, max_shard_size="8KB")
        elif kind == "convert":
            main(["convert", sources[i % 2], out])
        else:
            save_train_state(out, train_state(i + 1))

    save(0)
    start = time.perf_counter()
    save(1)
    print("READY", time.perf_counter() - start, flush=True)
    i = 2
    while True:
        save(i)
        i += 1
    """
)

namespace: dict = {}
exec(SETUP, namespace)
_model, _train_state = namespace["model"], namespace["train_state"]


def _whole_lines(log: Path) -> list[str]:
    """The lines of `log` that end in a newline."""
    return [x for x in log.read_text().splitlines(keepends=True) if x.endswith("\n")]


def _kill_at_random(kind: str, out: Path, sources: list[str], rng: random.Random) -> float:
    """Start a child saving in a loop, kill it at a random moment; the delay used."""
    log = out.with_suffix(".log")
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, kind, str(out), *sources], stdout=sink, stderr=sink
        )
    try:
        deadline = time.monotonic() + 120
        # Only whole lines: the child's buffered output can reach the file mid-line.
        while not (ready := [x for x in _whole_lines(log) if x.startswith("READY ")]):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.01)
        delay = rng.uniform(0, 2.5 * float(ready[0].split()[1]))
        time.sleep(delay)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    return delay


def _check_pretrained(out: Path) -> None:
    loaded = eqdel.from_pretrained(out, progress=False)
    which = [1e-5, 1e-6].index(loaded.config.rms_norm_eps)
    for got, want in zip(array_leaves(loaded), array_leaves(_model(which)), strict=True):
        np.testing.assert_array_equal(got, want)
    assert (out / "README.md").read_bytes() == README
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    eqdel.save_pretrained(_model(0), out)  # the next save still works, and tidies up
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], leftovers


def _check_train_state(out: Path) -> None:
    step = latest_train_step(out)
    assert step is not None and step >= 2
    like = eqx.filter_eval_shape(lambda: _train_state(0))
    restored = restore_train_state(out, like)
    for got, want in zip(array_leaves(restored), array_leaves(_train_state(step)), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("kind", ["save_pretrained", "convert", "train_state"])
def test_killed_saves_leave_a_whole_checkpoint(kind, tmp_path):
    rng = random.Random(f"{kind}-{os.getpid()}-{time.time_ns()}")
    sources = []
    if kind == "convert":
        tokenizer = train_tokenizer(corpus_file().read_text().splitlines(), 300)
        for which in (0, 1):
            source = tmp_path / f"src{which}"
            sources.append(str(eqdel.save_pretrained(_model(which), source, tokenizer=tokenizer)))
    for kill in range(KILLS):
        out = tmp_path / f"out{kill}"
        out.mkdir()
        if kind != "train_state":
            (out / "README.md").write_bytes(README)
        delay = _kill_at_random(kind, out, sources, rng)
        try:
            (_check_train_state if kind == "train_state" else _check_pretrained)(out)
        except Exception as error:
            raise AssertionError(f"killed {delay:.3f} s into the loop: {error}") from error
