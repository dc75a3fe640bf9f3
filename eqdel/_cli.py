"""The `eqdel` command line."""

import argparse
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


def _generate(args) -> int:
    import dataclasses
    from pathlib import Path

    import jax
    import jax.numpy as jnp
    from tokenizers import Tokenizer

    from ._generation import stream_generate
    from ._generation_config import GenerationConfig
    from .checkpoint import from_pretrained

    path = Path(args.model_dir)
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{path}: no tokenizer.json to encode the prompt with.")
    tokenizer = Tokenizer.from_file(str(tokenizer_file))
    model = from_pretrained(path, progress=False, quantize_kv_cache=args.int8_cache)
    defaults = GenerationConfig.from_pretrained(path)
    if not defaults.eos_token_id:
        defaults = dataclasses.replace(defaults, eos_token_id=model.config.eos_token_id)
    if defaults.pad_token_id is None:
        defaults = dataclasses.replace(defaults, pad_token_id=model.config.pad_token_id)
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
    tokens = tokenizer.encode(args.prompt).ids
    ids = jnp.asarray([tokens], jnp.int32)
    shown = tokenizer.decode(tokens)
    print(shown, end="", flush=True)
    for step in stream_generate(
        model, ids, key=jax.random.key(args.seed), generation_config=defaults, **overrides
    ):
        tokens.append(int(step[0]))
        text = tokenizer.decode(tokens)
        print(text[len(shown) :], end="", flush=True)
        shown = text
    print()
    return 0


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
        "generate", help="generate text from a checkpoint with its tokenizer.json"
    )
    generate.add_argument("model_dir", help="Hugging Face checkpoint directory")
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--max-new-tokens", type=int, default=None)
    generate.add_argument("--temperature", type=float, default=None, help="0: greedy")
    generate.add_argument("--top-k", type=int, default=None)
    generate.add_argument("--top-p", type=float, default=None)
    generate.add_argument("--min-p", type=float, default=None)
    generate.add_argument("--repetition-penalty", type=float, default=None)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--int8-cache", action="store_true", help="int8 KV cache")
    generate.set_defaults(run=_generate)

    finetune = commands.add_parser(
        "finetune", help="fine-tune a checkpoint on a .txt or .jsonl file (resumes)"
    )
    finetune.add_argument("model_dir", help="Hugging Face checkpoint with tokenizer.json")
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
        help="shard a tiny Llama on simulated CPU devices, fine-tune it on the embedded "
        "corpus, save, reload and generate",
    )
    demo.add_argument("--output", default=None, help="keep the run here (default: discard)")
    demo.add_argument("--steps", type=int, default=None, help="fine-tuning steps")
    _add_mesh_arguments(demo, default_devices=8)
    demo.set_defaults(run=_demo, axis_dims="1,2,2,2")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except ValueError as error:
        print(f"eqdel: error: {error}", file=sys.stderr)
        return 2


def console_main() -> int:
    """The `eqdel` command: `main` on `sys.argv`, re-run first with huge pages for
    large host allocations where the system has them (`EQDEL_HUGE_PAGES=0`: never)."""
    rerun_with_huge_pages(["-m", "eqdel._cli", *sys.argv[1:]])
    return main()


if __name__ == "__main__":
    sys.exit(console_main())
