"""Train-step throughput of eqdel (`eqdel.train.AdamW`) vs transformers + torch AdamW on the same
random-weight Llama and batch, and eqdel's model-FLOPs utilisation against a float32
matmul peak measured in the same run, with torch's utilisation and the speedup eqdel
would reach at that peak.

    python benchmarks/train.py [--steps 10]
"""

import argparse
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _report import (
    LLAMA_SIZES,
    forward_flops_per_token,
    interleaved_medians,
    matmul_peak,
    torch_train_step,
    write,
)

import eqdel
from eqdel._host_memory import rerun_with_huge_pages
from eqdel.train import AdamW, causal_lm_loss, init_train_state, make_train_step


def _eqdel_stepper(model, batch: dict):
    """A function that runs one AdamW train step on `batch` and returns its loss."""
    optimizer = AdamW(1e-4, weight_decay=0.01)  # torch.optim.AdamW's defaults
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

    torch_step = torch_train_step(hf_model, ids, lr=1e-4)
    first_losses["torch"] = torch_step()
    seconds = interleaved_medians({**steps_by_name, "torch": torch_step}, steps)
    torch_s = seconds.pop("torch")
    eqdel_s = seconds
    tokens = batch * seq
    best = min(eqdel_s.values())
    step_flops = 3 * forward_flops_per_token(sizes, seq) * tokens
    return {
        "vocab": vocab,
        "batch": batch,
        "seq": seq,
        "eqdel_scan_tokens_per_s": tokens / eqdel_s["scan"],
        "eqdel_unrolled_tokens_per_s": tokens / eqdel_s["unrolled"],
        "torch_tokens_per_s": tokens / torch_s,
        "best_speedup": torch_s / best,
        "eqdel_best_model_flops_per_s": step_flops / best,
        "mfu_vs_xla_matmul_peak": step_flops / best / peak,
        "torch_mfu_vs_xla_matmul_peak": step_flops / torch_s / peak,
        "speedup_at_peak": torch_s / (step_flops / peak),
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
                    "torch MFU",
                    "speedup at 100% MFU",
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
                        f"{100 * r['torch_mfu_vs_xla_matmul_peak']:.0f}%",
                        f"{r['speedup_at_peak']:.2f}x",
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
