"""Writing benchmark results as JSON and markdown side by side."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax

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


def machine() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
    }


def interleaved_times(fns: dict, steps: int) -> dict[str, list[float]]:
    """The seconds of each call of each function over `steps` rounds that call every
    function once in turn, after two warm-up rounds: a machine whose speed drifts during
    the run slows all of them alike instead of whichever runs last."""
    for _ in range(2):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(steps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(fns: dict, steps: int) -> dict[str, float]:
    """The median of `interleaved_times`' calls for each function."""
    return {name: statistics.median(t) for name, t in interleaved_times(fns, steps).items()}


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
