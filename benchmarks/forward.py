"""Prefill throughput of eqdel vs transformers on the same random-weight Llama, and compile
time against depth with scan over layers on and off. Utilisation is model FLOPs against
a float32 matmul peak measured in the same run; "speedup at 100% MFU" is the speedup over
transformers of a forward that ran every model FLOP at that peak.

    python benchmarks/forward.py [--repeats 10]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _report import LLAMA_SIZES, forward_flops_per_token, interleaved_medians, matmul_peak, write

import eqdel
from eqdel._host_memory import rerun_with_huge_pages


def throughput(batch: int, seq: int, vocab: int, repeats: int, peak: float) -> dict:
    torch.manual_seed(0)
    sizes = {**LLAMA_SIZES, "vocab_size": vocab}
    hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)).eval()
    ids = np.random.RandomState(0).randint(0, vocab, (batch, seq))
    with tempfile.TemporaryDirectory() as tmp:
        hf_model.save_pretrained(tmp)
        model = eqdel.from_pretrained(tmp, progress=False)

    forward = jax.jit(lambda m, i: m(i).logits)
    jax_ids = jnp.asarray(ids)
    torch_ids = torch.tensor(ids)

    def hf_forward():
        with torch.no_grad():
            hf_model(torch_ids)

    seconds = interleaved_medians(
        {"eqdel": lambda: forward(model, jax_ids).block_until_ready(), "hf": hf_forward}, repeats
    )
    eqdel_s, hf_s = seconds["eqdel"], seconds["hf"]
    with torch.no_grad():
        difference = float(
            np.abs(np.asarray(forward(model, jax_ids)) - hf_model(torch_ids).logits.numpy()).max()
        )
    tokens = batch * seq
    flops = forward_flops_per_token(sizes, seq) * tokens
    return {
        "vocab": vocab,
        "batch": batch,
        "seq": seq,
        "eqdel_tokens_per_s": tokens / eqdel_s,
        "transformers_tokens_per_s": tokens / hf_s,
        "speedup": hf_s / eqdel_s,
        "eqdel_mfu_vs_xla_matmul_peak": flops / eqdel_s / peak,
        "transformers_mfu_vs_xla_matmul_peak": flops / hf_s / peak,
        "speedup_at_peak": hf_s / (flops / peak),
        "max_abs_logit_difference": difference,
        "torch_threads": torch.get_num_threads(),
        "transformers_attention": hf_model.config._attn_implementation,
    }


def compile_times(depths, seq: int) -> list[dict]:
    rows = []
    for depth in depths:
        for scan in (True, False):
            config = eqdel.models.LlamaConfig(
                **{**LLAMA_SIZES, "vocab_size": 1024, "num_hidden_layers": depth}, scan_layers=scan
            )
            model = eqx_model(config)
            ids = jnp.zeros((1, seq), jnp.int32)
            start = time.perf_counter()
            jax.jit(lambda m, i: m(i).logits).lower(model, ids).compile()
            rows.append({"layers": depth, "scan": scan, "compile_s": time.perf_counter() - start})
    return rows


def eqx_model(config):
    return eqdel.models.LlamaForCausalLM(config, key=jax.random.key(0))


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--depths", default="2,8,32")
    parser.add_argument(
        "--vocabs",
        default="32000,4096",
        help="vocabulary sizes; at 32000 the language-model head dominates the forward",
    )
    args = parser.parse_args()

    peak = matmul_peak()
    speeds = [
        throughput(args.batch, args.seq, int(v), args.repeats, peak["xla_flops_per_s"])
        for v in args.vocabs.split(",")
    ]
    compiles = compile_times([int(d) for d in args.depths.split(",")], args.seq)
    write(
        "forward",
        {"sizes": LLAMA_SIZES, "peak": peak, "throughput": speeds, "compile": compiles},
        [
            (
                f"Prefill, float32, batch {args.batch} x {args.seq} tokens, "
                f"hidden {LLAMA_SIZES['hidden_size']}, {LLAMA_SIZES['num_hidden_layers']} layers "
                f"(transformers: {speeds[0]['transformers_attention']} attention, "
                f"{speeds[0]['torch_threads']} threads); float32 matmul peak: XLA "
                f"{peak['xla_flops_per_s'] / 1e9:.1f} GFLOP/s",
                [
                    "vocab",
                    "eqdel tokens/s",
                    "transformers tokens/s",
                    "speedup",
                    "eqdel MFU",
                    "transformers MFU",
                    "speedup at 100% MFU",
                    "max abs diff",
                ],
                [
                    [
                        s["vocab"],
                        f"{s['eqdel_tokens_per_s']:,.0f}",
                        f"{s['transformers_tokens_per_s']:,.0f}",
                        f"{s['speedup']:.2f}x",
                        f"{100 * s['eqdel_mfu_vs_xla_matmul_peak']:.0f}%",
                        f"{100 * s['transformers_mfu_vs_xla_matmul_peak']:.0f}%",
                        f"{s['speedup_at_peak']:.2f}x",
                        f"{s['max_abs_logit_difference']:.1e}",
                    ]
                    for s in speeds
                ],
            ),
            (
                f"Compile time (s), 1 x {args.seq} tokens",
                ["layers", "scan", "unrolled"],
                [
                    [d, f"{scan['compile_s']:.2f}", f"{unrolled['compile_s']:.2f}"]
                    for d, scan, unrolled in (
                        (r["layers"], r, u) for r, u in zip(compiles[::2], compiles[1::2])
                    )
                ],
            ),
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    Path(__file__).parent.joinpath("results").mkdir(exist_ok=True)
    main()
