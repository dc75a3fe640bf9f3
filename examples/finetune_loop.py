"""A hand-written functional LoRA fine-tuning loop: a tiny Llama with rank-8 adapters on
every projection, text packed into blocks, batches on a (2, 2, 2, 1) mesh of
simulated CPU devices, optax AdamW on the adapters alone, and the adapter saved in PEFT's
format.

    python examples/finetune_loop.py --steps 30 [--lora-rank 0: train every weight]
        [--output adapter_dir]
"""

import argparse
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import eqdel  # noqa: E402
from eqdel.models import LlamaConfig, LlamaForCausalLM  # noqa: E402
from eqdel.train import (  # noqa: E402
    AdamW,
    batches,
    causal_lm_loss,
    init_train_state,
    make_train_step,
    pack,
)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TEXT = "the quick brown fox jumps over the lazy dog " * 40


def main(steps: int, lora_rank: int, output: Path | None) -> list[float]:
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
    model = LlamaForCausalLM(config, key=jax.random.key(0))
    trainable = None  # every weight
    if lora_rank:
        model = eqdel.apply_lora(
            model,
            rank=lora_rank,
            alpha=2 * lora_rank,
            targets=LORA_TARGETS,
            key=jax.random.key(2),
        )
        trainable = eqdel.lora_filter(model)  # adapters only; the base stays frozen
    model = eqdel.shard(model, mesh)
    optimizer = AdamW(1e-2, max_grad_norm=1.0)  # optax's clipped AdamW, one pass
    state = init_train_state(model, optimizer, jax.random.key(1), trainable=trainable)
    state = eqdel.shard(state, mesh)
    step = make_train_step(causal_lm_loss, optimizer, trainable=trainable)
    losses = []
    data = batches(pack([tokens], 32), 8, seed=0, sharding=mesh)
    with mesh.activate():  # models constrain their activations to the mesh
        for _ in range(steps):
            state, metrics = step(state, next(data))
            losses.append(float(metrics["loss"]))
    print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {steps} steps")
    if lora_rank and output is not None:
        eqdel.save_lora(state.model, output)  # adapter_config.json + adapter_model.safetensors
        print(f"adapter saved to {output}")
    return losses


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lora-rank", type=int, default=8, help="0: train every weight")
    parser.add_argument("--output", type=Path, help="where to save the LoRA adapter")
    args = parser.parse_args()
    main(args.steps, args.lora_rank, args.output)
