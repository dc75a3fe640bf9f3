"""Where each parameter of a model lives in a Hugging Face checkpoint.

Model modules mirror Hugging Face's attribute names, so a parameter's attribute path is its
tensor name. Two rules make the mapping: modules stacked under a field called `layers`,
`experts` or `h` expand to `layers.0`, `layers.1`, ... (a parameter under two stacks both
ways); and the weights of `Linear` and `ExpertLinear`, stored `[in, out]` here, are
transposed from PyTorch's `[out, in]` (unless the `Linear` says its checkpoints store
`[in, out]`, as GPT-2's do).
"""

import dataclasses
import itertools
from typing import NamedTuple

import equinox as eqx

from .._lora import LoRALinear
from .._paths import get_path as get_path
from .._placement import is_array_like
from ..nn import ExpertLinear, Linear

_STACKS = ("layers", "experts", "h")  # `h`: GPT-2's blocks


class HFTensor(NamedTuple):
    """One parameter and its Hugging Face tensor(s).

    **Fields:**

    - `where`: attribute path from the model to the parameter.
    - `name`: the tensor name, with a `{}` for each stacked index.
    - `stacked`: how many leading dimensions of the parameter stack one tensor each
        (`0`; `1` for a layer; `2` for an expert in a layer).
    - `transpose`: whether the tensor is the transpose of the parameter (of each block).
    """

    where: tuple[str, ...]
    name: str
    stacked: int
    transpose: bool

    def names(self, counts: tuple[int, ...]) -> list[str]:
        """The tensor names for stacks of `counts` (the leading `stacked` sizes), in
        row-major order."""
        return [self.name.format(*index) for index in itertools.product(*map(range, counts))]


def hf_layout(model: eqx.Module) -> list[HFTensor]:
    """Every array parameter of `model` and the checkpoint tensor it corresponds to, in
    leaf order.

    **Arguments:**

    - `model`: a model, or its `eqx.filter_eval_shape` skeleton.

    **Returns:**

    A list of [`eqdel.checkpoint.HFTensor`][].
    """
    out: list[HFTensor] = []

    def visit(module, where: tuple[str, ...], names: tuple[str, ...], stacked: int):
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
                stacks = f.name in _STACKS
                name = f"{f.name}.{{}}" if stacks else f.name
                visit(value, (*where, f.name), (*names, name), stacked + stacks)
            elif is_array_like(value):
                transpose = f.name == "weight" and (
                    isinstance(module, ExpertLinear)
                    or (isinstance(module, Linear) and module.checkpoint_transposed)
                )
                out.append(
                    HFTensor((*where, f.name), ".".join((*names, f.name)), stacked, transpose)
                )
            else:
                raise TypeError(
                    f"{'.'.join((*where, f.name))}: checkpoint layout supports modules and "
                    f"arrays, not {type(value).__name__}."
                )

    visit(model, (), (), 0)
    return out
