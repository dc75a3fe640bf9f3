"""Fine-tune a checkpoint on a text or JSONL file: the work behind `eqdel finetune`."""

import contextlib
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
from tqdm.auto import tqdm

from ._chat import load_chat_template
from ._lora import apply_lora, lora_filter, merge_lora, save_lora
from ._placement import shard
from ._sharding_config import ShardingConfig
from ._tokenizer import load_tokenizer
from .checkpoint import CheckpointError, from_pretrained, save_pretrained
from .train import (
    AdamW,
    batches,
    causal_lm_loss,
    init_train_state,
    latest_train_step,
    make_train_step,
    pack,
    read_texts,
    restore_train_state,
    save_train_state,
    tokenize,
)

_COMPUTE_DTYPES = {"float32": None, "bfloat16": jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class FinetuneOptions:
    """How to fine-tune.

    **Fields:**

    - `steps`: optimizer updates in all (a resumed run continues up to this many).
    - `batch_size`, `block_size`: packed blocks per update and tokens per block.
    - `learning_rate`, `warmup_steps`, `weight_decay`, `max_grad_norm`: AdamW with linear
        warm-up then cosine decay, and global-norm clipping.
    - `grad_accum_steps`: micro-batches per update.
    - `lora_rank`, `lora_alpha`, `lora_targets`: train LoRA adapters of this rank on these
        linear layers instead of every weight (`lora_alpha` defaults to twice the rank).
    - `compute_dtype`: `"float32"` or `"bfloat16"` (parameters stay float32).
    - `save_every`: save the train state every this many steps (and always at the end).
    - `seed`: data order and LoRA initialisation.
    - `text_field`: the field of a JSONL record holding its text, or a conversation
        (`[{"role": "user", "content": ...}, ...]`) that the model's chat template writes
        out (the loss covers the whole conversation).
    """

    steps: int = 100
    batch_size: int = 8
    block_size: int = 128
    learning_rate: float = 3e-4
    warmup_steps: int = 10
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    grad_accum_steps: int = 1
    lora_rank: int | None = None
    lora_alpha: float | None = None
    lora_targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")
    compute_dtype: str = "float32"
    save_every: int | None = None
    seed: int = 0
    text_field: str = "text"

    def __post_init__(self):
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, not {self.steps}.")
        if self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype {self.compute_dtype!r} is not one of {sorted(_COMPUTE_DTYPES)}."
            )

    def optimizer(self) -> AdamW:
        """Clipped AdamW on a warm-up + cosine schedule."""
        schedule = optax.warmup_cosine_decay_schedule(
            0.0,
            self.learning_rate,
            min(self.warmup_steps, self.steps - 1),
            self.steps,
            end_value=0.1 * self.learning_rate,
        )
        return AdamW(schedule, weight_decay=self.weight_decay, max_grad_norm=self.max_grad_norm)


@dataclasses.dataclass(frozen=True)
class FinetuneResult:
    """What a run leaves behind.

    **Fields:**

    - `losses`: the loss of every step this call ran.
    - `model_dir`: the trained (LoRA-merged) model as a Hugging Face checkpoint with its
        tokenizer and any chat template.
    - `adapter_dir`: the PEFT adapter files, when LoRA was used.
    - `metrics_file`, `plot_file`: the JSONL metrics log and the loss-curve PNG.
    """

    losses: list[float]
    model_dir: Path
    adapter_dir: Path | None
    metrics_file: Path
    plot_file: Path


def _chat_template(model_dir: Path):
    try:
        return load_chat_template(model_dir)
    except CheckpointError:
        return None


def _render_conversations(texts: list, model_dir: Path, data) -> list[str]:
    """The texts, with every conversation written out by the model's chat template."""
    if all(isinstance(text, str) for text in texts):
        return texts
    template = _chat_template(model_dir)
    if template is None:
        raise ValueError(f"{data} holds conversations but {model_dir} has no chat template.")
    return [
        text if isinstance(text, str) else template.render(text, add_generation_prompt=False)
        for text in texts
    ]


def _eos_token_id(config) -> int | None:
    eos = config.eos_token_id
    return eos[0] if isinstance(eos, tuple) else eos


def _keep_records_up_to(metrics_file: Path, step: int) -> None:
    """Drop the records of steps after `step` (logged by a run that died before saving
    them), so that a resumed run logs every step once."""
    lines = metrics_file.read_text().splitlines() if metrics_file.is_file() else []
    kept = [line for line in lines if line and json.loads(line)["step"] <= step]
    metrics_file.write_text("".join(line + "\n" for line in kept))


def _plot_losses(metrics_file: Path, plot_file: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_file.read_text().splitlines() if line]
    figure, axis = plt.subplots(figsize=(6, 3.5))
    axis.plot([r["step"] for r in records], [r["loss"] for r in records])
    axis.set(xlabel="step", ylabel="loss", title="training loss")
    axis.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(plot_file, dpi=120)
    plt.close(figure)


def finetune(
    model_dir,
    data,
    output_dir,
    options: FinetuneOptions = FinetuneOptions(),
    *,
    sharding: ShardingConfig | None = None,
    progress: bool = True,
) -> FinetuneResult:
    """Fine-tune a Hugging Face checkpoint on a text file, resuming if `output_dir` holds
    an earlier run's train states.

    **Arguments:**

    - `model_dir`: a checkpoint directory with `tokenizer.json`, or a GGUF file.
    - `data`: a `.txt` file (a document per line) or `.jsonl` file.
    - `output_dir`: where the train states (`checkpoints/`), `metrics.jsonl`, `loss.png`,
        the trained model (`model/`) and any adapter (`adapter/`) go.
    - `options`: a [`eqdel.FinetuneOptions`][].
    - `sharding`: the mesh to train on (default: one device).
    - `progress`: show a progress bar with the loss and tokens/s.

    **Returns:**

    A [`eqdel.FinetuneResult`][].
    """
    model_dir, output_dir = Path(model_dir), Path(output_dir)
    tokenizer = load_tokenizer(model_dir)
    model = from_pretrained(model_dir, sharding=sharding, progress=False)
    texts = read_texts(data, field=options.text_field)
    documents = tokenize(_render_conversations(texts, model_dir, data), tokenizer)
    blocks = pack(documents, options.block_size, eos_token_id=_eos_token_id(model.config))
    if len(blocks) < options.batch_size:
        raise ValueError(
            f"{data}: {len(blocks)} blocks of {options.block_size} tokens cannot fill a batch "
            f"of {options.batch_size}; use a smaller block or batch size."
        )

    key_lora, key_run = jax.random.split(jax.random.key(options.seed))
    trainable = None
    if options.lora_rank is not None:
        alpha = options.lora_alpha or 2.0 * options.lora_rank
        model = apply_lora(model, options.lora_rank, alpha, options.lora_targets, key=key_lora)
        trainable = lora_filter(model)
    optimizer = options.optimizer()
    state = init_train_state(model, optimizer, key_run, trainable=trainable)
    if sharding is not None:
        state = shard(state, sharding)
    checkpoints = output_dir / "checkpoints"
    if latest_train_step(checkpoints) is not None:
        state = restore_train_state(checkpoints, state)
    start = int(state.step)

    step = make_train_step(
        causal_lm_loss,
        optimizer,
        grad_accum_steps=options.grad_accum_steps,
        trainable=trainable,
        compute_dtype=_COMPUTE_DTYPES[options.compute_dtype],
    )
    data_iter = batches(
        blocks, options.batch_size, seed=options.seed, skip=start, sharding=sharding
    )
    output_dir.mkdir(parents=True, exist_ok=True)
    metrics_file = output_dir / "metrics.jsonl"
    _keep_records_up_to(metrics_file, start)
    losses = []
    with (
        contextlib.nullcontext() if sharding is None else sharding.activate(),
        metrics_file.open("a") as log,
        tqdm(total=options.steps, initial=start, disable=not progress, unit="step") as bar,
    ):
        for number in range(start + 1, options.steps + 1):
            began = time.perf_counter()
            state, metrics = step(state, next(data_iter))
            loss, tokens = float(metrics["loss"]), float(metrics["tokens"])
            seconds = time.perf_counter() - began
            losses.append(loss)
            record = dict(
                step=number,
                loss=loss,
                grad_norm=float(metrics["grad_norm"]),
                tokens=int(tokens),
                tokens_per_second=tokens / seconds,
            )
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens / seconds:,.0f}")
            bar.update()
            if options.save_every and number % options.save_every == 0:
                save_train_state(checkpoints, state, max_to_keep=2)
    if latest_train_step(checkpoints) != int(state.step):
        save_train_state(checkpoints, state, max_to_keep=2)

    adapter_dir = None
    trained = state.model
    if options.lora_rank is not None:
        adapter_dir = save_lora(
            trained, output_dir / "adapter", base_model_name_or_path=str(model_dir)
        )
        trained = merge_lora(trained)
    final_dir = save_pretrained(
        trained,
        output_dir / "model",
        tokenizer=tokenizer,
        chat_template=_chat_template(model_dir),
    )
    plot_file = output_dir / "loss.png"
    _plot_losses(metrics_file, plot_file)
    return FinetuneResult(losses, final_dir, adapter_dir, metrics_file, plot_file)
