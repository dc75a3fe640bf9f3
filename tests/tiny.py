"""The tiny models and data the tests share, and how they compare states."""

import importlib.resources
from pathlib import Path

import equinox as eqx
import jax
import numpy as np

from eqdel.models import LlamaConfig

TINY_LLAMA = LlamaConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

WORD_LLAMA = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=0,
    eos_token_id=1,
)
"""A random-weight Llama for text from `train_tokenizer` (set `vocab_size` to its size)."""


def corpus_file() -> Path:
    """The small English corpus shipped with eqdel, a sentence per line."""
    return Path(str(importlib.resources.files("eqdel") / "data" / "corpus.txt"))


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `texts`, with `<s>` (id 0) and
    `</s>` (id 1)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def array_leaves(tree) -> list[np.ndarray]:
    """Every array of `tree` on the host, PRNG keys as their raw data."""
    leaves = jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    return [
        np.asarray(
            jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        )
        for x in leaves
    ]
