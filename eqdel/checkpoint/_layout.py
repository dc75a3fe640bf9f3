"""Where each parameter of a model lives in a Hugging Face checkpoint.

Model modules mirror Hugging Face's attribute names, so a parameter's attribute path is its
tensor name. Two rules make the mapping: decoder layers stacked under a field called
`layers` expand to `layers.0`, `layers.1`, ...; and `Linear` weights, stored `[in, out]`
here, are transposed from PyTorch's `[out, in]`.
"""

import dataclasses
from typing import NamedTuple

import equinox as eqx

from .._lora import LoRALinear
from .._paths import get_path as get_path
from .._placement import is_array_like
from ..nn import Linear


class HFTensor(NamedTuple):
    """One parameter and its Hugging Face tensor(s).

    **Fields:**

    - `where`: attribute path from the model to the parameter.
    - `name`: the tensor name; for stacked parameters it has a `{}` for the layer index.
    - `stacked`: whether the parameter stacks one tensor per layer on its first dimension.
    - `transpose`: whether the tensor is the transpose of the parameter (of each layer).
    """

    where: tuple[str, ...]
    name: str
    stacked: bool
    transpose: bool

    def names(self, layers: int) -> list[str]:
        return [self.name.format(i) for i in range(layers)] if self.stacked else [self.name]


def hf_layout(model: eqx.Module) -> list[HFTensor]:
    """Every array parameter of `model` and the checkpoint tensor it corresponds to, in
    leaf order.

    **Arguments:**

    - `model`: a model, or its `eqx.filter_eval_shape` skeleton.

    **Returns:**

    A list of [`eqdel.checkpoint.HFTensor`][].
    """
    out: list[HFTensor] = []

    def visit(module, where: tuple[str, ...], names: tuple[str, ...], stacked: bool):
        if isinstance(module, LoRALinear):
            raise ValueError(
                f"{'.'.join(where)} carries LoRA adapters; merge_lora the model before "
                "writing a Hugging Face checkpoint, or save the adapters with save_lora."
            )
        for f in dataclasses.fields(module):
            if f.metadata.get("static", False):
                continue
            value = getattr(module, f.name)
            if value is None:
                continue
            if isinstance(value, eqx.Module):
                is_layers = f.name == "layers"
                name = "layers.{}" if is_layers else f.name
                visit(value, (*where, f.name), (*names, name), stacked or is_layers)
            elif is_array_like(value):
                transpose = isinstance(module, Linear) and f.name == "weight"
                out.append(
                    HFTensor((*where, f.name), ".".join((*names, f.name)), stacked, transpose)
                )
            else:
                raise TypeError(
                    f"{'.'.join((*where, f.name))}: checkpoint layout supports modules and "
                    f"arrays, not {type(value).__name__}."
                )

    visit(model, (), (), False)
    return out
