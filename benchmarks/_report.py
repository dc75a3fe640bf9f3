"""Writing benchmark results as JSON and markdown side by side."""

import json
import platform
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
    import os

    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
    }


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
