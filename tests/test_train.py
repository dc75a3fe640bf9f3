"""Loss, train steps, gradient accumulation, frozen leaves and non-finite handling."""

import contextlib
import dataclasses
import logging
import re
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from hf_reference import make_hf_model, random_ids
from tiny import TINY_LLAMA

import eqdel
from eqdel.models import GemmaConfig, LlamaForCausalLM
from eqdel.nn import Linear
from eqdel.train import (
    IGNORE_INDEX,
    NonFiniteError,
    causal_lm_loss,
    chunked_cross_entropy,
    init_train_state,
    make_train_step,
)

CONFIG = TINY_LLAMA


def batch_of(ids, **extra):
    return {"input_ids": jnp.asarray(ids), **{k: jnp.asarray(v) for k, v in extra.items()}}


def test_loss_matches_transformers_with_padding_and_ignored_labels(tmp_path):
    hf_model = make_hf_model("llama")
    hf_model.save_pretrained(tmp_path)
    model = eqdel.from_pretrained(tmp_path, progress=False)
    ids = random_ids(2, 10)
    mask = np.ones_like(ids)
    mask[1, 7:] = 0
    labels = np.where(mask == 1, ids, IGNORE_INDEX)
    labels[0, :3] = IGNORE_INDEX  # a prompt excluded from the loss
    with torch.no_grad():
        want = hf_model(
            torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels)
        ).loss.item()
    loss_sum, count = causal_lm_loss(
        model, batch_of(ids, attention_mask=mask, labels=labels), chunk_size=4
    )
    assert int(count) == (labels[:, 1:] != IGNORE_INDEX).sum()
    np.testing.assert_allclose(float(loss_sum / count), want, rtol=1e-6)


def test_chunk_size_does_not_change_loss_or_gradients(getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    batch = batch_of(random_ids(2, 9, vocab=64))

    def mean_loss(model, chunk):
        loss_sum, count = causal_lm_loss(model, batch, chunk_size=chunk)
        return loss_sum / count

    big = eqx.filter_value_and_grad(lambda m: mean_loss(m, 1024))(model)
    small = eqx.filter_value_and_grad(lambda m: mean_loss(m, 5))(model)
    for a, b in zip(jax.tree.leaves(big), jax.tree.leaves(small)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def _loss_from_full_logits(model, batch):
    """The masked mean cross-entropy from `model(...).logits`, differentiated by JAX."""
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    logits = model(ids, attention_mask=mask).logits[:, :-1]
    weights = (mask[:, 1:] == 1) & (labels[:, 1:] != IGNORE_INDEX)
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits, jnp.where(weights, labels[:, 1:], 0)
    )
    weights = weights.astype(jnp.float32)
    return jnp.sum(losses * weights) / jnp.sum(weights)


@pytest.mark.parametrize(
    "config",
    [
        CONFIG,
        dataclasses.replace(CONFIG, tie_word_embeddings=True),
        GemmaConfig(
            **{
                **dataclasses.asdict(CONFIG),
                "model_type": "gemma2",
                "head_dim": 8,
                "tie_word_embeddings": True,
            },
            final_logit_softcapping=3.0,
        ),
    ],
    ids=["untied", "tied", "soft-capped"],
)
def test_loss_gradients_equal_autodiff_of_the_full_logits(config, getkey):
    model = eqdel.models.MODEL_TYPES[config.model_type](config, key=getkey())
    ids = random_ids(3, 11, vocab=64, seed=4)
    mask = np.ones_like(ids)
    mask[2, 6:] = 0
    labels = np.where(mask == 1, ids, IGNORE_INDEX)
    labels[0, :4] = IGNORE_INDEX
    batch = batch_of(ids, attention_mask=mask, labels=labels)

    def fused(model):
        loss_sum, count = causal_lm_loss(model, batch, chunk_size=7)  # 30 tokens: 5 chunks
        return loss_sum / count

    want = eqx.filter_value_and_grad(_loss_from_full_logits)(model, batch)
    got = eqx.filter_value_and_grad(fused)(model)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)


def test_a_closure_head_gets_its_gradient():
    weight = jax.random.normal(jax.random.key(0), (8, 16))
    hidden = jax.random.normal(jax.random.key(1), (5, 8))
    labels, weights = jnp.arange(5), jnp.array([1.0, 1.0, 0.0, 1.0, 1.0])

    def fused(weight, hidden):
        head = lambda x: x @ weight  # noqa: E731
        return chunked_cross_entropy(head, hidden, labels, weights, chunk_size=2)

    def full(weight, hidden):
        log_p = jax.nn.log_softmax(hidden @ weight)
        return -jnp.sum(log_p[jnp.arange(5), labels] * weights)

    got = jax.value_and_grad(fused, argnums=(0, 1))(weight, hidden)
    want = jax.value_and_grad(full, argnums=(0, 1))(weight, hidden)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def copies_and_transposes(fn, *args) -> int:
    """How many copy or transpose instructions XLA compiled into `fn`."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    return len(re.findall(r"= \S+ (?:copy|transpose)\(", hlo))


def test_linear_backward_on_cpu_copies_no_operand(getkey):
    """The weight gradient of a linear layer over `[batch, seq]` tokens contracts one
    flattened token dimension: contracting two, XLA's CPU backend copies both operands
    into transposed layouts first."""
    linear = Linear(64, 96, axes=(None, None), key=getkey())
    x = jax.random.normal(getkey(), (4, 32, 64))

    def grads(weight, x, call):
        return jax.grad(lambda w, x: jnp.sum(jnp.sin(call(w, x))), argnums=(0, 1))(weight, x)

    def through_layer(weight, x):
        return grads(weight, x, lambda w, x: eqx.tree_at(lambda m: m.weight, linear, w)(x))

    def contracting_two(weight, x):
        return grads(weight, x, lambda w, x: x @ w)

    assert copies_and_transposes(contracting_two, linear.weight, x) > 0
    assert copies_and_transposes(through_layer, linear.weight, x) == 0
    for got, want in zip(through_layer(linear.weight, x), contracting_two(linear.weight, x)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_gradient_accumulation_equals_one_large_batch(getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    # SGD: the update is lr x the gradient, so equal gradients give equal parameters (Adam's
    # first step sends every entry to +-lr, turning rounding in near-zero gradients into
    # visible differences).
    optimizer = optax.sgd(0.5)
    ids = random_ids(8, 8, vocab=64, seed=5)  # accumulating 4 x 2 and 2 x 4 against 8
    mask = np.ones_like(ids)
    mask[3, 5:] = 0  # unequal token counts per micro-batch
    batch = batch_of(ids, attention_mask=mask)
    states, metrics = [], []
    for accum in (1, 2, 4):
        step = make_train_step(causal_lm_loss, optimizer, grad_accum_steps=accum, donate=False)
        state, m = step(init_train_state(model, optimizer, getkey()), batch)
        states.append(state)
        metrics.append(m)
    for state, m in zip(states[1:], metrics[1:]):
        np.testing.assert_allclose(float(m["loss"]), float(metrics[0]["loss"]), rtol=1e-6)
        np.testing.assert_allclose(
            float(m["grad_norm"]), float(metrics[0]["grad_norm"]), rtol=1e-5
        )
        assert float(m["tokens"]) == float(metrics[0]["tokens"]) == 8 * 7 - 3
        for a, b in zip(jax.tree.leaves(state.model), jax.tree.leaves(states[0].model)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_loss_falls_and_frozen_leaves_stay(getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-2))
    frozen_embeddings = jax.tree.map(lambda _: True, model)
    frozen_embeddings = eqx.tree_at(
        lambda m: m.model.embed_tokens.weight, frozen_embeddings, replace=False
    )
    state = init_train_state(model, optimizer, getkey(), trainable=frozen_embeddings)
    trained = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    all_params = sum(x.size for x in jax.tree.leaves(model))
    embed = model.model.embed_tokens.weight.size
    assert trained == 2 * (all_params - embed)  # adam's two moments, embeddings left out
    step = make_train_step(causal_lm_loss, optimizer, trainable=frozen_embeddings)
    batch = batch_of(random_ids(4, 12, vocab=64, seed=1))
    before = np.asarray(model.model.embed_tokens.weight)
    losses = []
    for _ in range(30):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < 0.5 * losses[0]
    assert all(np.mean(losses[i : i + 5]) > np.mean(losses[i + 5 : i + 10]) for i in (0, 10, 20))
    assert int(state.step) == 30
    np.testing.assert_array_equal(np.asarray(state.model.model.embed_tokens.weight), before)


def test_non_finite_loss_raises_naming_step_or_is_skipped(getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    optimizer = optax.sgd(1e-2)
    batch = batch_of(random_ids(2, 6, vocab=64))

    def poisoned(model, batch):
        loss_sum, count = causal_lm_loss(model, batch)
        return loss_sum * jnp.inf, count

    state = init_train_state(model, optimizer, getkey())
    state, _ = make_train_step(causal_lm_loss, optimizer)(state, batch)
    good = [np.asarray(x) for x in jax.tree.leaves(state.model)]
    with pytest.raises(NonFiniteError, match=r"non-finite loss .* at step 1") as caught:
        make_train_step(poisoned, optimizer)(state, batch)
    kept = caught.value.state  # the input was donated; the error carries it unchanged
    assert int(kept.step) == 1
    for a, b in zip(jax.tree.leaves(kept.model), good):
        np.testing.assert_array_equal(np.asarray(a), b)

    skipping = make_train_step(poisoned, optimizer, skip_nonfinite=True, donate=False)
    after, metrics = skipping(kept, batch)
    assert not bool(metrics["finite"]) and int(after.step) == 1
    for a, b in zip(jax.tree.leaves(after.model), jax.tree.leaves(kept.model)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "dims, activated",
    [((1, 2, 2, 2), False), ((1, 2, 2, 2), True), ((2, 4, 1, 1), True), ((2, 2, 2, 1), False)],
)
def test_three_train_steps_on_a_mesh_equal_single_device(dims, activated, getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    # SGD, so parameters differ only by lr x gradient differences (Adam's first step
    # normalises each gradient entry to about +-lr, magnifying rounding near zero).
    optimizer = optax.sgd(0.5)
    cfg = eqdel.ShardingConfig(axis_dims=dims)
    data = [batch_of(random_ids(4, 8, vocab=64, seed=s)) for s in range(3)]
    step = make_train_step(causal_lm_loss, optimizer)
    single = init_train_state(model, optimizer, jax.random.key(1))
    sharded = eqdel.shard(init_train_state(model, optimizer, jax.random.key(1)), cfg)
    for batch in data:
        single, single_metrics = step(single, batch)
        spec = cfg.resolve((eqdel.axes.BATCH, eqdel.axes.LENGTH), shape=(4, 8))
        placed = jax.device_put(batch, jax.sharding.NamedSharding(cfg.mesh(), spec))
        with cfg.activate() if activated else contextlib.nullcontext():
            sharded, sharded_metrics = step(sharded, placed)
        np.testing.assert_allclose(
            float(sharded_metrics["loss"]), float(single_metrics["loss"]), rtol=1e-6
        )
    for a, b in zip(jax.tree.leaves(sharded.model), jax.tree.leaves(single.model)):
        assert len(a.sharding.device_set) == 8
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _step_compilations(caplog, run) -> int:
    """How many times `run()` compiles a train step."""
    caplog.clear()
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        run()
    return sum("Finished XLA compilation of jit(checked_fun)" in r.message for r in caplog.records)


@pytest.mark.parametrize("sharded", ["no", "state", "model"])
def test_a_train_step_compiles_once(sharded, caplog, getkey):
    """The state `init_train_state` returns is placed as the step's outputs are, so the
    second step does not compile the step again. The model is placed on a device, as
    `from_pretrained` places it; the counters `jnp` makes and a fresh key are not, and
    JAX compiles a call whose arrays are partly placed apart from the same call with all
    of them placed."""
    model = jax.device_put(LlamaForCausalLM(CONFIG, key=getkey()), jax.devices()[0])
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    if sharded == "model":
        model = eqdel.shard(model, cfg)
    optimizer = optax.adamw(1e-3)
    state = init_train_state(model, optimizer, jax.random.key(1))
    batch = batch_of(random_ids(4, 8, vocab=64, seed=0))
    if sharded == "state":
        state = eqdel.shard(state, cfg)
    if sharded != "no":
        spec = cfg.resolve((eqdel.axes.BATCH, eqdel.axes.LENGTH), shape=(4, 8))
        batch = jax.device_put(batch, jax.sharding.NamedSharding(cfg.mesh(), spec))
    step = make_train_step(causal_lm_loss, optimizer)

    def three_steps():
        nonlocal state
        for _ in range(3):
            state, metrics = step(state, batch)
        float(metrics["loss"])

    assert _step_compilations(caplog, three_steps) == 1


FSDP_AND_SP_STEP = textwrap.dedent(
    """
    import sys
    import jax
    jax.config.update("jax_num_cpu_devices", 8)
    import optax
    import eqdel
    from eqdel.models import LlamaConfig, LlamaForCausalLM
    from eqdel.train import batches, causal_lm_loss, init_train_state, make_train_step

    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    optimizer = optax.adamw(1e-3)
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    state = eqdel.shard(init_train_state(model, optimizer, jax.random.key(1)), cfg)
    step = make_train_step(causal_lm_loss, optimizer)
    batch = next(batches(jax.numpy.zeros((8, 32), int) + 3, 8, seed=0, sharding=cfg))
    with cfg.activate():
        state, metrics = step(state, batch)
    print(float(metrics["loss"]))
    """
)


def test_activated_train_step_never_replicates_activations_to_reshard():
    """On a mesh that shards `embed` parameters over the axes carrying the batch and the
    sequence (fsdp and sp), constraining hidden states between layers leaves XLA no
    activation it must replicate to reshard ("Involuntary full rematerialization")."""
    out = subprocess.run(
        [sys.executable, "-c", FSDP_AND_SP_STEP], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Involuntary full rematerialization" not in out.stderr


@pytest.mark.parametrize("policy", ["full", "dots_saveable", "nothing_saveable"])
def test_remat_policies_give_the_same_gradients(policy, getkey):
    import dataclasses

    key = getkey()
    model = LlamaForCausalLM(CONFIG, key=key)
    remat = LlamaForCausalLM(dataclasses.replace(CONFIG, remat_policy=policy), key=key)
    batch = batch_of(random_ids(2, 8, vocab=64))

    def mean_loss(model):
        loss_sum, count = causal_lm_loss(model, batch)
        return loss_sum / count

    plain = eqx.filter_grad(mean_loss)(model)
    rematerialised = eqx.filter_grad(mean_loss)(remat)
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(rematerialised)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
    jaxpr = str(jax.make_jaxpr(eqx.filter_grad(mean_loss))(remat))
    assert "checkpoint" in jaxpr or "remat" in jaxpr
    with pytest.raises(ValueError, match="Unknown remat_policy 'some'"):
        dataclasses.replace(CONFIG, remat_policy="some")


def test_data_reads_packs_and_shuffles_deterministically(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from eqdel.train import batches, pack, read_texts, tokenize

    (tmp_path / "data.jsonl").write_text('{"text": "a b"}\n\n{"text": "c"}\n')
    assert read_texts(tmp_path / "data.jsonl") == ["a b", "c"]
    (tmp_path / "bad.jsonl").write_text('{"text": "a"}\n{"body": "b"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: record has no 'text' field"):
        read_texts(tmp_path / "bad.jsonl")
    (tmp_path / "data.txt").write_text("one\n\ntwo\n")
    assert read_texts(tmp_path / "data.txt") == ["one", "two"]

    words = {w: i for i, w in enumerate(["<unk>", "one", "two", "a", "b", "c"])}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    assert tokenize(["a b", "c", "one zzz two"], tokenizer) == [[3, 4], [5], [1, 0, 2]]

    blocks = pack([[1, 2, 3], [4, 5], [6, 7, 8, 9]], 4, eos_token_id=0)
    np.testing.assert_array_equal(blocks, [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]])
    with pytest.raises(ValueError, match="do not fill one block of 16"):
        pack([[1, 2]], 16)

    many = pack([list(range(64))], 4)
    first = [b["input_ids"] for b in batches(many, 4, seed=3, epochs=2)]
    again = [b["input_ids"] for b in batches(many, 4, seed=3, epochs=2)]
    other = [b["input_ids"] for b in batches(many, 4, seed=4, epochs=2)]
    assert len(first) == 8
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other))
    resumed = [b["input_ids"] for b in batches(many, 4, seed=3, epochs=2, skip=5)]
    assert len(resumed) == 3
    assert all(np.array_equal(a, b) for a, b in zip(first[5:], resumed, strict=True))
    seen = np.sort(np.concatenate(first[:4]).reshape(-1))
    np.testing.assert_array_equal(seen, np.arange(64))  # one epoch covers every block once

    cfg = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))
    placed = next(batches(many, 4, sharding=cfg))["input_ids"]
    assert placed.sharding.spec == jax.sharding.PartitionSpec(("dp", "fsdp"), "sp")


def test_bfloat16_compute_keeps_float32_state_and_trains(getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    optimizer = optax.adamw(1e-2)
    batch = batch_of(random_ids(4, 12, vocab=64, seed=2))
    mixed = make_train_step(causal_lm_loss, optimizer, compute_dtype=jnp.bfloat16, donate=False)
    plain = make_train_step(causal_lm_loss, optimizer, donate=False)
    state = init_train_state(model, optimizer, getkey())
    _, want = plain(state, batch)
    losses = []
    for _ in range(15):
        state, metrics = mixed(state, batch)
        losses.append(float(metrics["loss"]))
        if len(losses) == 1:
            assert losses[0] != float(want["loss"])  # computed in bfloat16: rounded ...
            np.testing.assert_allclose(losses[0], float(want["loss"]), rtol=1e-2)  # ... a bit
            np.testing.assert_allclose(
                float(metrics["grad_norm"]), float(want["grad_norm"]), rtol=5e-2
            )
    assert losses[-1] < 0.6 * losses[0]
    dtypes = {x.dtype for x in jax.tree.leaves(eqx.filter(state, eqx.is_inexact_array))}
    assert dtypes == {jnp.dtype(jnp.float32)}
