"""The `eqdel` command line."""

import argparse
import os
import sys

from ._host_memory import rerun_with_huge_pages
from ._version import __version__


def _use_cpu_devices(count: int | None) -> None:
    """Simulate `count` host CPU devices; must run before JAX starts its backends."""
    if count is None:
        return
    import jax

    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", count)


def _sharding_config(args):
    from ._sharding_config import ShardingConfig

    return ShardingConfig(axis_dims=args.axis_dims, axis_names=args.axis_names)


def _inspect_mesh(args) -> int:
    _use_cpu_devices(args.devices)
    cfg = _sharding_config(args)
    mesh = cfg.mesh()
    print(f"{len(cfg.devices())} devices, mesh {dict(mesh.shape)}")
    print(mesh.devices)
    return 0


def _demo(args) -> int:
    _use_cpu_devices(args.devices)
    import dataclasses

    from ._demo import DEMO_OPTIONS, run_demo

    options = (
        DEMO_OPTIONS if args.steps is None else dataclasses.replace(DEMO_OPTIONS, steps=args.steps)
    )
    run_demo(_sharding_config(args), args.output, options)
    return 0


def _finetune(args) -> int:
    _use_cpu_devices(args.devices)
    from ._finetune import FinetuneOptions, finetune

    options = FinetuneOptions(
        steps=args.steps,
        batch_size=args.batch_size,
        block_size=args.block_size,
        learning_rate=args.learning_rate,
        warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay,
        grad_accum_steps=args.grad_accum_steps,
        lora_rank=args.lora_rank,
        lora_alpha=args.lora_alpha,
        compute_dtype=args.compute_dtype,
        save_every=args.save_every,
        seed=args.seed,
        text_field=args.text_field,
    )
    result = finetune(
        args.model_dir, args.data, args.output, options, sharding=_sharding_config(args)
    )
    if result.losses:
        print(f"loss {result.losses[0]:.4f} -> {result.losses[-1]:.4f}")
    print(f"model: {result.model_dir}")
    if result.adapter_dir is not None:
        print(f"adapter: {result.adapter_dir}")
    print(f"metrics: {result.metrics_file}  loss curve: {result.plot_file}")
    return 0


def _load(path: str, **kwargs):
    """A model in its generation form (built once, not on every reply), with its
    tokenizer and generation defaults, from a checkpoint directory or a GGUF file."""
    from pathlib import Path

    from ._generation_config import GenerationConfig
    from ._tokenizer import load_tokenizer
    from .checkpoint import from_pretrained

    path = Path(path)
    tokenizer = load_tokenizer(path)
    model = from_pretrained(path, progress=False, **kwargs).for_generation()
    defaults = GenerationConfig.from_model_config(model.config)
    return model, tokenizer, defaults


def _sampling_overrides(args) -> dict:
    overrides = {
        name: getattr(args, name)
        for name in (
            "max_new_tokens",
            "temperature",
            "top_k",
            "top_p",
            "min_p",
            "repetition_penalty",
        )
        if getattr(args, name) is not None
    }
    if args.temperature is not None:
        overrides["do_sample"] = args.temperature > 0
    return overrides


def _stream(model, tokenizer, prompt: list[int], key, defaults, overrides) -> list[int]:
    """Generate after `prompt`, printing the text after the prompt's as it comes (a
    character split across tokens waits for its last byte); returns the new tokens."""
    import jax.numpy as jnp

    from ._generation import stream_generate

    tokens, shown = list(prompt), tokenizer.decode(prompt)
    for step in stream_generate(
        model, jnp.asarray([prompt], jnp.int32), key=key, generation_config=defaults, **overrides
    ):
        tokens.append(int(step[0]))
        text = tokenizer.decode(tokens)
        if not text.endswith("\ufffd"):
            print(text[len(shown) :], end="", flush=True)
            shown = text
    print(tokenizer.decode(tokens)[len(shown) :])
    return tokens[len(prompt) :]


def _generate(args) -> int:
    import jax

    model, tokenizer, defaults = _load(args.model, quantize_kv_cache=args.int8_cache)
    tokens = tokenizer.encode(args.prompt).ids
    if not tokens:
        raise ValueError("the prompt is empty; give some text to continue.")
    print(tokenizer.decode(tokens), end="", flush=True)
    key = jax.random.key(args.seed)
    _stream(model, tokenizer, tokens, key, defaults, _sampling_overrides(args))
    return 0


def _chat(args) -> int:
    import jax

    from ._chat import load_chat_template

    model, tokenizer, defaults = _load(args.model, quantize_kv_cache=args.int8_cache)
    template = load_chat_template(args.model)
    overrides = _sampling_overrides(args)
    messages = [] if args.system is None else [{"role": "system", "content": args.system}]
    key = jax.random.key(args.seed)
    print("eqdel chat: type a message; Ctrl-D ends the conversation.", file=sys.stderr)
    while True:
        try:
            text = input("> ")
        except EOFError:
            print()
            return 0
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        key, sub = jax.random.split(key)
        reply = _stream(
            model, tokenizer, template.encode(tokenizer, messages), sub, defaults, overrides
        )
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})


def _perplexity(args) -> int:
    from pathlib import Path

    from ._demo import perplexity_text_file
    from ._tokenizer import load_tokenizer
    from .checkpoint import from_pretrained
    from .evaluate import perplexity

    text_file = Path(args.text) if args.text else perplexity_text_file()
    tokenizer = load_tokenizer(args.model)
    model = from_pretrained(
        args.model, dtype=args.dtype, progress=False, keep_quantized=args.keep_quantized
    )
    ids = tokenizer.encode(text_file.read_text()).ids
    described = "GGUF blocks kept quantized: " if args.keep_quantized else ""
    if args.quantize:
        model, scheme = _quantized(model, args.quantize, args.group_size)
        described = scheme + ": "
    result = perplexity(model, ids, window=args.window, stride=args.stride)
    print(
        f"{described}perplexity {result.perplexity:.4f} (nll {result.nll:.5f} nats/token) over "
        f"{result.tokens} tokens of {text_file.name}, window {result.window}, "
        f"stride {result.stride}"
    )
    return 0


def _convert(args) -> int:
    from ._chat import load_chat_template
    from ._tokenizer import load_tokenizer
    from .checkpoint import CheckpointError, from_pretrained, save_pretrained

    model = from_pretrained(args.model, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    try:
        template = load_chat_template(args.model)
    except CheckpointError:
        template = None
    out = save_pretrained(model, args.output, tokenizer=tokenizer, chat_template=template)
    print(f"wrote {out}: {', '.join(sorted(p.name for p in out.iterdir()))}")
    return 0


def _quantized(model, scheme: str, group_size: int | None, **options):
    """`model` quantized by `scheme` (`int8`, `nf4` or `int4`), and the scheme in words,
    such as `nf4 (groups of 64)`."""
    from ._quant import quantization_config, quantize

    model = quantize(
        model, 8 if scheme == "int8" else 4, scheme=scheme, group_size=group_size, **options
    )
    size = quantization_config(model)["group_size"]
    return model, scheme + (f" (groups of {size})" if size else "")


def _quantize(args) -> int:
    import time
    from pathlib import Path

    import jax
    import jax.numpy as jnp

    from ._chat import load_chat_template
    from ._demo import calibration_text
    from ._tokenizer import load_tokenizer
    from .checkpoint import CheckpointError, from_pretrained, save_pretrained

    calibrated = args.calibration != "none"
    if calibrated and args.calibration and not Path(args.calibration).is_file():
        raise ValueError(f"no calibration text at {args.calibration}.")
    if args.calibration_tokens < 1:
        raise ValueError(
            f"--calibration-tokens must be at least 1, not {args.calibration_tokens}."
        )
    tokenizer = load_tokenizer(args.model)
    model = from_pretrained(args.model, progress=False)
    calibration, described = None, "rounded to nearest"
    if calibrated:
        text = Path(args.calibration).read_text() if args.calibration else calibration_text()
        source = Path(args.calibration).name if args.calibration else "eqdel's shipped text"
        positions = getattr(model.config, "max_position_embeddings", None) or CALIBRATION_ROW
        ids = tokenizer.encode(text).ids[: args.calibration_tokens]
        calibration = jnp.asarray(_calibration_rows(ids, min(CALIBRATION_ROW, positions)))
        described = f"GPTQ on {calibration.size:,} tokens of {source}"
    jax.block_until_ready(model)
    start = time.perf_counter()
    model, scheme = _quantized(
        model, args.scheme, args.group_size, calibration=calibration, embeddings=args.embeddings
    )
    jax.block_until_ready(model)
    seconds = time.perf_counter() - start
    try:
        template = load_chat_template(args.model)
    except CheckpointError:
        template = None
    out = save_pretrained(model, args.output, tokenizer=tokenizer, chat_template=template)
    mib = sum(p.stat().st_size for p in out.glob("*.safetensors")) / 2**20
    print(f"wrote {out}: {scheme}, {described}, in {seconds:.1f} s; weights {mib:.0f} MiB")
    return 0


CALIBRATION_ROW = 256
"""Tokens per calibration sequence of `eqdel quantize` (fewer for a model whose
positions end sooner)."""


def _calibration_rows(ids: list[int], row: int):
    """`ids` as rows of `row` tokens (one shorter row when there are fewer), the tokens
    past the last whole row left out."""
    import numpy as np

    if not ids:
        raise ValueError("the calibration text holds no tokens.")
    row = min(row, len(ids))
    return np.asarray(ids[: len(ids) // row * row], np.int32).reshape(-1, row)


_DTYPES = ("float32", "bfloat16", "float16")


def _add_sampling_arguments(parser: argparse.ArgumentParser, max_new_tokens=None) -> None:
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    parser.add_argument("--temperature", type=float, default=None, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--int8-cache", action="store_true", help="int8 KV cache")


def _add_mesh_arguments(parser: argparse.ArgumentParser, default_devices: int | None) -> None:
    parser.add_argument("--axis-dims", default="1,-1,1,1", help="mesh sizes, e.g. 1,2,2,2")
    parser.add_argument("--axis-names", default="dp,fsdp,tp,sp", help="mesh axis names")
    parser.add_argument(
        "--devices",
        type=int,
        default=default_devices,
        help="simulate this many CPU devices (default: use the real devices)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eqdel", description=__doc__)
    parser.add_argument("--version", action="version", version=f"eqdel {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    inspect_mesh = commands.add_parser(
        "inspect-mesh", help="print the device mesh a config builds"
    )
    _add_mesh_arguments(inspect_mesh, default_devices=None)
    inspect_mesh.set_defaults(run=_inspect_mesh)

    generate = commands.add_parser(
        "generate", help="continue a prompt with a checkpoint directory or GGUF file"
    )
    generate.add_argument("model", help="checkpoint directory (with tokenizer.json) or .gguf")
    generate.add_argument("--prompt", required=True)
    _add_sampling_arguments(generate)
    generate.set_defaults(run=_generate)

    chat = commands.add_parser(
        "chat", help="talk to an instruct model (its chat template applied); Ctrl-D ends"
    )
    chat.add_argument("model", help="checkpoint directory (with tokenizer.json) or .gguf")
    chat.add_argument("--system", default=None, help="a system message to start with")
    _add_sampling_arguments(chat, max_new_tokens=256)
    chat.set_defaults(run=_chat)

    perplexity = commands.add_parser(
        "perplexity", help="perplexity of a model on a text, with a sliding window"
    )
    perplexity.add_argument("model", help="checkpoint directory (with tokenizer.json) or .gguf")
    perplexity.add_argument(
        "--text", default=None, help="a text file (default: the passages shipped with eqdel)"
    )
    perplexity.add_argument("--window", type=int, default=None, help="tokens per window")
    perplexity.add_argument("--stride", type=int, default=None, help="tokens between windows")
    perplexity.add_argument("--dtype", choices=_DTYPES, default="float32")
    weights = perplexity.add_mutually_exclusive_group()
    weights.add_argument(
        "--quantize",
        choices=("int8", "nf4", "int4"),
        default=None,
        help="score the model quantized (rounded to nearest) rather than as loaded",
    )
    perplexity.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="inputs per scale (default: eqdel.quantize's, groups for NF4 / int4 and one "
        "scale per output channel for int8)",
    )
    weights.add_argument(
        "--keep-quantized",
        action="store_true",
        help="a GGUF file's Q4_0 / Q4_1 / Q4_K layers as int4 codes, and its Q8_0 / Q5_0 / "
        "Q6_K layers and token embeddings as int8 codes, not dequantised to float",
    )
    perplexity.set_defaults(run=_perplexity)

    convert = commands.add_parser(
        "convert",
        help="write a GGUF file (or checkpoint) as a Hugging Face checkpoint with its "
        "tokenizer, chat template and generation config",
    )
    convert.add_argument("model", help=".gguf file or checkpoint directory")
    convert.add_argument("output", help="output directory")
    convert.add_argument("--dtype", choices=_DTYPES, default="float32")
    convert.set_defaults(run=_convert)

    quantize = commands.add_parser(
        "quantize",
        help="write a model's linear layers quantized (GPTQ-calibrated by default) as a "
        "checkpoint that eqdel loads, with its tokenizer and chat template",
    )
    quantize.add_argument("model", help="checkpoint directory (with tokenizer.json) or .gguf")
    quantize.add_argument("output", help="output directory")
    quantize.add_argument("--scheme", choices=("int8", "nf4", "int4"), default="int8")
    quantize.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="inputs per scale (default: one scale per output channel for int8, 64 for NF4 "
        "and int4)",
    )
    quantize.add_argument(
        "--calibration",
        default=None,
        help="a text file for GPTQ to calibrate on (default: the English text shipped with "
        "eqdel); 'none' rounds every weight to nearest",
    )
    quantize.add_argument(
        "--calibration-tokens", type=int, default=1024, help="calibration tokens to use"
    )
    quantize.add_argument(
        "--embeddings", action="store_true", help="the token embeddings too, as int8"
    )
    quantize.set_defaults(run=_quantize)

    finetune = commands.add_parser(
        "finetune", help="fine-tune a checkpoint on a .txt or .jsonl file (resumes)"
    )
    finetune.add_argument("model_dir", help="checkpoint directory (with tokenizer.json) or .gguf")
    finetune.add_argument("data", help=".txt (a document per line) or .jsonl file")
    finetune.add_argument("--output", default="finetune-output", help="output directory")
    finetune.add_argument("--steps", type=int, default=100)
    finetune.add_argument("--batch-size", type=int, default=8)
    finetune.add_argument("--block-size", type=int, default=128)
    finetune.add_argument("--learning-rate", type=float, default=3e-4)
    finetune.add_argument("--warmup-steps", type=int, default=10)
    finetune.add_argument("--weight-decay", type=float, default=0.0)
    finetune.add_argument("--grad-accum-steps", type=int, default=1)
    finetune.add_argument("--lora-rank", type=int, default=None, help="train LoRA adapters")
    finetune.add_argument("--lora-alpha", type=float, default=None)
    finetune.add_argument("--compute-dtype", choices=("float32", "bfloat16"), default="float32")
    finetune.add_argument("--save-every", type=int, default=None)
    finetune.add_argument("--seed", type=int, default=0)
    finetune.add_argument("--text-field", default="text", help="JSONL field with the text")
    _add_mesh_arguments(finetune, default_devices=None)
    finetune.set_defaults(run=_finetune)

    demo = commands.add_parser(
        "demo",
        help="SmolLM2-135M-Instruct sharded on simulated CPU devices: chat, perplexity, "
        "LoRA fine-tuning on an embedded instruction set, chat again",
    )
    demo.add_argument("--output", default=None, help="keep the run here (default: discard)")
    demo.add_argument("--steps", type=int, default=None, help="fine-tuning steps")
    _add_mesh_arguments(demo, default_devices=8)
    demo.set_defaults(run=_demo, axis_dims="1,2,2,2")
    return parser


def _use_compilation_cache() -> None:
    """Keep every program a command compiles in JAX's persistent compilation cache, under
    eqdel's cache folder, so that running a command again skips compiling (unless a cache
    folder is set already, as `JAX_COMPILATION_CACHE_DIR`)."""
    import jax

    from ._smollm2 import cache_dir

    if jax.config.jax_compilation_cache_dir is not None:
        return
    jax.config.update("jax_compilation_cache_dir", str(cache_dir() / "jax"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_compilation_cache_max_size", COMPILATION_CACHE_BYTES)


COMPILATION_CACHE_BYTES = 2**30
"""The most the commands' compilation cache keeps on disk; the least recently used
programs go first."""


def main(argv: list[str] | None = None) -> int:
    from .checkpoint._gguf import readers_kept

    args = build_parser().parse_args(argv)
    _use_compilation_cache()
    try:
        with readers_kept():  # a GGUF model, its tokenizer and chat template: one parse
            return args.run(args)
    except ValueError as error:
        print(f"eqdel: error: {error}", file=sys.stderr)
        return 2


def console_main() -> int:
    """The `eqdel` command: `main` on `sys.argv`; with `EQDEL_HUGE_PAGES=1`, re-run first
    with huge pages for large host allocations where the system has them. (Off by
    default: on SmolLM2-135M every command took longer with them, 3.5 to 5.6 s.)"""
    if os.environ.get("EQDEL_HUGE_PAGES") == "1":
        rerun_with_huge_pages(["-m", "eqdel._cli", *sys.argv[1:]])
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
