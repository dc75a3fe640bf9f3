"""Low-rank adapters on the linear layers of any eqdel model, and the PEFT file layout."""

import json
import math
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray
from safetensors.numpy import load_file, save_file

from ._field import field
from ._paths import get_path, module_paths
from ._quant import QUANTIZED, dequantized_linear
from .nn import Linear
from .nn._linear import matmul

_ADAPTER_CONFIG = "adapter_config.json"
_ADAPTER_WEIGHTS = "adapter_model.safetensors"


class LoRALinear(eqx.Module):
    """A frozen-able `Linear` (or quantized linear, for QLoRA) plus a trainable low-rank
    update: `base(x) + scale * (x @ lora_A) @ lora_B`."""

    base: eqx.Module
    lora_A: Float[Array, "*layers in_features rank"] = field(
        axes=lambda self: (self.base.axes[0], None)
    )
    lora_B: Float[Array, "*layers rank out_features"] = field(
        axes=lambda self: (None, self.base.axes[1])
    )
    scale: float = eqx.field(static=True)

    def __call__(
        self, x: Float[Array, "*batch in_features"]
    ) -> Float[Array, "*batch out_features"]:
        """**Arguments:**

        - `x`: inputs.

        **Returns:**

        The base projection plus the scaled low-rank update.
        """
        update = matmul(matmul(x, self.lora_A.astype(x.dtype)), self.lora_B.astype(x.dtype))
        return self.base(x) + self.scale * update

    def merged(self) -> Linear:
        """The plain `Linear` with the update folded into its (dequantised) weight."""
        base = self.base if isinstance(self.base, Linear) else dequantized_linear(self.base)
        delta = self.scale * (self.lora_A @ self.lora_B)
        weight = (base.weight + delta).astype(base.weight.dtype)
        return eqx.tree_at(lambda layer: layer.weight, base, weight)


def apply_lora(model, rank: int, alpha: float, targets, *, key: PRNGKeyArray):
    """A new model whose targeted linear layers carry low-rank adapters.

    `lora_A` starts as PEFT's Kaiming-uniform and `lora_B` as zeros, so the new model
    computes exactly what `model` does until it is trained.

    **Arguments:**

    - `model`: any eqdel model.
    - `rank`: the adapters' rank.
    - `alpha`: the update is scaled by `alpha / rank`.
    - `targets`: field names of the linear layers to adapt, e.g. `("q_proj", "v_proj")`.
    - `key`: randomness for `lora_A`.

    **Returns:**

    The adapted model. Train only its adapters with `trainable=lora_filter(model)`.

    **Raises:**

    `ValueError` when no linear layer matches `targets`, or the model already has
    adapters.
    """
    if rank < 1:
        raise ValueError(f"LoRA rank must be at least 1, not {rank}.")
    if _lora_paths(model):
        raise ValueError("The model already has LoRA adapters; merge_lora it first.")
    targets = set(targets)
    adaptable = (Linear, *QUANTIZED)
    paths = module_paths(
        model, lambda name, value: isinstance(value, adaptable) and name in targets
    )
    if not paths:
        raise ValueError(f"No linear layer is called any of {sorted(targets)}.")
    adapted = []
    for path, k in zip(paths, jax.random.split(key, len(paths))):
        base = get_path(model, path)
        weight = (
            base.weight
            if isinstance(base, Linear)
            else jax.eval_shape(lambda base=base: dequantized_linear(base).weight)
        )
        *layers, fan_in, fan_out = weight.shape
        bound = 1.0 / math.sqrt(fan_in)  # kaiming_uniform(a=sqrt(5)), as PEFT does
        a = jax.random.uniform(k, (*layers, fan_in, rank), weight.dtype, -bound, bound)
        b = jnp.zeros((*layers, rank, fan_out), weight.dtype)
        adapted.append(LoRALinear(base, a, b, alpha / rank))
    where = lambda m: [get_path(m, p) for p in paths]  # noqa: E731
    return eqx.tree_at(where, model, adapted)


def lora_filter(model):
    """A pytree of bools, `True` exactly at the adapters' `lora_A` and `lora_B` arrays: the
    `trainable` argument that trains only the adapters."""
    spec = jax.tree.map(lambda _: False, model)

    def mark(path):
        return lambda s: eqx.tree_at(
            lambda t: (get_path(t, path).lora_A, get_path(t, path).lora_B), s, (True, True)
        )

    for path in _lora_paths(model):
        spec = mark(path)(spec)
    return spec


def _lora_paths(model) -> list[tuple[str, ...]]:
    return module_paths(model, lambda name, value: isinstance(value, LoRALinear))


def merge_lora(model):
    """A plain model: every `LoRALinear` replaced by its merged `Linear`."""
    paths = _lora_paths(model)
    if not paths:
        return model
    where = lambda m: [get_path(m, p) for p in paths]  # noqa: E731
    return eqx.tree_at(where, model, [get_path(model, p).merged() for p in paths])


def _peft_names(path: tuple[str, ...], layers: int | None) -> list[str]:
    name = ".".join("layers.{}" if p == "layers" else p for p in path)
    prefix = f"base_model.model.{name}"
    return [prefix.format(i) for i in range(layers)] if layers else [prefix]


def save_lora(model, path, *, base_model_name_or_path: str | None = None) -> Path:
    """Write the adapters in PEFT's layout (`adapter_config.json` +
    `adapter_model.safetensors`), loadable with `peft.PeftModel.from_pretrained`."""
    paths = _lora_paths(model)
    if not paths:
        raise ValueError("The model has no LoRA adapters to save.")
    first = get_path(model, paths[0])
    rank = first.lora_A.shape[-1]
    tensors = {}
    for where in paths:
        layer = get_path(model, where)
        a, b = np.asarray(layer.lora_A), np.asarray(layer.lora_B)
        stacked = a.ndim == 3
        names = _peft_names(where, a.shape[0] if stacked else None)
        a_blocks = list(a) if stacked else [a]
        b_blocks = list(b) if stacked else [b]
        for name, a_i, b_i in zip(names, a_blocks, b_blocks):
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(a_i.T)
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(b_i.T)
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": int(rank),
        "lora_alpha": float(first.scale * rank),
        "target_modules": sorted({p[-1] for p in paths}),
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": not first.base.checkpoint_transposed,
        "base_model_name_or_path": base_model_name_or_path,
    }
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / _ADAPTER_WEIGHTS), metadata={"format": "pt"})
    (path / _ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))
    return path


def load_lora(model, path):
    """`model` with the PEFT adapters in `path` applied (`model` has none yet).

    **Raises:**

    `ValueError` naming a missing adapter tensor or a shape that does not fit.
    """
    path = Path(path)
    config = json.loads((path / _ADAPTER_CONFIG).read_text())
    tensors = load_file(str(path / _ADAPTER_WEIGHTS))
    adapted = apply_lora(
        model,
        config["r"],
        config["lora_alpha"],
        config["target_modules"],
        key=jax.random.key(0),
    )
    for where in _lora_paths(adapted):
        layer = get_path(adapted, where)
        stacked = layer.lora_A.ndim == 3
        names = _peft_names(where, layer.lora_A.shape[0] if stacked else None)
        arrays = []
        for suffix, current in (("lora_A", layer.lora_A), ("lora_B", layer.lora_B)):
            blocks = []
            for name in names:
                key = f"{name}.{suffix}.weight"
                if key not in tensors:
                    raise ValueError(f"{path / _ADAPTER_WEIGHTS}: missing {key}.")
                blocks.append(tensors[key].T)
            value = np.stack(blocks) if stacked else blocks[0]
            if value.shape != current.shape:
                raise ValueError(
                    f"{path / _ADAPTER_WEIGHTS}: {names[0]}.{suffix} has shape "
                    f"{value.shape[-2:]} but the model needs {current.shape[-2:]}."
                )
            arrays.append(jnp.asarray(value, current.dtype))
        adapted = eqx.tree_at(
            lambda m, w=where: (get_path(m, w).lora_A, get_path(m, w).lora_B), adapted, arrays
        )
    return adapted
