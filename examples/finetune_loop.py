"""A hand-written functional fine-tuning loop: a tiny Llama, text packed into blocks,
batches on a (2, 2, 2, 1) mesh of simulated CPU devices, optax AdamW.

    python examples/finetune_loop.py --steps 30
"""

import argparse

import jax

jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402

import eqdel  # noqa: E402
from eqdel.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from eqdel.train import (  # noqa: E402
    batches,
    causal_lm_loss,
    init_train_state,
    make_train_step,
    pack,
)

TEXT = "the quick brown fox jumps over the lazy dog " * 40


def main(steps: int) -> list[float]:
    vocab = sorted(set(TEXT))
    tokens = [vocab.index(ch) for ch in TEXT]  # a character-level tokenizer
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    mesh = eqdel.ShardingConfig(axis_dims=(2, 2, 2, 1))
    model = eqdel.shard(LlamaForCausalLM(config, key=jax.random.key(0)), mesh)
    optimizer = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))
    state = eqdel.shard(init_train_state(model, optimizer, jax.random.key(1)), mesh)
    step = make_train_step(causal_lm_loss, optimizer)
    losses = []
    data = batches(pack([tokens], 32), 8, seed=0, sharding=mesh)
    for _ in range(steps):
        state, metrics = step(state, next(data))
        losses.append(float(metrics["loss"]))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    main(parser.parse_args().steps)
