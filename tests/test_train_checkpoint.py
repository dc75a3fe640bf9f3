"""Train-state checkpoints: exact round trips, sharded restore, bit-identical resume,
clear mismatch errors, and saves killed part-way that leave the last good step."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from hf_reference import random_ids
from tiny import TINY_LLAMA, array_leaves

import eqdel
from eqdel.models import LlamaConfig, LlamaForCausalLM
from eqdel.train import (
    AdamW,
    causal_lm_loss,
    init_train_state,
    latest_train_step,
    make_train_step,
    restore_train_state,
    save_train_state,
)

CONFIG = TINY_LLAMA
OPTIMIZER = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))


def fresh_state(seed: int, optimizer=OPTIMIZER):
    model = LlamaForCausalLM(CONFIG, key=jax.random.key(seed))
    return init_train_state(model, optimizer, jax.random.key(seed + 100))


def assert_identical(a, b):
    for x, y in zip(array_leaves(a), array_leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("optimizer", [OPTIMIZER, AdamW(1e-2, max_grad_norm=1.0)])
def test_resume_continues_bit_identically(optimizer, tmp_path):
    step = make_train_step(causal_lm_loss, optimizer)
    data = [{"input_ids": jax.numpy.asarray(random_ids(4, 8, vocab=64, seed=s))} for s in range(4)]

    straight = fresh_state(0, optimizer)
    for batch in data:
        straight, _ = step(straight, batch)

    state = fresh_state(0, optimizer)
    for batch in data[:2]:
        state, _ = step(state, batch)
    save_train_state(tmp_path, state)
    del state
    assert latest_train_step(tmp_path) == 2
    resumed = restore_train_state(tmp_path, fresh_state(7, optimizer))  # other weights
    assert int(resumed.step) == 2
    for batch in data[2:]:
        resumed, _ = step(resumed, batch)
    assert_identical(resumed, straight)


def test_sharded_state_restores_onto_its_mesh(tmp_path):
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    state = eqdel.shard(fresh_state(0), cfg)
    save_train_state(tmp_path, state)
    like = eqdel.shard(eqx.filter_eval_shape(lambda: fresh_state(3)), cfg)
    restored = restore_train_state(tmp_path, like)
    assert_identical(restored, state)
    placed = [x for x in jax.tree.leaves(eqx.filter(restored, eqx.is_array))]
    wanted = [x for x in jax.tree.leaves(eqx.filter(state, eqx.is_array))]
    for got, want in zip(placed, wanted, strict=True):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)


def test_mismatch_and_missing_steps_are_named(tmp_path):
    save_train_state(tmp_path, fresh_state(0), max_to_keep=2)
    with pytest.raises(FileExistsError, match="step 0 is already saved"):
        save_train_state(tmp_path, fresh_state(0))
    with pytest.raises(FileNotFoundError, match=r"no complete checkpoint for step 5 .*\[0\]"):
        restore_train_state(tmp_path, fresh_state(0), step=5)
    wider = LlamaForCausalLM(
        LlamaConfig(**{**vars(CONFIG), "intermediate_size": 96}), key=jax.random.key(0)
    )
    other = init_train_state(wider, OPTIMIZER, jax.random.key(1))
    with pytest.raises(ValueError, match=r"different shape or dtype: .*mlp.down_proj.weight"):
        restore_train_state(tmp_path, other)
    sgd = init_train_state(
        LlamaForCausalLM(CONFIG, key=jax.random.key(0)), optax.sgd(0.1), jax.random.key(1)
    )
    with pytest.raises(ValueError, match=r"unexpected: .*mu"):
        restore_train_state(tmp_path, sgd)


KILLED_SAVER = textwrap.dedent(
    """
    import os, signal, sys
    import jax
    jax.config.update("jax_platforms", "cpu")
    import equinox as eqx, optax
    from eqdel.models import LlamaConfig, LlamaForCausalLM
    from eqdel.train import init_train_state, save_train_state

    directory, when = sys.argv[1], sys.argv[2]
    config = LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=512,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    state = init_train_state(model, optax.adamw(1e-3), jax.random.key(1))
    save_train_state(directory, state)
    if when == "before-commit":
        # Everything is written; die at the rename that would publish the step.
        from orbax.checkpoint._src.path import async_path

        async def die(*args, **kwargs):
            os.kill(os.getpid(), signal.SIGKILL)

        async_path.rename = die
    print("SAVING", flush=True)
    save_train_state(directory, eqx.tree_at(lambda s: s.step, state, state.step + 1))
    print("SAVED", flush=True)
    """
)


@pytest.mark.parametrize("when", ["before-commit", "while-writing"])
def test_killed_save_leaves_the_previous_step_loadable(tmp_path, when):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_SAVER, str(tmp_path), when],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout.readline().strip() == "SAVING", proc.stderr.read()[-3000:]
        if when == "while-writing":
            deadline = time.monotonic() + 60
            while not any(p.name != "0" for p in tmp_path.iterdir()):
                assert time.monotonic() < deadline and proc.poll() is None
                time.sleep(0.001)
            proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == -signal.SIGKILL
    assert latest_train_step(tmp_path) == 0  # the interrupted step 1 is not taken as done
    big = LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    state = init_train_state(
        LlamaForCausalLM(big, key=jax.random.key(0)), optax.adamw(1e-3), jax.random.key(1)
    )
    assert_identical(restore_train_state(tmp_path, eqx.filter_eval_shape(lambda: state)), state)
    save_train_state(tmp_path, eqx.tree_at(lambda s: s.step, state, state.step + 1))
    assert latest_train_step(tmp_path) == 1  # and the run can save that step again
