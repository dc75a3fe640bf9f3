"""The main job of `eqdel demo`: a tiny Llama saved, loaded sharded, fine-tuned on the
embedded corpus, reloaded and asked to write."""

import dataclasses
import importlib.resources
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._explain import explain_sharding
from ._finetune import FinetuneOptions, finetune
from ._generation import generate
from ._sharding_config import ShardingConfig
from .checkpoint import from_pretrained, save_pretrained
from .models import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = LlamaConfig(
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
"""The embedded default model: a random-weight Llama small enough for any CPU."""

DEMO_OPTIONS = FinetuneOptions(
    steps=150, batch_size=8, block_size=32, learning_rate=3e-3, warmup_steps=10
)
"""How the demo fine-tunes."""


def _data_file(name: str) -> Path:
    return Path(str(importlib.resources.files("eqdel") / "data" / name))


def corpus_file() -> Path:
    """The small English corpus shipped with eqdel, a sentence per line."""
    return _data_file("corpus.txt")


def perplexity_text_file() -> Path:
    """Public-domain English passages shipped with eqdel to measure perplexity on."""
    return _data_file("perplexity.txt")


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


def _check_sharded_logits(model, sharded, vocab_size: int) -> float:
    ids = jax.random.randint(jax.random.key(1), (4, 64), 0, vocab_size)
    forward = jax.jit(lambda m, i: m(i).logits)
    difference = float(jnp.max(jnp.abs(forward(sharded, ids) - forward(model, ids))))
    print(f"max |sharded - single device| logits = {difference:.2e}")
    return difference


def run_demo(
    cfg: ShardingConfig,
    output_dir: Path | None = None,
    options: FinetuneOptions = DEMO_OPTIONS,
    prompt: str = "The river",
) -> dict:
    """Train a tokenizer on the embedded corpus, build the tiny Llama, save it as a
    Hugging Face checkpoint, load it onto the mesh of `cfg` (printing where every
    parameter went and checking sharded against single-device logits), fine-tune it
    there, reload the result and generate greedily from `prompt`.

    **Arguments:**

    - `cfg`: the mesh to run on.
    - `output_dir`: where to keep the checkpoints, metrics and loss curve (default: a
        temporary directory, removed afterwards).
    - `options`: how to fine-tune.
    - `prompt`: the text to continue.

    **Returns:**

    `{"difference": sharded-vs-single-device logit difference, "losses": [...],
    "sample": generated text}`.
    """
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if output_dir is None else Path(output_dir)
        texts = corpus_file().read_text().splitlines()
        tokenizer = train_tokenizer(texts, TINY_LLAMA.vocab_size)
        config = dataclasses.replace(TINY_LLAMA, vocab_size=tokenizer.get_vocab_size())
        model = LlamaForCausalLM(config, key=jax.random.key(0))
        print(model)
        base = save_pretrained(model, root / "tiny-llama")
        tokenizer.save(str(base / "tokenizer.json"))
        print(f"saved a Hugging Face checkpoint: {sorted(p.name for p in base.iterdir())}")

        sharded = from_pretrained(base, sharding=cfg, progress=False)
        print(explain_sharding(sharded, cfg))
        difference = _check_sharded_logits(model, sharded, config.vocab_size)

        print(
            f"fine-tuning on {corpus_file().name} ({len(texts)} lines) for {options.steps} steps"
        )
        result = finetune(base, corpus_file(), root / "run", options, sharding=cfg)
        losses = result.losses
        kept = "" if output_dir is None else f"; loss curve: {result.plot_file}"
        if losses:
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{kept}")
        else:
            print(f"{root / 'run'} already holds all {options.steps} steps{kept}")

        trained = from_pretrained(result.model_dir, sharding=cfg, progress=False)
        ids = jnp.asarray([tokenizer.encode(prompt).ids], jnp.int32)
        tokens = np.asarray(generate(trained, ids, max_new_tokens=24))[0]
        sample = tokenizer.decode(tokens.tolist())
        print(f"reloaded {result.model_dir.name}/ and generated: {sample!r}")
    return dict(difference=difference, losses=losses, sample=sample)
