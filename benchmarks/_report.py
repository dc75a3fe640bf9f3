"""Writing benchmark results as JSON and markdown side by side."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import torch

LLAMA_SIZES = dict(
    vocab_size=32000,
    hidden_size=256,
    intermediate_size=688,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)
"""The random-weight Llama both benchmarks measure."""


def forward_flops_per_token(sizes: dict, seq: int) -> float:
    """2 x the matmul parameters (embedding lookup excluded, head included) plus the
    attention scores and weighted sums over all `seq` positions, for one forward pass;
    a train step is 3 x this."""
    h, m, layers = sizes["hidden_size"], sizes["intermediate_size"], sizes["num_hidden_layers"]
    head_dim = h // sizes["num_attention_heads"]
    kv = sizes["num_key_value_heads"] * head_dim
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * m
    matmul_params = layers * per_layer + h * sizes["vocab_size"]
    return 2 * matmul_params + 4 * layers * seq * h


def matmul_peak(size: int = 2048, repeats: int = 10, dtype: str = "float32") -> dict:
    """The best `dtype` matmul rate (accumulating in float32) XLA and torch reach on this
    machine, in alternating rounds."""
    a = jax.random.normal(jax.random.key(0), (size, size), jnp.float32).astype(dtype)
    matmul = jax.jit(lambda a: jnp.matmul(a, a, preferred_element_type=jnp.float32))
    t = torch.randn(size, size).to(getattr(torch, dtype))
    times = interleaved_times(
        {"xla": lambda: matmul(a).block_until_ready(), "torch": lambda: t @ t}, repeats
    )
    flops = 2 * size**3
    return {
        "size": size,
        "dtype": dtype,
        "xla_flops_per_s": flops / min(times["xla"]),
        "torch_flops_per_s": flops / min(times["torch"]),
    }


def torch_greedy(hf_model, ids, new_tokens: int):
    """A callable running transformers' greedy `generate` of exactly `new_tokens` after
    the prompts `ids` (`[batch, prompt]`), returning the token tensor."""
    prompt = torch.tensor(ids)

    def run():
        with torch.no_grad():
            return hf_model.generate(
                prompt,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )

    return run


def torch_train_step(hf_model, ids, lr: float):
    """A callable running one AdamW step of `hf_model` (put in training mode) on the
    causal-LM loss of `ids`, returning the loss."""
    hf_model.train()
    optimizer = torch.optim.AdamW(hf_model.parameters(), lr=lr)
    tokens = torch.tensor(ids, dtype=torch.long)

    def step():
        loss = hf_model(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def interleaved_times(
    fns: dict, steps: int, *, self_timed: bool = False
) -> dict[str, list[float]]:
    """The seconds of each call of each function over `steps` rounds that call every
    function once in turn, after two warm-up rounds: a machine whose speed drifts during
    the run slows all of them alike instead of whichever runs last. With `self_timed`,
    each function returns its own seconds (a call run in another process)."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            seconds = fn()
            times[name].append(seconds if self_timed else time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict, steps: int, *, self_timed: bool = False) -> dict[str, float]:
    """The median of `interleaved_times`' calls for each function."""
    times = interleaved_times(fns, steps, self_timed=self_timed)
    return {name: statistics.median(t) for name, t in times.items()}


def write(name: str, results: dict, tables: list[tuple[str, list[str], list[list]]]) -> Path:
    """Write `results/<name>.json` and `results/<name>.md`; print the markdown."""
    out = Path(__file__).parent / "results"
    out.mkdir(exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps({"machine": machine(), **results}, indent=2))
    lines = [f"# {name}", "", f"Machine: `{json.dumps(machine())}`", ""]
    for title, header, rows in tables:
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
        lines.append("")
    text = "\n".join(lines)
    (out / f"{name}.md").write_text(text)
    print(text)
    return out
