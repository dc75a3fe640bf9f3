"""The `eqdel` command line."""

import argparse
import sys

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
    from ._demo import run_demo

    run_demo(_sharding_config(args))
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

    demo = commands.add_parser(
        "demo", help="build a tiny model, shard it on simulated CPU devices and run it"
    )
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


if __name__ == "__main__":
    sys.exit(main())
