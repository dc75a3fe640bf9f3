"""eqdel against transformers on a real model's shapes (SmolLM2-135M-Instruct by default,
both reading the same GGUF file), each in a process of its own, their calls alternating:
prefill, greedy decode at batch 1 and 8, and a full AdamW train step, in float32 and
bfloat16. Prefill and training are also given as model-FLOP utilisation against a matmul
peak measured in the same run, decode as bytes of weights read per second against a
measured copy bandwidth.

    python benchmarks/real_model.py [--model FILE.gguf] [--dtypes float32,bfloat16]
"""

import argparse
import contextlib
import functools
import multiprocessing
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from _report import (
    forward_flops_per_token,
    interleaved_medians,
    interleaved_times,
    matmul_peak,
    torch_greedy,
    torch_train_step,
    write,
)

import eqdel
from eqdel._demo import perplexity_text_file
from eqdel._host_memory import rerun_with_huge_pages
from eqdel.train import AdamW, causal_lm_loss, init_train_state, make_train_step

_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TRAIN_REMAT = "dots_with_no_batch_dims_saveable"
"""eqdel's remat policy: only the weight products' outputs are saved for the backward
pass, as the training guide advises on CPU (the step writes half the memory and is
1.2-1.8x as fast). It changes nothing outside differentiation."""


def copy_bandwidth(megabytes: int = 1024) -> float:
    """Bytes per second read plus written by the best of a few large float32 copies."""
    source = np.ones(megabytes * 2**20 // 4, np.float32)
    target = np.empty_like(source)
    best = min(interleaved_times({"copy": lambda: np.copyto(target, source)}, 5)["copy"])
    return 2 * source.nbytes / best


def _sizes(config) -> dict:
    return dict(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        vocab_size=config.vocab_size,
    )


def _weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter, the embedding once (the
    tied head reads it; the lookup reads a row per token)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(model) if hasattr(leaf, "nbytes"))


def _eqdel_tasks(path: Path, dtype: str, args, prefill_ids: np.ndarray, prompts: dict):
    """eqdel's timed calls, and its prefill logits (float32), greedy tokens, prefill
    compile time, bytes of weights and sizes."""
    model = eqdel.from_pretrained(path, dtype=dtype, progress=False, remat_policy=TRAIN_REMAT)
    forward = jax.jit(lambda m, i: m(i).logits)
    ids = jnp.asarray(prefill_ids)
    start = time.perf_counter()
    forward.lower(model, ids).compile()
    compile_s = time.perf_counter() - start
    prepared = model.for_generation()  # built once, as the eqdel commands do

    def decode(rows: int, model=prepared):
        prompt = jnp.asarray(prompts[rows])
        return lambda: eqdel.generate(
            model, prompt, max_new_tokens=args.new, eos_token_id=[]
        ).block_until_ready()

    @functools.cache  # first called once prefill and decode are done: the step donates
    def train_step():  # the model's arrays
        optimizer = AdamW(1e-5, weight_decay=0.01)  # torch.optim.AdamW's defaults
        step = make_train_step(causal_lm_loss, optimizer)
        state = init_train_state(model, optimizer, jax.random.key(0))
        batch = {"input_ids": jnp.asarray(prefill_ids, jnp.int32)}

        def run():
            nonlocal state
            state, metrics = step(state, batch)
            return float(metrics["loss"])

        return run

    tasks = {
        "prefill": lambda: forward(model, ids).block_until_ready(),
        "decode_b1": decode(1),
        "decode_b8": decode(8),
        # the stacked model: generate builds the generation form in every call
        "decode_b1_stacked": decode(1, model),
        "train": lambda: train_step()(),
    }
    checks = {
        "prefill_logits": np.asarray(forward(model, ids), np.float32),
        "tokens": {rows: np.asarray(tasks[f"decode_b{rows}"]()) for rows in prompts},
        "compile_prefill_s": compile_s,
        "weight_bytes": _weight_bytes(model),
        "sizes": _sizes(model.config),
    }
    return tasks, checks


def _transformers_tasks(path: Path, dtype: str, args, prefill_ids: np.ndarray, prompts: dict):
    """transformers' timed calls, and its prefill logits (float32) and greedy tokens."""
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=_TORCH_DTYPES[dtype]
    ).eval()

    def prefill():
        with torch.no_grad():
            return hf_model(torch.tensor(prefill_ids)).logits

    @functools.cache  # first called once prefill and decode are done: it sets training mode
    def train_step():
        return torch_train_step(hf_model, prefill_ids, lr=1e-5)

    tasks = {
        "prefill": prefill,
        **{f"decode_b{rows}": torch_greedy(hf_model, prompts[rows], args.new) for rows in prompts},
        "train": lambda: train_step()(),
    }
    checks = {
        "prefill_logits": prefill().float().numpy(),
        "tokens": {rows: tasks[f"decode_b{rows}"]().numpy() for rows in prompts},
    }
    return tasks, checks


_FRAMEWORKS = {"eqdel": _eqdel_tasks, "transformers": _transformers_tasks}


def _serve(connection, framework: str, *task_args) -> None:
    """A worker process holding one framework's model: sends its checks, then runs each
    task it is sent and answers with the task's seconds, until it is sent `None`."""
    tasks, checks = _FRAMEWORKS[framework](*task_args)
    connection.send(checks)
    while (task := connection.recv()) is not None:
        start = time.perf_counter()
        tasks[task]()
        connection.send(time.perf_counter() - start)


def measure(path: Path, dtype: str, args, ids: np.ndarray, peak: float, bandwidth: float):
    """Prefill, decode at batch 1 and 8, and a train step of both frameworks in `dtype`;
    also each framework's prefill logits (float32) for the comparison across dtypes.

    Each framework runs in a process of its own, and the calls alternate between them:
    in one process, each framework's calls paid for the page faults of memory the other
    had freed (see docs/performance.md, "Huge pages on CPU"), which no user who runs one
    of them meets."""
    batch, seq = args.batch, args.seq
    prefill_ids = ids[: batch * seq].reshape(batch, seq)
    prompts = {rows: ids[: rows * args.prompt].reshape(rows, args.prompt) for rows in (1, 8)}
    context = multiprocessing.get_context("spawn")
    connections, processes, checks = {}, [], {}
    try:
        for framework in _FRAMEWORKS:
            connections[framework], there = context.Pipe()
            process = context.Process(
                target=_serve, args=(there, framework, path, dtype, args, prefill_ids, prompts)
            )
            process.start()
            processes.append(process)
            checks[framework] = connections[framework].recv()

        def remote(framework: str, task: str) -> float:
            connections[framework].send(task)
            return connections[framework].recv()

        def seconds(task: str, **calls) -> dict[str, float]:
            calls = {name: functools.partial(remote, name, task) for name in _FRAMEWORKS} | calls
            return interleaved_medians(calls, args.repeats, self_timed=True)

        ours = checks["eqdel"]
        logits = {name: c["prefill_logits"] for name, c in checks.items()}
        flops = forward_flops_per_token(ours["sizes"], seq) * batch * seq
        results = {"compile_prefill_s": ours["compile_prefill_s"]}
        results["prefill"] = {
            name: {"tokens_per_s": batch * seq / s, "mfu": flops / s / peak}
            for name, s in seconds("prefill").items()
        }
        logit_diff = float(np.abs(logits["eqdel"] - logits["transformers"]).max())
        results["prefill"]["max_abs_logit_difference"] = logit_diff

        weight_bytes = ours["weight_bytes"]
        for rows in prompts:
            task = f"decode_b{rows}"
            stacked = functools.partial(remote, "eqdel", "decode_b1_stacked")
            timed = seconds(task, **({"eqdel_stacked": stacked} if rows == 1 else {}))
            results[task] = {
                name: {
                    "tokens_per_s": rows * args.new / s,
                    "weight_bytes_per_s": weight_bytes * args.new / s,
                    "of_bandwidth": weight_bytes * args.new / s / bandwidth,
                }
                for name, s in timed.items()
            }
            tokens = [c["tokens"][rows] for c in checks.values()]
            results[task]["tokens_identical"] = bool(np.array_equal(*tokens))

        results["train"] = {
            name: {"tokens_per_s": batch * seq / s, "mfu": 3 * flops / s / peak}
            for name, s in seconds("train").items()
        }
        results["weight_bytes"] = weight_bytes
    finally:
        for connection in connections.values():
            with contextlib.suppress(OSError):  # a worker that failed has gone already
                connection.send(None)
        for process in processes:
            process.join()
    return results, logits


_TARGETS = {
    "prefill": 1.0,
    "decode_b1": 1.5,
    "decode_b8": 2.0,
    "train": 1.0,
}  # eqdel / transformers throughput the performance work aims at


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None, help="a .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    path = Path(args.model) if args.model else eqdel.smollm2_gguf()
    tokenizer = eqdel.load_tokenizer(path)
    ids = np.asarray(tokenizer.encode(perplexity_text_file().read_text() * 2).ids, np.int32)
    dtypes = args.dtypes.split(",")
    peaks = {dtype: matmul_peak(repeats=5, dtype=dtype) for dtype in dtypes}
    bandwidth = copy_bandwidth()
    results, logits = {}, {}
    for dtype in dtypes:
        results[dtype], logits[dtype] = measure(
            path, dtype, args, ids, peaks[dtype]["xla_flops_per_s"], bandwidth
        )
    low = [d for d in dtypes if d != "float32"]
    if "float32" in logits:  # how far each framework's 16-bit logits are from its float32
        for dtype in low:
            results[dtype]["max_abs_logit_difference_from_float32"] = {
                name: float(np.abs(logits[dtype][name] - logits["float32"][name]).max())
                for name in logits[dtype]
            }

    rows = []
    for dtype, r in results.items():
        for task, target in _TARGETS.items():
            ours, theirs = r[task]["eqdel"], r[task]["transformers"]
            ratio = ours["tokens_per_s"] / theirs["tokens_per_s"]
            use = "of_bandwidth" if task.startswith("decode") else "mfu"
            rows.append(
                [
                    dtype,
                    task,
                    f"{theirs['tokens_per_s']:,.1f}",
                    f"{ours['tokens_per_s']:,.1f}",
                    f"{ratio:.2f}x",
                    f"{100 * ours[use]:.0f}% / {100 * theirs[use]:.0f}%",
                    "met" if ratio >= target else f"below {target}x",
                ]
            )
        stacked = r["decode_b1"]["eqdel_stacked"]["tokens_per_s"]
        ratio = stacked / r["decode_b1"]["transformers"]["tokens_per_s"]
        label = "decode_b1, stacked model"
        rows.append([dtype, label, "", f"{stacked:,.1f}", f"{ratio:.2f}x", "", ""])
        compile_s = f"{r['compile_prefill_s']:.1f} s"
        rows.append([dtype, "compile, 30-layer prefill", "", compile_s, "", "", ""])
        if "max_abs_logit_difference_from_float32" in r:
            gap = r["max_abs_logit_difference_from_float32"]
            verdict = "met" if gap["eqdel"] <= gap["transformers"] else "above"
            theirs, ours = f"{gap['transformers']:.3f}", f"{gap['eqdel']:.3f}"
            rows.append([dtype, "logits vs own float32, max abs", theirs, ours, "", "", verdict])
    write(
        "real_model",
        {
            "model": str(path),
            "args": vars(args),
            "train_remat_policy": TRAIN_REMAT,
            "matmul_peak_flops_per_s": peaks,
            "copy_bandwidth_bytes_per_s": bandwidth,
            "results": results,
        },
        [
            (
                f"{path.name}, batch {args.batch} x {args.seq} (prefill, train), prompt "
                f"{args.prompt} + {args.new} new (decode); matmul peak XLA/torch "
                + ", ".join(
                    f"{d} {p['xla_flops_per_s'] / 1e9:.0f}/"
                    f"{p['torch_flops_per_s'] / 1e9:.0f} GFLOP/s"
                    for d, p in peaks.items()
                )
                + f"; copy bandwidth {bandwidth / 1e9:.1f} GB/s; eqdel trains with "
                f"remat_policy={TRAIN_REMAT}",
                [
                    "dtype",
                    "",
                    "transformers tok/s",
                    "eqdel tok/s",
                    "ratio",
                    "eqdel / transformers: MFU (decode: of bandwidth)",
                    "target",
                ],
                rows,
            )
        ],
    )


if __name__ == "__main__":
    rerun_with_huge_pages(sys.argv)
    main()
