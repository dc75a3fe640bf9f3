"""`save_pretrained`: an eqdel model to a Hugging Face checkpoint directory."""

import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from .._generation_config import GenerationConfig
from .._quant import quantization_config
from .._tokenizer import save_tokenizer
from ._layout import get_path, hf_layout
from ._load import INDEX_FILE, SINGLE_FILE

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: an int, or a string such as `"5GB"` or `"500MiB"`."""
    if isinstance(size, int):
        return size
    match = _SIZE.match(size)
    if not match:
        raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB' or '200MiB'.")
    return int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])


def _to_host(leaf: jax.Array) -> np.ndarray:
    """Gather one (possibly sharded, possibly multi-process) array to the host."""
    if leaf.is_fully_addressable:
        return np.asarray(jax.device_get(leaf))
    return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))


def _tensors(model) -> Iterator[tuple[str, np.ndarray]]:
    """Checkpoint tensors, gathered one parameter at a time."""
    for tensor in hf_layout(model):
        host = _to_host(get_path(model, tensor.where))
        counts = host.shape[: tensor.stacked]
        blocks = host.reshape(-1, *host.shape[tensor.stacked :])
        for name, block in zip(tensor.names(counts), blocks, strict=True):
            yield name, np.ascontiguousarray(block.T if tensor.transpose else block)


def _groups(tensors, max_bytes: int) -> Iterator[dict[str, np.ndarray]]:
    """Consecutive tensors in groups of at most `max_bytes` (a larger tensor alone)."""
    group, size = {}, 0
    for name, array in tensors:
        if group and size + array.nbytes > max_bytes:
            yield group
            group, size = {}, 0
        group[name] = array
        size += array.nbytes
    yield group


def _write_shards(model, directory: Path, max_bytes: int) -> None:
    written: list[tuple[Path, list[str]]] = []
    total = 0
    for group in _groups(_tensors(model), max_bytes):
        file = directory / f"part-{len(written):05d}.safetensors"
        save_file(group, str(file), metadata={"format": "pt"})
        written.append((file, list(group)))
        total += sum(array.nbytes for array in group.values())

    if len(written) == 1:
        written[0][0].rename(directory / SINGLE_FILE)
        return
    weight_map = {}
    for i, (file, names) in enumerate(written):
        final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
        file.rename(directory / final)
        weight_map.update(dict.fromkeys(names, final))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / INDEX_FILE).write_text(json.dumps(index, indent=2))


def save_pretrained(
    model,
    path,
    *,
    max_shard_size: int | str = "5GB",
    tokenizer=None,
    chat_template=None,
    generation_config: GenerationConfig | None = None,
) -> Path:
    """Write `model` as a Hugging Face checkpoint that `transformers` loads (a model
    from [`eqdel.quantize`][] is written as its codes and scales, with the quantization
    in `config.json`; eqdel loads it back, transformers does not), with its generation
    config and, when given, its tokenizer and chat template.

    Everything is written to a temporary directory beside `path` and moved into place at
    the end, so a failure never leaves a half-written checkpoint where a good one was.
    Sharded parameters are gathered to the host one at a time. With several processes,
    every process takes part in the gathers and process 0 writes.

    **Arguments:**

    - `model`: an eqdel causal LM.
    - `path`: the output directory (replaced if it exists).
    - `max_shard_size`: largest safetensors file, in bytes or as `"5GB"`; above it the
        weights are split with a `model.safetensors.index.json`.
    - `tokenizer`: a `tokenizers.Tokenizer` (from [`eqdel.load_tokenizer`][]) to write
        as `tokenizer.json` with a `tokenizer_config.json` naming the special tokens.
    - `chat_template`: a [`eqdel.ChatTemplate`][] (or its source) for
        `chat_template.jinja`; needs `tokenizer`.
    - `generation_config`: for `generation_config.json` (default: the end and pad
        tokens of the model config).

    **Returns:**

    The output directory.
    """
    path = Path(path)
    max_bytes = parse_size(max_shard_size)
    if chat_template is not None and tokenizer is None:
        raise ValueError("a chat template is saved with its tokenizer; pass tokenizer= too.")
    path.parent.mkdir(parents=True, exist_ok=True)
    if jax.process_index() != 0:
        for _ in _tensors(model):  # take part in the gathers; process 0 writes
            pass
        return path
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        hf_config = model.config.to_hf_config()
        if (quantization := quantization_config(model)) is not None:
            hf_config["quantization_config"] = quantization
        (staging / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True))
        generation = generation_config or GenerationConfig.from_model_config(model.config)
        generation_hf = generation.to_hf(getattr(model.config, "bos_token_id", None))
        (staging / "generation_config.json").write_text(json.dumps(generation_hf, indent=2))
        if tokenizer is not None:
            source = getattr(chat_template, "source", chat_template)
            save_tokenizer(tokenizer, model.config, staging, source)
        _write_shards(model, staging, max_bytes)
        _replace_directory(staging, path)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return path


def _replace_directory(new: Path, target: Path) -> None:
    """Move `new` to `target`; an existing `target` is moved aside first and removed only
    once `new` is in place."""
    if not target.exists():
        os.rename(new, target)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
    os.rename(target, aside / target.name)
    try:
        os.rename(new, target)
    except OSError:
        os.rename(aside / target.name, target)
        raise
    finally:
        shutil.rmtree(aside)
