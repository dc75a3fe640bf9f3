"""`from_pretrained`: a Hugging Face checkpoint directory to a (sharded) eqdel model."""

import dataclasses
import json
import warnings
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, SingleDeviceSharding
from safetensors import SafetensorError, safe_open
from tqdm.auto import tqdm

from .._generation_config import GenerationConfig
from .._paths import module_paths
from .._placement import placements
from .._quant import QUANT_METHOD, checked_request, quantize_linears, with_int8_embeddings
from .._sharding_config import ShardingConfig
from ..models import config_class
from ..models._registry import MODEL_TYPES
from ..nn import Linear
from ._errors import CheckpointError
from ._ggml_blocks import KEPT_TYPES
from ._gguf import GGUFCheckpoint, is_gguf
from ._layout import HFTensor, hf_layout

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(path: Path) -> dict:
    """The parsed `config.json` of a checkpoint directory."""
    file = path / "config.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no config.json; is this a Hugging Face checkpoint?")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{file}: not valid JSON ({error}).") from None


def _saved_generation_config(path: Path, config) -> GenerationConfig | None:
    """The checkpoint's `generation_config.json` (if any), with the end and pad tokens of
    `config` where it names none; `None` when it says no more than `config` does."""
    file = path / "generation_config.json"
    if not file.is_file():
        return None
    defaults = GenerationConfig.from_model_config(config)
    try:
        saved = GenerationConfig.from_hf(json.loads(file.read_text()))
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{file}: not valid JSON ({error}).") from None
    except (TypeError, ValueError) as error:
        raise CheckpointError(f"{file}: {error}") from None
    merged = dataclasses.replace(
        saved,
        eos_token_id=saved.eos_token_id or defaults.eos_token_id,
        pad_token_id=defaults.pad_token_id if saved.pad_token_id is None else saved.pad_token_id,
    )
    return None if merged == defaults else merged  # nothing beyond the model config's


def _weight_files(path: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index}: not a safetensors index ({error!r}).") from None
        files = {name: path / file for name, file in weight_map.items()}
        for file in sorted(set(files.values())):
            if not file.is_file():
                raise CheckpointError(f"{index} lists {file.name}, which does not exist.")
        return files
    single = path / SINGLE_FILE
    if not single.is_file():
        raise CheckpointError(
            f"{path}: no {SINGLE_FILE} or {INDEX_FILE}; only safetensors weights are read."
        )
    return dict.fromkeys(_open(single).keys(), single)


def _open(file: Path):
    try:
        return safe_open(str(file), framework="numpy")
    except (SafetensorError, OSError) as error:
        raise CheckpointError(
            f"{file}: cannot read safetensors file ({error}); it may be truncated or corrupt."
        ) from None


class _Reader:
    """Opened safetensors files, and slices of the tensors in them."""

    def __init__(self, files: dict[str, Path]):
        self.files = files
        self.names = set(files)
        self.handles = {file: _open(file) for file in sorted(set(files.values()))}

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.files[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple) -> np.ndarray:
        file = self.files[name]
        try:
            return self.handles[file].get_slice(name)[index]
        except (SafetensorError, OSError, ValueError) as error:
            raise CheckpointError(
                f"{file}: cannot read {name} ({error}); the file may be truncated or corrupt."
            ) from None


def _check_names(layout: list[HFTensor], skeleton_leaves, reader, tied: bool, path) -> None:
    expected = {
        name
        for t, leaf in zip(layout, skeleton_leaves)
        for name in t.names(leaf.shape[: t.stacked])
    }
    present = reader.names
    missing = sorted(expected - present)
    unexpected = sorted(
        n
        for n in present - expected
        if not n.endswith(_IGNORED_SUFFIXES) and not (tied and n == "lm_head.weight")
    )
    problems = []
    if missing:
        problems.append(f"missing weights: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected weights: {', '.join(unexpected)}")
    if problems:
        raise CheckpointError(f"{path} does not fit the model; " + "; ".join(problems) + ".")


def _check_shapes(layout, skeleton_leaves, reader, source: str) -> None:
    for tensor, leaf in zip(layout, skeleton_leaves):
        shape = leaf.shape[tensor.stacked :]
        want = shape[::-1] if tensor.transpose else shape
        for name in tensor.names(leaf.shape[: tensor.stacked]):
            got = reader.shape(name)
            if got != tuple(want):
                raise CheckpointError(
                    f"{name}: checkpoint shape {got} but the model expects {tuple(want)} "
                    f"(from {source})."
                )


def _cast(array: np.ndarray, dtype, name: str) -> np.ndarray:
    floating = np.issubdtype(array.dtype, np.floating) or array.dtype == jnp.bfloat16
    if jnp.issubdtype(dtype, jnp.floating) and not floating:
        raise CheckpointError(
            f"{name} is stored as {array.dtype.name}, but it is a floating-point weight."
        )
    with np.errstate(over="ignore"):
        out = array.astype(dtype)
    if floating:
        overflow = ~np.isfinite(out.astype(np.float32)) & np.isfinite(array.astype(np.float32))
        if overflow.any():
            raise CheckpointError(
                f"{name}: values up to {float(np.abs(array.astype(np.float32)).max()):.3g} "
                f"overflow {np.dtype(dtype).name}; load in a wider dtype."
            )
    return out


def _load_dtype(leaf, dtype):
    """Floating parameters load in the requested dtype; quantization codes keep theirs."""
    return dtype if jnp.issubdtype(leaf.dtype, jnp.floating) else leaf.dtype


def _linears_named(model, names: list[str]) -> list[tuple[str, ...]]:
    """The paths of `model`'s `Linear` layers whose field name is one of `names`."""
    return module_paths(model, lambda name, module: isinstance(module, Linear) and name in names)


def _quantized_as(parts: list[tuple[str, int | None, list[str]]], embedding_group):
    """The transformation that quantizes a skeleton's linear layers, for each
    `(scheme, group_size, modules)` of `parts` the layers named `modules` (if any), and,
    when `embedding_group` is set, its token embeddings in groups of that size."""

    def transform(model):
        for scheme, group_size, modules in parts:
            if paths := _linears_named(model, modules):
                model = quantize_linears(model, paths, scheme, group_size, None, False)
        return model if embedding_group is None else with_int8_embeddings(model, embedding_group)

    return transform


def _quantization(path: Path, hf: dict):
    """The transformation that gives the skeleton the checkpoint's quantized layers."""
    config = hf.get("quantization_config")
    if config is None:
        return lambda model: model
    if config.get("quant_method") != QUANT_METHOD:
        raise CheckpointError(
            f"{path / 'config.json'}: quantization {config.get('quant_method')!r} is not "
            f"supported; eqdel reads its own ({QUANT_METHOD!r}) and float checkpoints."
        )
    request = checked_request(config["bits"], config.get("scheme"), config.get("group_size"))
    parts = [(*request, config["modules"])]
    return _quantized_as(parts, config.get("embedding_group_size"))


def _gguf_kept(path: Path, reader: GGUFCheckpoint):
    """The transformation that gives the skeleton the quantized layers and embeddings
    that a GGUF file stores in kept types (`eqdel.checkpoint.KEPT_TYPES`)."""
    by_kind: dict[tuple[str, int], list[str]] = {}
    for module, kind in reader.kept_modules.items():
        by_kind.setdefault(kind, []).append(module)
    if not by_kind and reader.embedding_group is None:
        warnings.warn(
            f"{path.name} stores no linear layer (in every layer) nor its token embeddings "
            f"in a type kept quantized ({', '.join(KEPT_TYPES)}); it loads as float.",
            stacklevel=3,
        )
    parts = [(scheme, group, modules) for (scheme, group), modules in sorted(by_kind.items())]
    return _quantized_as(parts, reader.embedding_group)


def _loader(tensor: HFTensor, reader, dtype, shape: tuple[int, ...]):
    """The `make_array_from_callback` callback for one parameter of `shape`."""

    def one(name: str, index: tuple) -> np.ndarray:
        hf_index = index[::-1] if tensor.transpose else index
        block = reader.read(name, hf_index)
        return _cast(block.T if tensor.transpose else block, dtype, name)

    def load(index: tuple, picked: tuple = ()) -> np.ndarray:
        depth = len(picked)
        if depth == tensor.stacked:
            return one(tensor.name.format(*picked), index[depth:])
        chosen = range(*index[depth].indices(shape[depth]))
        return np.stack([load(index, (*picked, i)) for i in chosen])

    return load


def from_pretrained(
    path,
    *,
    dtype=None,
    sharding: ShardingConfig | None = None,
    progress: bool = True,
    keep_quantized: bool = False,
    **config_overrides,
):
    """Load a Hugging Face checkpoint directory or a GGUF file.

    Each tensor is read with `safetensors.safe_open` (or dequantised from the GGUF file,
    the rows a device needs at a time) and placed straight onto its final sharding with
    `jax.make_array_from_callback`: every device reads only its own slice, so no host or
    device ever holds a full copy of a sharded model.

    **Arguments:**

    - `path`: a directory with `config.json` and `model.safetensors` (or a sharded set
        with `model.safetensors.index.json`), or a llama.cpp `.gguf` file (architectures
        `eqdel.checkpoint.GGUF_ARCHITECTURES`, tensor types
        `eqdel.checkpoint.GGUF_TENSOR_TYPES`, dequantised to `dtype`).
    - `dtype`: parameter dtype (`jnp.float32` by default). A floating dtype; weights that
        overflow it raise.
    - `sharding`: a [`eqdel.ShardingConfig`][] to place the parameters on its mesh, or
        `None` for the default device.
    - `progress`: show a progress bar.
    - `keep_quantized`: for a GGUF file, keep the linear layers stored in every layer
        (and a separate head) as Q4_0, Q4_1 or Q4_K blocks as [`eqdel.Int4Linear`][]
        with groups of 32, those stored as Q8_0 or Q5_0 as [`eqdel.Int8Linear`][] with
        groups of 32, or as Q6_K with groups of 16, and token embeddings stored as one
        of the int8 types as an [`eqdel.Int8Embedding`][]
        (`eqdel.checkpoint.KEPT_TYPES`): the codes as stored, the scales and offsets in
        `dtype`. The model computes what the dequantised float one does; 4-bit codes
        take an eighth of float32's bytes and int8 codes a quarter, float32 scales and
        offsets a sixteenth more (a thirty-second for int8 in groups of 32). Other
        layers, and layers whose type changes from layer to layer, load as float. A
        file that mixes int4 and int8 layers loads both kinds, but `save_pretrained`
        saves one kind only.
    - `**config_overrides`: config fields to set, such as `scan_layers=False`.

    **Returns:**

    The model, e.g. an [`eqdel.models.LlamaForCausalLM`][].

    **Raises:**

    [`eqdel.checkpoint.CheckpointError`][] naming the file or tensor for a missing
    config.json, an unknown `model_type`, missing or unexpected weights, shape mismatches,
    unreadable files and overflowing dtypes.
    """
    path = Path(path)
    dtype = jnp.dtype(jnp.float32 if dtype is None else dtype)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise CheckpointError(f"dtype {dtype.name} cannot hold model weights; use a float dtype.")
    if is_gguf(path):
        reader = GGUFCheckpoint(path, keep_quantized=keep_quantized)
        hf, source = reader.hf_config, f"the metadata of {path.name}"
    elif keep_quantized:
        raise CheckpointError(
            f"{path}: keep_quantized applies to GGUF files; an eqdel checkpoint loads "
            "quantized as it was saved."
        )
    else:
        reader, hf, source = None, read_config(path), "config.json"
    model_type = hf.get("model_type")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(
            f"{path / 'config.json'}: unknown model_type {model_type!r}; eqdel supports "
            f"{sorted(MODEL_TYPES)}."
        )
    config = config_class(model_type).from_hf_config(hf, **config_overrides)
    if reader is None and "generation_config" not in config_overrides:
        generation = _saved_generation_config(path, config)
        config = dataclasses.replace(config, generation_config=generation)
    model_class = MODEL_TYPES[model_type]
    quantization = _quantization(path, hf)
    if keep_quantized:
        quantization = _gguf_kept(path, reader)
    skeleton = eqx.filter_eval_shape(
        lambda: quantization(model_class(config, dtype=dtype, key=jax.random.key(0)))
    )
    layout = hf_layout(skeleton)
    if reader is None:
        reader = _Reader(_weight_files(path))
    skeleton_leaves = jax.tree.leaves(skeleton)
    _check_names(layout, skeleton_leaves, reader, config.tie_word_embeddings, path)
    _check_shapes(layout, skeleton_leaves, reader, source)

    if sharding is None:
        shardings = [SingleDeviceSharding(jax.devices()[0])] * len(layout)
    else:
        mesh = sharding.mesh()
        shardings = [NamedSharding(mesh, p.spec) for p in placements(skeleton, sharding)]
    arrays = []
    for tensor, leaf, placed in tqdm(
        list(zip(layout, skeleton_leaves, shardings)),
        desc=f"loading {path.name}",
        unit="tensor",
        disable=not progress,
    ):
        arrays.append(
            jax.make_array_from_callback(
                leaf.shape, placed, _loader(tensor, reader, _load_dtype(leaf, dtype), leaf.shape)
            )
        )
    treedef = jax.tree.structure(skeleton)
    return jax.tree.unflatten(treedef, arrays)
