"""The main job of `eqdel demo`: SmolLM2-135M-Instruct, a real pretrained model, converted
from GGUF, loaded sharded, asked questions, measured, LoRA-fine-tuned and asked again."""

import importlib.resources
import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._chat import load_chat_template
from ._explain import explain_sharding
from ._finetune import FinetuneOptions, finetune
from ._generation import generate
from ._sharding_config import ShardingConfig
from ._smollm2 import smollm2_gguf
from ._tokenizer import load_tokenizer
from .checkpoint import from_pretrained, save_pretrained
from .evaluate import perplexity

DEMO_OPTIONS = FinetuneOptions(
    steps=30,
    batch_size=4,
    block_size=64,
    learning_rate=2e-3,
    warmup_steps=3,
    lora_rank=8,
    text_field="messages",
)
"""How the demo fine-tunes: rank-8 LoRA on the attention projections, 30 steps of 256
tokens."""

DEMO_QUESTIONS = ("Tell me who you are.", "What is the capital of Germany?")
"""What the demo asks before and after fine-tuning; neither is in the instruction set."""


def _data_file(name: str) -> Path:
    return Path(str(importlib.resources.files("eqdel") / "data" / name))


def perplexity_text_file() -> Path:
    """Public-domain English passages shipped with eqdel to measure perplexity on."""
    return _data_file("perplexity.txt")


def instructions_file() -> Path:
    """The small chat instruction set shipped with eqdel (JSONL, a `messages` field): it
    teaches a model to call itself Quill and to sign its answers."""
    return _data_file("instructions.jsonl")


def calibration_text() -> str:
    """English text shipped with eqdel other than the perplexity passages, for GPTQ to
    calibrate on: the corpus, then the messages of the instruction set."""
    records = [json.loads(line) for line in instructions_file().read_text().splitlines()]
    messages = [m["content"] for record in records for m in record["messages"]]
    return _data_file("corpus.txt").read_text() + "\n".join(messages)


def _answer(model, tokenizer, template, question: str, max_new_tokens: int = 40) -> str:
    ids = template.encode(tokenizer, [{"role": "user", "content": question}])
    out = generate(model, jnp.asarray([ids], jnp.int32), max_new_tokens=max_new_tokens)
    return tokenizer.decode([int(t) for t in out[0, len(ids) :]]).strip()


def _ask(model, tokenizer, template, questions) -> list[str]:
    answers = []
    for question in questions:
        answers.append(_answer(model, tokenizer, template, question))
        print(f"  user: {question}\n  assistant: {answers[-1]}")
    return answers


def _check_sharded_logits(model, sharded, ids) -> float:
    forward = jax.jit(lambda m, i: m(i).logits)
    difference = float(np.max(np.abs(np.asarray(forward(sharded, ids)) - forward(model, ids))))
    print(f"max |sharded - single device| logits on {ids.shape[1]} tokens = {difference:.2e}")
    return difference


def run_demo(
    cfg: ShardingConfig,
    output_dir: Path | None = None,
    options: FinetuneOptions = DEMO_OPTIONS,
    questions: tuple[str, ...] = DEMO_QUESTIONS,
) -> dict:
    """Fetch SmolLM2-135M-Instruct (once, into the user cache), convert its GGUF file to a
    Hugging Face checkpoint, load that onto the mesh of `cfg` (printing where every
    parameter went and checking sharded against single-device logits on real text), ask
    it `questions`, measure its perplexity on the embedded passages, LoRA-fine-tune it
    there on the embedded instruction set, and ask and measure again.

    **Arguments:**

    - `cfg`: the mesh to run on.
    - `output_dir`: where to keep the converted model (`smollm2/`) and the fine-tuning
        run (`run/`: train states, metrics, loss curve, `model/`, `adapter/`); default: a
        temporary directory, removed afterwards.
    - `options`: how to fine-tune.
    - `questions`: what to ask, greedily, before and after.

    **Returns:**

    `{"difference": sharded-vs-single-device logit difference, "losses": [...],
    "before"/"after": the answers, "perplexity_before"/"perplexity_after": floats}`.
    """
    gguf = smollm2_gguf()
    print(f"SmolLM2-135M-Instruct: {gguf}")
    tokenizer, template = load_tokenizer(gguf), load_chat_template(gguf)
    text_ids = tokenizer.encode(perplexity_text_file().read_text()).ids
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) if output_dir is None else Path(output_dir)
        model = from_pretrained(gguf, progress=False)
        print(model)
        base = save_pretrained(
            model, root / "smollm2", tokenizer=tokenizer, chat_template=template
        )
        print(f"converted to a Hugging Face checkpoint: {sorted(p.name for p in base.iterdir())}")

        sharded = from_pretrained(base, sharding=cfg, progress=False)
        print(explain_sharding(sharded, cfg))
        difference = _check_sharded_logits(model, sharded, jnp.asarray([text_ids[:64]]))
        del model

        print("before fine-tuning:")
        before = _ask(sharded, tokenizer, template, questions)
        measured = perplexity(sharded, text_ids, window=256, stride=128, progress=False)
        print(
            f"perplexity on {perplexity_text_file().name} ({measured.tokens} tokens, window "
            f"256, stride 128): {measured.perplexity:.3f}"
        )
        del sharded

        print(
            f"LoRA fine-tuning on {instructions_file().name} "
            f"({len(instructions_file().read_text().splitlines())} conversations) for "
            f"{options.steps} steps"
        )
        result = finetune(base, instructions_file(), root / "run", options, sharding=cfg)
        losses = result.losses
        kept = "" if output_dir is None else f"; loss curve: {result.plot_file}"
        if losses:
            print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f}{kept}")
        else:
            print(f"{root / 'run'} already holds all {options.steps} steps{kept}")

        trained = from_pretrained(result.model_dir, sharding=cfg, progress=False)
        print(f"reloaded {result.model_dir.name}/, after fine-tuning:")
        after = _ask(trained, tokenizer, template, questions)
        tuned = perplexity(trained, text_ids, window=256, stride=128, progress=False)
        print(f"perplexity on {perplexity_text_file().name}: {tuned.perplexity:.3f}")
    return dict(
        difference=difference,
        losses=losses,
        before=before,
        after=after,
        perplexity_before=measured.perplexity,
        perplexity_after=tuned.perplexity,
    )
