"""`ShardingConfig`: the one frozen description of the device mesh and its rule tables."""

import contextlib
import contextvars
import dataclasses
import logging
import math
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec

from . import axes as ax

logger = logging.getLogger("eqdel")

RuleTable = tuple[tuple[str, tuple[str, ...]], ...]
Kind = Literal["parameter", "activation"]

_DEFAULT_PARAMETER_RULES = {
    ax.BATCH: ("dp", "fsdp"),
    ax.LENGTH: ("sp",),
    ax.QUERY_LENGTH: ("sp",),
    ax.KV_LENGTH: ("sp",),
    ax.EMBED: ("fsdp", "sp"),
    ax.HEAD: ("tp",),
    ax.KV_HEAD: ("tp",),
    ax.MLP_INTERMEDIATE: ("tp",),
    ax.VOCAB: ("tp",),
    ax.EXPERT: ("ep",),
}
_DEFAULT_ACTIVATION_RULES = {
    ax.BATCH: ("dp", "fsdp"),
    ax.LENGTH: ("sp",),
    ax.QUERY_LENGTH: ("sp",),
    ax.KV_LENGTH: ("sp",),
    ax.EMBED: ("tp",),
    ax.HEAD: ("tp",),
    ax.KV_HEAD: ("tp",),
    ax.MLP_INTERMEDIATE: ("tp",),
    ax.VOCAB: ("tp",),
    ax.EXPERT: ("ep",),
}
_DECODE_OVERRIDES = {ax.QUERY_LENGTH: (), ax.LENGTH: ()}
_DEFAULT_MODE_RULES = {ax.MODE_DECODE: _DECODE_OVERRIDES, ax.MODE_INSERT: _DECODE_OVERRIDES}

_INT_LIST = re.compile(r"^\s*-?\d+\s*(,\s*-?\d+\s*)*$")
_NAME_LIST = re.compile(r"^\s*[A-Za-z_]\w*\s*(,\s*[A-Za-z_]\w*\s*)*$")


@dataclasses.dataclass(frozen=True)
class Fallback:
    """A dimension left unsharded because its size does not divide over its mesh axes."""

    dim: int
    size: int
    mesh_axes: tuple[str, ...]
    mesh_size: int

    def problem(self) -> str:
        """What does not divide, e.g. `dim 0 (size 7) not divisible by 2 = mesh axes ...`."""
        return (
            f"dim {self.dim} (size {self.size}) not divisible by {self.mesh_size} "
            f"= mesh axes {self.mesh_axes}"
        )

    def __str__(self) -> str:
        return f"{self.problem()}; replicated"


def _parse_ints(value, what: str) -> tuple[int, ...]:
    if isinstance(value, str):
        if not _INT_LIST.match(value):
            raise ValueError(
                f"{what} {value!r} is not a comma-separated list of integers, e.g. '1,-1,1,1'."
            )
        return tuple(int(part) for part in value.split(","))
    return tuple(int(v) for v in value)


def _parse_names(value, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        if not _NAME_LIST.match(value):
            raise ValueError(
                f"{what} {value!r} is not a comma-separated list of names, e.g. 'dp,fsdp,tp,sp'."
            )
        return tuple(part.strip() for part in value.split(","))
    return tuple(str(v) for v in value)


def _mesh_axes_of(value) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        return (value,)
    return tuple(value)


def _freeze_rules(rules: Mapping | Sequence) -> RuleTable:
    items = rules.items() if isinstance(rules, Mapping) else rules
    return tuple((name, _mesh_axes_of(mesh_axes)) for name, mesh_axes in items)


@dataclasses.dataclass(frozen=True)
class ShardingConfig:
    """How arrays are laid out over devices: the mesh shape and the rules that map semantic
    axes onto mesh axes.

    The config is frozen and hashable, so it can be passed as a static argument to `jax.jit`.
    Nothing here touches the devices until [`eqdel.ShardingConfig.mesh`][] (or a method that
    needs the mesh size) is called, so a config can be built before
    `jax.distributed.initialize`.

    **Arguments:**

    - `axis_dims`: size of each mesh axis; one entry may be `-1` to absorb the remaining
        devices. A string such as `"1,-1,1,1"` is parsed strictly.
    - `axis_names`: name of each mesh axis (`"dp"`, `"fsdp"`, `"tp"`, `"sp"`, optionally
        `"ep"`). A string such as `"dp,fsdp,tp,sp"` is parsed strictly.
    - `parameter_rules`: semantic axis → mesh axes for parameters, merged over the defaults
        (batch → (dp, fsdp); lengths → sp; embed → (fsdp, sp); head, kv_head, mlp, vocab → tp;
        expert → ep).
    - `activation_rules`: the same for activations (embed → tp instead of (fsdp, sp)).
    - `mode_rules`: runtime mode → rules applied over both tables in that mode. By default
        decode and insert shard the query length on nothing.
    - `strict`: raise instead of replicating a dimension that does not divide over its mesh
        axes.
    - `backend`: the JAX backend whose devices form the mesh (`None`: the default backend).
    """

    axis_dims: Sequence[int] | str = (1, -1, 1, 1)
    axis_names: Sequence[str] | str = ("dp", "fsdp", "tp", "sp")
    parameter_rules: Mapping | Sequence = dataclasses.field(default=(), repr=False)
    activation_rules: Mapping | Sequence = dataclasses.field(default=(), repr=False)
    mode_rules: Mapping | Sequence = dataclasses.field(default=(), repr=False)
    strict: bool = False
    backend: str | None = None

    def __post_init__(self):
        dims = _parse_ints(self.axis_dims, "axis_dims")
        names = _parse_names(self.axis_names, "axis_names")
        if len(dims) != len(names):
            raise ValueError(
                f"axis_dims {dims} has {len(dims)} entries but axis_names {names} has "
                f"{len(names)}; give one size per mesh axis."
            )
        if len(set(names)) != len(names):
            raise ValueError(f"axis_names {names} repeats a name; each mesh axis needs its own.")
        if dims.count(-1) > 1:
            raise ValueError(
                f"axis_dims {dims} has more than one -1; only one axis can absorb the "
                "remaining devices."
            )
        bad = [d for d in dims if d == 0 or d < -1]
        if bad:
            raise ValueError(
                f"axis_dims {dims} has invalid size {bad[0]}; sizes are positive, or -1 for "
                "the axis that absorbs the remaining devices."
            )
        object.__setattr__(self, "axis_dims", dims)
        object.__setattr__(self, "axis_names", names)

        user_parameter = _freeze_rules(self.parameter_rules)
        user_activation = _freeze_rules(self.activation_rules)
        if isinstance(self.mode_rules, Mapping):
            user_modes = tuple((m, _freeze_rules(r)) for m, r in self.mode_rules.items())
        else:
            user_modes = tuple((m, _freeze_rules(r)) for m, r in self.mode_rules)
        for mode, _ in user_modes:
            if mode not in ax.RUNTIME_MODES:
                raise ValueError(
                    f"mode_rules has unknown mode {mode!r}; known modes are "
                    f"{sorted(ax.RUNTIME_MODES)}."
                )
        for table_name, table in (
            ("parameter_rules", user_parameter),
            ("activation_rules", user_activation),
            *((f"mode_rules[{m!r}]", r) for m, r in user_modes),
        ):
            self._check_rules(table_name, table)

        def merged(default: Mapping, user: RuleTable) -> RuleTable:
            table = {k: self._present(v) for k, v in default.items()}
            table.update(dict(user))
            return tuple(sorted(table.items()))

        modes = {m: dict(r) for m, r in _DEFAULT_MODE_RULES.items()}
        for mode, rules in user_modes:
            modes.setdefault(mode, {}).update(dict(rules))
        object.__setattr__(
            self, "parameter_rules", merged(_DEFAULT_PARAMETER_RULES, user_parameter)
        )
        object.__setattr__(
            self, "activation_rules", merged(_DEFAULT_ACTIVATION_RULES, user_activation)
        )
        object.__setattr__(
            self,
            "mode_rules",
            tuple(sorted((m, merged(r, ())) for m, r in modes.items())),
        )

    def _present(self, mesh_axes: tuple[str, ...]) -> tuple[str, ...]:
        """Default rules may name axes (such as `ep`) that this mesh does not have."""
        return tuple(a for a in mesh_axes if a in self.axis_names)

    def _check_rules(self, table_name: str, table: RuleTable) -> None:
        for name, mesh_axes in table:
            if name not in ax.SEMANTIC_AXES:
                raise ValueError(
                    f"{table_name} has a rule for {name!r}, which is not a semantic axis; "
                    "use the names in eqdel.axes (e.g. axes.EMBED)."
                )
            for mesh_axis in mesh_axes:
                if mesh_axis not in self.axis_names:
                    raise ValueError(
                        f"{table_name} maps {name} to mesh axis {mesh_axis!r}, which is not "
                        f"one of axis_names {self.axis_names}."
                    )

    # -- the mesh ---------------------------------------------------------------------------

    def devices(self) -> list:
        """All global devices of the configured backend, in a stable order."""
        return list(jax.devices(self.backend))

    def mesh_shape(self) -> dict[str, int]:
        """The size of every mesh axis, with `-1` resolved against the device count.

        **Returns:**

        A dict from mesh axis name to its size.

        **Raises:**

        `ValueError` if the sizes do not fit the number of devices.
        """
        count = len(self.devices())
        fixed = math.prod(d for d in self.axis_dims if d != -1)
        if -1 in self.axis_dims:
            if count % fixed:
                raise ValueError(
                    f"axis_dims {self.axis_dims} needs a multiple of {fixed} devices; found "
                    f"{count}. Use fixed sizes whose product divides {count}."
                )
            dims = tuple(count // fixed if d == -1 else d for d in self.axis_dims)
        else:
            if fixed != count:
                raise ValueError(
                    f"axis_dims {self.axis_dims} needs {fixed} devices; found {count}. "
                    "Use sizes whose product is the device count, or -1 on one axis."
                )
            dims = self.axis_dims
        return dict(zip(self.axis_names, dims))

    @contextlib.contextmanager
    def activate(self):
        """Run the enclosed code on this config: its mesh is set with `jax.set_mesh`
        (which ring attention and `shard_map` read), and models constrain their hidden
        states between layers, and their attention inputs and outputs (see
        `shard_attention_computation` in the model configs), to its activation rules;
        [`eqdel.constrain`][] without a config uses it too. Trace (call for the first
        time) the jitted functions that should see it inside the block.

        !!! example

            ```python
            with cfg.activate():
                logits = jax.jit(lambda m, ids: m(ids).logits)(model, ids)
            ```
        """
        token = _ACTIVE.set(self)
        try:
            with jax.set_mesh(self.mesh()):
                yield self
        finally:
            _ACTIVE.reset(token)

    def mesh(self) -> Mesh:
        """Build the device mesh.

        With one process the devices are laid out for the fastest interconnect
        (`mesh_utils.create_device_mesh`); with several processes the mesh is a hybrid one
        whose outer factors span processes (DCN) and inner factors stay within a process.

        **Returns:**

        A `jax.sharding.Mesh` over all global devices, every axis `AxisType.Auto`.
        """
        from jax.experimental import mesh_utils

        shape = tuple(self.mesh_shape().values())
        devices = self.devices()
        processes = len({d.process_index for d in devices})
        if processes > 1:
            ici, dcn = _split_over_processes(shape, processes)
            grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
        else:
            grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
        return Mesh(np.asarray(grid), self.axis_names, axis_types=(AxisType.Auto,) * len(shape))

    # -- rules ------------------------------------------------------------------------------

    def rules(self, mode: str = ax.MODE_TRAIN, kind: Kind = "parameter") -> dict:
        """The rule table in force for `mode`.

        **Arguments:**

        - `mode`: a runtime mode from `eqdel.axes`.
        - `kind`: `"parameter"` or `"activation"`.

        **Returns:**

        A dict from semantic axis to a tuple of mesh axis names.
        """
        if kind not in ("parameter", "activation"):
            raise ValueError(f"kind must be 'parameter' or 'activation', not {kind!r}.")
        if mode not in ax.RUNTIME_MODES:
            raise ValueError(f"Unknown mode {mode!r}; known modes are {sorted(ax.RUNTIME_MODES)}.")
        base = self.parameter_rules if kind == "parameter" else self.activation_rules
        table = dict(base)
        table.update(dict(dict(self.mode_rules).get(mode, ())))
        return table

    def resolve(
        self,
        axes,
        mode: str | int = ax.MODE_TRAIN,
        shape: Sequence[int] | None = None,
        *,
        kind: Kind = "activation",
    ) -> PartitionSpec:
        """Turn semantic axes into a `PartitionSpec` on this mesh.

        **Arguments:**

        - `axes`: one entry per dimension (semantic axis, parallelism token, a list of those,
            `EMPTY` or `None`), or a `DynamicShardingAxes` preset (class or instance), whose
            own mode is then used.
        - `mode`: a runtime mode, or a dimension index: decode if `shape[mode] == 1`, else
            train.
        - `shape`: the array's shape. When given, a dimension that does not divide over its
            mesh axes is replicated (or raises if `strict`).
        - `kind`: use the `"activation"` (default) or `"parameter"` rule table.

        **Returns:**

        A `jax.sharding.PartitionSpec` with one entry per dimension.
        """
        spec, _ = self.resolve_with_fallbacks(axes, mode, shape, kind=kind)
        return spec

    def resolve_with_fallbacks(
        self,
        axes,
        mode: str | int = ax.MODE_TRAIN,
        shape: Sequence[int] | None = None,
        *,
        kind: Kind = "activation",
        where: str = "array",
    ) -> tuple[PartitionSpec, tuple[Fallback, ...]]:
        """As [`eqdel.ShardingConfig.resolve`][], also returning the dimensions that were
        replicated because they do not divide; `where` names the array in errors."""
        if is_preset(axes):
            axes, mode = axes.axes, axes.mode
        axes = tuple(axes)
        if shape is not None and len(shape) != len(axes):
            raise ValueError(
                f"{where}: axes {format_axes(axes)} name {len(axes)} dimensions but the shape "
                f"{tuple(shape)} has {len(shape)}."
            )
        if isinstance(mode, int) and not isinstance(mode, bool):
            if shape is None:
                raise ValueError(
                    f"{where}: mode {mode} (infer from dimension {mode}) needs the shape."
                )
            mode = ax.MODE_DECODE if shape[mode] == 1 else ax.MODE_TRAIN
        table = self.rules(mode, kind)
        sizes = self.mesh_shape() if shape is not None else None
        used: set[str] = set()
        entries, fallbacks = [], []
        for dim, entry in enumerate(axes):
            mesh_axes = [a for a in self._lookup(entry, table, where) if a not in used]
            if sizes is not None and mesh_axes:
                total = math.prod(sizes[a] for a in mesh_axes)
                if shape[dim] % total:
                    fallback = Fallback(dim, shape[dim], tuple(mesh_axes), total)
                    if self.strict:
                        raise ValueError(
                            f"{where}: {fallback.problem()} "
                            f"(axes {format_axes(axes)}, shape {tuple(shape)}). Change the "
                            "mesh, the rules, or use strict=False to replicate it."
                        )
                    logger.info("%s: %s", where, fallback)
                    fallbacks.append(fallback)
                    mesh_axes = []
            used.update(mesh_axes)
            entries.append(
                None
                if not mesh_axes
                else mesh_axes[0]
                if len(mesh_axes) == 1
                else tuple(mesh_axes)
            )
        return PartitionSpec(*entries), tuple(fallbacks)

    def _lookup(self, entry, table: dict, where: str) -> list[str]:
        if entry is None or entry == ax.EMPTY:
            return []
        if isinstance(entry, (list, tuple)):
            found: list[str] = []
            for part in entry:
                found.extend(a for a in self._lookup(part, table, where) if a not in found)
            return found
        if entry in ax.PARALLELISM_TOKENS:
            name = ax.PARALLELISM_TOKENS[entry]
            return [name] if name in self.axis_names else []
        if entry in ax.SEMANTIC_AXES:
            return list(table.get(entry, ()))
        if entry in self.axis_names:
            return [entry]
        raise ValueError(
            f"{where}: {entry!r} is neither a semantic axis, a parallelism token nor a mesh "
            f"axis of {self.axis_names}."
        )


def is_preset(value) -> bool:
    """Whether `value` is a `DynamicShardingAxes` preset, as a class or an instance."""
    return isinstance(value, ax.DynamicShardingAxes) or (
        isinstance(value, type) and issubclass(value, ax.DynamicShardingAxes)
    )


def format_axes(axes) -> str:
    """Short readable form of semantic axes: `(embed, head)`."""

    def name(entry):
        if entry is None:
            return "None"
        if isinstance(entry, (list, tuple)):
            return "(" + ", ".join(name(e) for e in entry) + ")"
        return entry.strip("_").lower() or "_"

    return "(" + ", ".join(name(e) for e in axes) + ")"


def _split_over_processes(
    shape: tuple[int, ...], processes: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Split each axis size into (within process, across processes) factors, giving the
    outermost axes the cross-process factors first (data parallelism tolerates DCN best)."""
    remaining = processes
    ici, dcn = [], []
    for size in shape:
        across = math.gcd(size, remaining)
        remaining //= across
        dcn.append(across)
        ici.append(size // across)
    if remaining != 1:
        raise ValueError(
            f"mesh shape {shape} cannot be split over {processes} processes; make the product "
            f"of some axes a multiple of {processes}."
        )
    return tuple(ici), tuple(dcn)


_ACTIVE: contextvars.ContextVar["ShardingConfig | None"] = contextvars.ContextVar(
    "eqdel_active_sharding", default=None
)


def active_sharding() -> ShardingConfig | None:
    """The config of the innermost `ShardingConfig.activate()` block, if any."""
    return _ACTIVE.get()
