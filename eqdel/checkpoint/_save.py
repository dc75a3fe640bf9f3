"""`save_pretrained`: an eqdel model to a Hugging Face checkpoint directory."""

import json
import os
import re
import shutil
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
from ._replace import replace_directory, staging_directory

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)?\s*$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in `size`: a positive int, or a string such as `"5GB"` or `"500MiB"`."""
    if isinstance(size, int) and not isinstance(size, bool):
        count = size
    elif isinstance(size, str) and (match := _SIZE.match(size)):
        count = int(float(match.group(1)) * _UNITS[(match.group(2) or "B").lower()])
    else:
        raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB' or '200MiB'.")
    if count <= 0:
        raise ValueError(f"max_shard_size {size!r} must be a positive number of bytes.")
    return count


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

    Into an existing directory, only eqdel's own files are replaced: the config, the
    generation config, the weights (stale shards of an earlier save are removed) and the
    tokenizer files when a tokenizer (or chat template) is given. Every other file stays
    as it was. The new files are written beside `path` and published in one atomic
    step, so a failure or a kill at any moment leaves either the old or the new
    checkpoint, complete. Arguments are checked before anything is written. Sharded
    parameters are gathered to the host one at a time. With several processes, every
    process takes part in the gathers and process 0 writes.

    **Arguments:**

    - `model`: an eqdel causal LM.
    - `path`: the output directory.
    - `max_shard_size`: largest safetensors file, in bytes or as `"5GB"`; above it the
        weights are split with a `model.safetensors.index.json`.
    - `tokenizer`: a `tokenizers.Tokenizer` (from [`eqdel.load_tokenizer`][]) to write
        as `tokenizer.json` with a `tokenizer_config.json` naming the special tokens.
    - `chat_template`: a [`eqdel.ChatTemplate`][] (or its source) for
        `chat_template.jinja`; needs `tokenizer`.
    - `generation_config`: for `generation_config.json` (default: the one the model was
        loaded with, else the end and pad tokens of the model config).

    **Returns:**

    The output directory.

    **Raises:**

    `ValueError` for a bad `max_shard_size` or a chat template without its tokenizer;
    `OSError` naming `path` when it is a file or cannot be written.
    """
    path = Path(path)
    if path.is_symlink():
        path = path.resolve()  # write where the link points; the link stays
    max_bytes = parse_size(max_shard_size)
    if chat_template is not None and tokenizer is None:
        raise ValueError("a chat template is saved with its tokenizer; pass tokenizer= too.")
    _check_writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if jax.process_index() != 0:
        for _ in _tensors(model):  # take part in the gathers; process 0 writes
            pass
        return path
    staging = staging_directory(path)
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
        with_tokenizer = tokenizer is not None
        replace_directory(staging, path, lambda name: _replaced(name, with_tokenizer))
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return path


_OWN_FILES = frozenset({"config.json", "generation_config.json", SINGLE_FILE, INDEX_FILE})
_TOKENIZER_FILES = frozenset({"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"})
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _replaced(name: str, with_tokenizer: bool) -> bool:
    """Whether a save replaces (or, for a stale shard, removes) the file `name`."""
    own = name in _OWN_FILES or _SHARD.match(name) is not None
    return own or (with_tokenizer and name in _TOKENIZER_FILES)


def _check_writable(path: Path) -> None:
    """Refuse, before anything is written, a `path` that is a file or cannot be written."""
    if path.exists() and not path.is_dir():
        raise NotADirectoryError(f"{path} is a file; save_pretrained writes a directory.")
    existing = path if path.exists() else next(p for p in path.parents if p.exists())
    if not os.access(existing, os.W_OK | os.X_OK):
        raise PermissionError(f"{existing} is not writable; nothing was saved to {path}.")
    if path.exists() and not os.access(path.parent, os.W_OK | os.X_OK):
        raise PermissionError(f"{path.parent} is not writable; nothing was saved to {path}.")
