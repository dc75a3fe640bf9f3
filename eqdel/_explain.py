"""`explain_sharding`: a readable table of where every array leaf goes."""

import math

from jax.sharding import PartitionSpec

from . import axes as ax
from ._placement import placements
from ._sharding_config import Kind, ShardingConfig, format_axes


def _bytes_per_device(shape, itemsize: int, spec: PartitionSpec, sizes: dict) -> int:
    per_device = 1
    for size, entry in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = () if entry is None else (entry,) if isinstance(entry, str) else entry
        per_device *= -(-size // math.prod(sizes[n] for n in names))
    return per_device * itemsize


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def explain_sharding(
    tree, cfg: ShardingConfig, mode: str | int = ax.MODE_TRAIN, kind: Kind = "parameter"
) -> str:
    """Describe the placement [`eqdel.shard`][] would give every array leaf.

    **Arguments:** as [`eqdel.shard`][].

    **Returns:**

    A text table with one row per array leaf (path, shape, dtype, semantic axes,
    `PartitionSpec`, bytes per device), the total bytes per device, and every dimension
    replicated because its size does not divide over its mesh axes.
    """
    sizes = cfg.mesh_shape()
    rows, fallbacks, total = [], [], 0
    for p in placements(tree, cfg, mode, kind):
        nbytes = _bytes_per_device(p.leaf.shape, p.leaf.dtype.itemsize, p.spec, sizes)
        total += nbytes
        rows.append(
            (
                p.path,
                str(tuple(p.leaf.shape)),
                str(p.leaf.dtype),
                "-" if p.axes is None else format_axes(p.axes),
                str(tuple(p.spec)),
                _human(nbytes),
            )
        )
        fallbacks.extend(f"{p.path}: {f}" for f in p.fallbacks)
    header = ("path", "shape", "dtype", "axes", "spec", "bytes/device")
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row):
        return "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()

    mesh = ", ".join(f"{name}={size}" for name, size in sizes.items())
    out = [f"mesh ({mesh})", line(header), line(tuple("-" * w for w in widths))]
    out += [line(r) for r in rows]
    out.append(f"total per device: {_human(total)} over {len(rows)} arrays")
    if fallbacks:
        out.append("replicated because not divisible:")
        out += [f"  {f}" for f in fallbacks]
    return "\n".join(out)
