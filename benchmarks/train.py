"""Train-step throughput of eqdel (optax AdamW) vs transformers + torch AdamW on the same
random-weight Llama and batch, and eqdel's model-FLOPs utilisation against a float32
matmul peak measured in the same run.

    python benchmarks/train.py [--steps 10]
"""

import argparse
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
import transformers
from _report import LLAMA_SIZES, interleaved_medians, interleaved_times, write

import eqdel
from eqdel._host_memory import rerun_with_huge_pages
from eqdel.train import causal_lm_loss, init_train_state, make_train_step


def matmul_peak(size: int = 2048, repeats: int = 10) -> dict:
    """The best float32 matmul rate XLA and torch reach on this machine."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32)
    matmul = jax.jit(lambda a: a @ a)
    t = torch.randn(size, size)
    times = interleaved_times(
        {"xla": lambda: matmul(a).block_until_ready(), "torch": lambda: t @ t}, repeats
    )
    flops = 2 * size**3
    return {
        "size": size,
        "xla_flops_per_s": flops / min(times["xla"]),
        "torch_flops_per_s": flops / min(times["torch"]),
    }


def model_flops_per_token(sizes: dict, seq: int) -> float:
    """6 x the matmul parameters (embedding lookup excluded, head included) plus the
    attention scores and weighted sums, forward and backward."""
    h, m, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    head_dim = h // sizes["num_attention_heads"]
    kv = sizes["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * m
    matmul_params = layers * per_layer + h * sizes["vocab_size"]
    return 6 * matmul_params + 12 * layers * seq * h


def _eqdel_stepper(model, batch: dict):
    """A function that runs one AdamW train step on `batch` and returns its loss."""
    optimizer = optax.adamw(1e-4)
    step = make_train_step(causal_lm_loss, optimizer)
    state = init_train_state(model, optimizer, jax.random.key(0))

    def run_step() -> float:
        nonlocal state
        state, metrics = step(state, batch)
        return float(metrics["loss"])

    return run_step


def throughput(batch: int, seq: int, vocab: int, steps: int, peak: float) -> dict:
    torch.manual_seed(0)
    sizes = {**LLAMA_SIZES, "vocab_size": vocab}
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    ids = np.random.RandomState(0).randint(0, vocab, (batch, seq))
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        models = {
            scan: eqdel.from_pretrained(tmp, progress=False, scan_layers=scan)
            for scan in (True, False)
        }

    batch_arrays = {"input_ids": jnp.asarray(ids, jnp.int32)}
    steps_by_name, first_losses = {}, {}
    for scan, model in models.items():
        name = "scan" if scan else "unrolled"
        steps_by_name[name] = _eqdel_stepper(model, batch_arrays)
        first_losses[name] = steps_by_name[name]()

    hf_model.train()
    torch_optimizer = torch.optim.AdamW(hf_model.parameters(), lr=1e-4)
    torch_ids = torch.tensor(ids)

    def torch_step():
        loss = hf_model(torch_ids, labels=torch_ids).loss
        loss.backward()
        torch_optimizer.step()
        torch_optimizer.zero_grad(set_to_none=True)
        return loss.item()

    first_losses["torch"] = torch_step()
    seconds = interleaved_medians({**steps_by_name, "torch": torch_step}, steps)
    torch_s = seconds.pop("torch")
    eqdel_s = seconds
    tokens = batch * seq
    best = min(eqdel_s.values())
    achieved = model_flops_per_token(sizes, seq) * tokens / best
    return {
        "vocab": vocab,
        "batch": batch,
        "seq": seq,
        "eqdel_scan_tokens_per_s": tokens / eqdel_s["scan"],
        "eqdel_unrolled_tokens_per_s": tokens / eqdel_s["unrolled"],
        "torch_tokens_per_s": tokens / torch_s,
        "best_speedup": torch_s / best,
        "eqdel_best_model_flops_per_s": achieved,
        "mfu_vs_xla_matmul_peak": achieved / peak,
        "first_loss_eqdel": first_losses["unrolled"],
        "first_loss_torch": first_losses["torch"],
        "torch_threads": torch.get_num_threads(),
        "transformers_attention": hf_model.config._attn_implementation,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--vocabs", default="32000,4096")
    args = parser.parse_args()

    peak = matmul_peak()
    rows = [
        throughput(args.batch, args.seq, int(v), args.steps, peak["xla_flops_per_s"])
        for v in args.vocabs.split(",")
    ]
    write(
        "train",
        {"sizes": LLAMA_SIZES, "peak": peak, "throughput": rows},
        [
            (
                f"Train step (AdamW, float32), batch {args.batch} x {args.seq} tokens, hidden "
                f"{LLAMA_SIZES['hidden_size']}, {LLAMA_SIZES['num_hidden_layers']} layers "
                f"(transformers: {rows[0]['transformers_attention']} attention, "
                f"{rows[0]['torch_threads']} threads); float32 matmul peak: XLA "
                f"{peak['xla_flops_per_s'] / 1e9:.1f} GFLOP/s, torch "
                f"{peak['torch_flops_per_s'] / 1e9:.1f} GFLOP/s",
                [
                    "vocab",
                    "eqdel tokens/s (scan)",
                    "eqdel tokens/s (unrolled)",
                    "torch tokens/s",
                    "best speedup",
                    "eqdel best MFU",
                    "first loss eqdel / torch",
                ],
                [
                    [
                        r["vocab"],
                        f"{r['eqdel_scan_tokens_per_s']:,.0f}",
                        f"{r['eqdel_unrolled_tokens_per_s']:,.0f}",
                        f"{r['torch_tokens_per_s']:,.0f}",
                        f"{r['best_speedup']:.2f}x",
                        f"{100 * r['mfu_vs_xla_matmul_peak']:.0f}%",
                        f"{r['first_loss_eqdel']:.4f} / {r['first_loss_torch']:.4f}",
                    ]
                    for r in rows
                ],
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
