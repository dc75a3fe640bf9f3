"""Three train steps of a tiny Llama on a mesh, written once for the one- and the
two-process runs to compare."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from tiny import TINY_LLAMA

import eqdel
from eqdel import axes
from eqdel.models import LlamaForCausalLM
from eqdel.train import (
    causal_lm_loss,
    init_train_state,
    make_train_step,
    restore_train_state,
    save_train_state,
)

CONFIG = TINY_LLAMA
OPTIMIZER = optax.sgd(0.5)


def fresh_state(cfg: eqdel.ShardingConfig):
    model = LlamaForCausalLM(CONFIG, key=jax.random.key(0))
    return eqdel.shard(init_train_state(model, OPTIMIZER, jax.random.key(1)), cfg)


def leaf_sums(state) -> list[float]:
    """The sum of every parameter, replicated so that each process can read it."""
    mesh = jax.tree.leaves(state.model)[0].sharding.mesh
    replicated = NamedSharding(mesh, jax.P())
    sums = jax.jit(lambda t: [jnp.sum(x) for x in jax.tree.leaves(t)], out_shardings=replicated)
    return [float(s.addressable_data(0)) for s in sums(state.model)]


def train(cfg: eqdel.ShardingConfig, checkpoint_dir=None) -> dict:
    """Three steps on fixed batches placed batch-sharded on the (possibly multi-process)
    mesh; saves the final state to `checkpoint_dir` if given."""
    mesh = cfg.mesh()
    state = fresh_state(cfg)
    step = make_train_step(causal_lm_loss, OPTIMIZER)
    losses = []
    for seed in range(3):
        ids = np.random.default_rng(seed).integers(0, CONFIG.vocab_size, (8, 8), np.int32)
        spec = cfg.resolve((axes.BATCH, axes.LENGTH), shape=ids.shape)
        placed = jax.make_array_from_callback(
            ids.shape, NamedSharding(mesh, spec), lambda index, ids=ids: ids[index]
        )
        state, metrics = step(state, {"input_ids": placed})
        losses.append(float(metrics["loss"].addressable_data(0)))
    if checkpoint_dir is not None:
        save_train_state(checkpoint_dir, state)
    return {"losses": losses, "sums": leaf_sums(state)}


def restored_sums(cfg: eqdel.ShardingConfig, checkpoint_dir) -> list[float]:
    return leaf_sums(restore_train_state(checkpoint_dir, fresh_state(cfg)))
