"""GGUF files (llama.cpp's format): the Hugging Face config a file's metadata describes, and
its tensors dequantised under their Hugging Face names.

llama.cpp's converter renames every tensor (`blk.0.attn_q.weight` for
`model.layers.0.self_attn.q_proj.weight`), permutes the rows of Llama's query and key
projections (its rotary kernel pairs neighbouring dimensions, Hugging Face pairs the two
halves of a head) and stores Gemma's norms as `1 + weight`. Reading undoes all three, so
a GGUF loads through the same path as a safetensors checkpoint.
"""

import contextlib
import contextvars
from pathlib import Path

import numpy as np

from ._errors import CheckpointError
from ._ggml_blocks import KEPT_TYPES, int4_part, int8_part

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "phi3": "phi3",
    "gemma": "gemma",
    "gemma2": "gemma2",
}
"""GGUF `general.architecture` → the eqdel `model_type` it loads as."""

GGUF_TENSOR_TYPES = (
    "F32", "F16", "BF16", "Q8_0", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K",
)  # fmt: skip
"""The GGML tensor types read (and dequantised with the `gguf` package)."""

_EMBEDDINGS = "model.embed_tokens.weight"

_CONFIG_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "attention.sliding_window": "sliding_window",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
    "attn_logit_softcapping": "attn_logit_softcapping",
    "final_logit_softcapping": "final_logit_softcapping",
}  # `{architecture}.{key}` → config.json field
_TOKEN_IDS = {
    "bos_token_id": "tokenizer.ggml.bos_token_id",
    "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_OVERRIDES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},
}
_NORM_OFFSET = ("gemma", "gemma2")  # llama.cpp stores these norms as 1 + weight


def is_gguf(path: Path) -> bool:
    """Whether `path` names a GGUF file (rather than a checkpoint directory)."""
    return path.suffix.lower() == ".gguf" or (path.is_file() and _has_gguf_magic(path))


def _has_gguf_magic(path: Path) -> bool:
    with path.open("rb") as file:
        return file.read(4) == b"GGUF"


_KEPT_READERS: contextvars.ContextVar[dict | None] = contextvars.ContextVar(
    "eqdel_kept_gguf_readers", default=None
)


@contextlib.contextmanager
def readers_kept():
    """Within the block, each GGUF file is parsed once: `open_gguf` gives back the reader
    it made before while the file is unchanged. `gguf` takes about 3 s to parse the
    header of a file with a 49,152-token vocabulary, and loading a model, its tokenizer
    and its chat template each open the file; the reader holds about 160 MB, given back
    when the block ends."""
    outer = _KEPT_READERS.get()
    token = _KEPT_READERS.set({} if outer is None else outer)
    try:
        yield
    finally:
        _KEPT_READERS.reset(token)


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; no tensor is read yet); inside
    `readers_kept`, the one made before for the same file as it is on disk.

    **Raises:**

    `CheckpointError` naming the file when it is missing, truncated or not a GGUF file.
    """
    import gguf

    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file.")
    kept, stat = _KEPT_READERS.get(), path.stat()
    key = (path.resolve(), stat.st_ino, stat.st_size, stat.st_mtime_ns)
    if kept is not None and key in kept:
        return kept[key]
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"{path}: cannot read GGUF file ({error}); it may be truncated or corrupt."
        ) from None
    if kept is not None:
        kept[key] = reader
    return reader


def metadata(reader, key: str, default=None):
    """The value of GGUF metadata `key` (a number, string or list), or `default`."""
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _hf_tensor_name(name: str, architecture: str, path: Path) -> str:
    parts = name.split(".")
    base, suffix = ".".join(parts[:-1]), parts[-1]
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    if parts[0] == "blk" and len(parts) == 4:
        layer_names = {**_LAYER_TENSORS, **_LAYER_OVERRIDES.get(architecture, {})}
        if parts[2] in layer_names:
            return f"model.layers.{parts[1]}.{layer_names[parts[2]]}.{suffix}"
    raise CheckpointError(
        f"{path}: tensor {name!r} has no counterpart in eqdel's {architecture} models."
    )


class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face checkpoint: `hf_config` is its config.json, and
    `shape` / `read` give its tensors (dequantised to float32, llama.cpp's changes undone)
    under Hugging Face names, a slice at a time.

    **Arguments:**

    - `path`: the `.gguf` file.
    - `keep_quantized`: whether the linear layers stored in every layer in one of
        `KEPT_TYPES` that maps to one scheme and group size (`kept_modules`, by field
        name: `{"q_proj": ("int4", 32), ...}`), and a separate language-model head
        stored so (`"lm_head"`), are read as the `codes`, `scales` (and `offsets`) of an
        `eqdel.Int4Linear` or `eqdel.Int8Linear` rather than as a float `weight`, and
        token embeddings stored as an int8 type as those of an `eqdel.Int8Embedding`
        (`embedding_group`, its entries per scale).

    **Raises:**

    `CheckpointError` naming the file and the architecture, tensor or tensor type that
    eqdel does not read.
    """

    def __init__(self, path: Path, keep_quantized: bool = False):
        self.path = Path(path)
        self.reader = open_gguf(self.path)
        architecture = metadata(self.reader, "general.architecture")
        if architecture not in GGUF_ARCHITECTURES:
            raise CheckpointError(
                f"{self.path}: GGUF architecture {architecture!r} is not supported; eqdel "
                f"reads {sorted(GGUF_ARCHITECTURES)}."
            )
        self.architecture = architecture
        self.hf_config = self._hf_config()
        self.tensors = {}
        for tensor in self.reader.tensors:
            if tensor.tensor_type.name not in GGUF_TENSOR_TYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {tensor.name!r} is stored as "
                    f"{tensor.tensor_type.name}, which eqdel does not read; supported: "
                    f"{', '.join(GGUF_TENSOR_TYPES)}."
                )
            self.tensors[_hf_tensor_name(tensor.name, architecture, self.path)] = tensor
        self.names = set(self.tensors)
        self.kept_modules = self._kept_modules() if keep_quantized else {}
        embeddings = self.tensors.get(_EMBEDDINGS)
        stored_as = None if embeddings is None else embeddings.tensor_type.name
        scheme, group = KEPT_TYPES.get(stored_as, (None, None))
        self.embedding_group = group if keep_quantized and scheme == "int8" else None
        self._kept_parts = {
            f"{name.removesuffix('.weight')}.{part}": (name, part)
            for name, tensor in self.tensors.items()
            if self._module(name) in self.kept_modules
            for part in self._parts(tensor)
        }
        if self.embedding_group is not None:
            for part in ("codes", "scales"):
                self._kept_parts[f"model.embed_tokens.{part}"] = (_EMBEDDINGS, part)
        self.names -= {name for name, _ in self._kept_parts.values()}
        self.names |= set(self._kept_parts)

    @staticmethod
    def _module(name: str) -> str | None:
        """The field name of the linear layer whose weight is tensor `name` (`q_proj`,
        `lm_head`), or `None` for tensors outside the layers and head."""
        if name == "lm_head.weight" or name.startswith("model.layers."):
            return name.split(".")[-2] if name.endswith(".weight") else None
        return None

    @staticmethod
    def _parts(tensor) -> tuple[str, ...]:
        """The fields of the quantized layer that a tensor stored as `tensor` becomes."""
        int4 = KEPT_TYPES[tensor.tensor_type.name][0] == "int4"
        return ("codes", "scales", "offsets") if int4 else ("codes", "scales")

    def _kept_modules(self) -> dict[str, tuple[str, int]]:
        """`{field name: (scheme, group size)}` for the linear layers stored in every
        layer in types that `KEPT_TYPES` maps to that one scheme and group size."""
        kinds: dict[str, set] = {}
        for name, tensor in self.tensors.items():
            if (module := self._module(name)) is not None:
                kind = KEPT_TYPES.get(tensor.tensor_type.name) if len(tensor.shape) == 2 else None
                kinds.setdefault(module, set()).add(kind)
        return {
            module: kind
            for module, kinds_seen in sorted(kinds.items())
            if len(kinds_seen) == 1 and (kind := next(iter(kinds_seen))) is not None
        }

    def _hf_config(self) -> dict:
        reader, arch = self.reader, self.architecture
        scaling = metadata(reader, f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise CheckpointError(
                f"{self.path}: rope scaling {scaling!r} is not read from GGUF files yet."
            )
        hf = {"model_type": GGUF_ARCHITECTURES[arch]}
        for key, name in _CONFIG_KEYS.items():
            if (value := metadata(reader, f"{arch}.{key}")) is not None:
                hf[name] = value
        if "vocab_size" not in hf:
            hf["vocab_size"] = len(metadata(reader, "tokenizer.ggml.tokens", ()))
        if arch == "llama" and "head_dim" not in hf:
            hf["head_dim"] = metadata(reader, "llama.rope.dimension_count")
        if arch == "gemma2":  # not stored; llama.cpp's rule: 27B (46 layers) scales by
            # hidden / heads, the others by the head size
            per_head = hf["hidden_size"] // hf["num_attention_heads"]
            hf["query_pre_attn_scalar"] = (
                per_head if hf["num_hidden_layers"] == 46 else hf.get("head_dim", per_head)
            )
        for name, key in _TOKEN_IDS.items():
            if (value := metadata(reader, key)) is not None:
                hf[name] = value
        hf["tie_word_embeddings"] = all(t.name != "output.weight" for t in reader.tensors)
        return hf

    def shape(self, name: str) -> tuple[int, ...]:
        """The Hugging Face shape of tensor `name` (GGML lists dimensions innermost first);
        for the parts of a layer or table kept quantized, the shape of that field."""
        if name in self._kept_parts:
            weight, part = self._kept_parts[name]
            rows, n_in = self.shape(weight)
            scheme, group = KEPT_TYPES[self.tensors[weight].tensor_type.name]
            codes = n_in // 2 if scheme == "int4" else n_in
            entries = codes if part == "codes" else n_in // group
            return (rows, entries) if weight == _EMBEDDINGS else (entries, rows)
        return tuple(int(n) for n in reversed(self.tensors[name].shape))

    def _row_order(self, name: str) -> np.ndarray | None:
        """For Llama's query and key projections, the stored row of every Hugging Face row."""
        if self.architecture != "llama":
            return None
        heads = {"q_proj": "num_attention_heads", "k_proj": "num_key_value_heads"}
        projection = name.split(".")[-2]
        if projection not in heads:
            return None
        rows = self.shape(name)[0]
        count = self.hf_config[heads[projection]]
        return np.arange(rows).reshape(count, rows // count // 2, 2).swapaxes(1, 2).reshape(-1)

    def _stored_rows(self, name: str, rows: slice) -> np.ndarray:
        """The indices in the file of the Hugging Face rows `rows` of tensor `name`."""
        stored = np.arange(self.shape(name)[0])[rows]
        order = self._row_order(name)
        return stored if order is None else order[stored]

    def _read_kept(self, name: str, index: tuple) -> np.ndarray:
        """Block `index` of a field of a layer (`[inputs, outputs]`) or table (`[vocab,
        entries]`) kept quantized, straight from the stored blocks."""
        weight, part = self._kept_parts[name]
        tensor = self.tensors[weight]
        kind = tensor.tensor_type.name
        decode = int4_part if KEPT_TYPES[kind][0] == "int4" else int8_part
        if weight == _EMBEDDINGS:
            return decode(kind, np.asarray(tensor.data[index[0]]), part)[:, index[1]]
        raw = np.asarray(tensor.data[self._stored_rows(weight, index[1])])
        return decode(kind, raw, part).T[index[0]]

    def read(self, name: str, index: tuple) -> np.ndarray:
        """The float32 block `index` (a tuple of slices) of tensor `name` (for the parts
        of a layer kept quantized, the stored codes, scales or offsets).

        Only the rows asked for are dequantised: GGML blocks never cross a row.
        """
        from gguf import dequantize

        tensor = self.tensors[self._kept_parts.get(name, (name,))[0]]
        shape = self.shape(name)
        try:
            if name in self._kept_parts:
                return self._read_kept(name, index)
            if len(shape) == 1:
                block = dequantize(tensor.data, tensor.tensor_type).reshape(shape)[index]
            else:
                rows = self._stored_rows(name, index[0])
                block = dequantize(tensor.data[rows], tensor.tensor_type)
                block = block.reshape(len(rows), *shape[1:])[(slice(None), *index[1:])]
        except (ValueError, IndexError, OSError) as error:
            raise CheckpointError(
                f"{self.path}: cannot read tensor {tensor.name!r} ({error}); the file may be "
                "truncated or corrupt."
            ) from None
        block = np.asarray(block, np.float32)
        if self.architecture in _NORM_OFFSET and name.endswith("norm.weight"):
            block = block - np.float32(1)
        return block
