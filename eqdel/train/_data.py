"""Text and JSONL files to shuffled, packed, sharded token batches."""

import json
from collections.abc import Iterator
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding

from .. import axes as ax
from .._sharding_config import ShardingConfig


def read_texts(path, *, field: str = "text") -> list[str | list[dict]]:
    """The documents of a `.txt` file (one per non-empty line) or `.jsonl` file (the
    `field` of every record: a text, or a conversation as a list of chat messages).

    **Raises:**

    `ValueError` naming the file and line of a record that is not JSON or lacks `field`.
    """
    path = Path(path)
    lines = path.read_text().splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    texts = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not a JSON record ({error}).") from None
        if not isinstance(record, dict) or field not in record:
            fields = f" (its fields: {sorted(record)})" if isinstance(record, dict) else ""
            raise ValueError(f"{path}:{number}: record has no {field!r} field{fields}.")
        value = record[field]
        texts.append(value if isinstance(value, list) else str(value))
    return texts


def tokenize(texts: list[str], tokenizer) -> list[list[int]]:
    """Token ids of every text, encoded in parallel by a `tokenizers.Tokenizer` (as
    loaded from a checkpoint's `tokenizer.json`), without special tokens."""
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]


def pack(documents: list[list[int]], block_size: int, *, eos_token_id: int | None = None):
    """Concatenate token lists (each followed by `eos_token_id` if given) and cut them
    into `[blocks, block_size]`; the incomplete tail is dropped.

    **Raises:**

    `ValueError` when the tokens do not fill one block.
    """
    stream = []
    for tokens in documents:
        stream.extend(tokens)
        if eos_token_id is not None:
            stream.append(eos_token_id)
    blocks = len(stream) // block_size
    if blocks == 0:
        raise ValueError(
            f"{len(stream)} tokens do not fill one block of {block_size}; use more data or "
            "a smaller block size."
        )
    return np.asarray(stream[: blocks * block_size], np.int32).reshape(blocks, block_size)


def batches(
    blocks: np.ndarray,
    batch_size: int,
    *,
    seed: int = 0,
    epochs: int | None = None,
    skip: int = 0,
    sharding: ShardingConfig | None = None,
) -> Iterator[dict]:
    """Shuffled batches of packed blocks, the same order for the same seed.

    **Arguments:**

    - `blocks`: `[blocks, block_size]` token ids from [`eqdel.train.pack`][].
    - `batch_size`: blocks per batch (at most the number of blocks).
    - `seed`: the shuffle seed; each epoch reshuffles deterministically.
    - `epochs`: how many passes (`None`: forever).
    - `skip`: start after this many batches (to resume a run where it stopped).
    - `sharding`: place each batch with its batch axis on the mesh (dp, fsdp).

    **Yields:**

    `{"input_ids": [batch_size, block_size]}`; the last incomplete batch of an epoch
    is dropped.
    """
    if not 0 < batch_size <= len(blocks):
        raise ValueError(f"batch_size {batch_size} must be between 1 and {len(blocks)} blocks.")
    placement = None
    if sharding is not None:
        spec = sharding.resolve((ax.BATCH, ax.LENGTH), shape=(batch_size, blocks.shape[1]))
        placement = NamedSharding(sharding.mesh(), spec)
    per_epoch = len(blocks) // batch_size
    epoch, first = divmod(skip, per_epoch)
    while epochs is None or epoch < epochs:
        order = np.random.default_rng([seed, epoch]).permutation(len(blocks))
        for index in range(first, per_epoch):
            ids = blocks[order[index * batch_size : (index + 1) * batch_size]]
            yield {"input_ids": ids if placement is None else jax.device_put(ids, placement)}
        epoch, first = epoch + 1, 0
