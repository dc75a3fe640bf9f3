"""GGUF files (llama.cpp's format): the Hugging Face config a file's metadata describes, and
its tensors dequantised under their Hugging Face names.

llama.cpp's converter renames every tensor (`blk.0.attn_q.weight` for
`model.layers.0.self_attn.q_proj.weight`), permutes the rows of Llama's query and key
projections (its rotary kernel pairs neighbouring dimensions, Hugging Face pairs the two
halves of a head) and stores Gemma's norms as `1 + weight`. Reading undoes all three, so
a GGUF loads through the same path as a safetensors checkpoint.
"""

from pathlib import Path

import numpy as np

from ._errors import CheckpointError

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

INT4_BLOCK_TYPES = {"Q4_0": 18, "Q4_1": 20}
"""GGML types kept as int4 codes by `from_pretrained(..., keep_quantized=True)`, with
the bytes of each of their blocks: 32 inputs of one output, a float16 scale `d` (and,
for Q4_1, a float16 offset `m`), then 16 bytes of codes `q` from 0 to 15, byte `k`
holding inputs `k` and `k + 16`. The weights are `q * d + m` (Q4_1) or `(q - 8) * d`
(Q4_0)."""
INT4_GROUP = 32
Q8_0_BLOCK = 34
"""Bytes of a Q8_0 block: 32 entries of a row, a float16 scale `d`, then 32 int8 codes
`q`; the entries are `q * d`. Linear layers and token embeddings stored so are kept as
int8 codes by `from_pretrained(..., keep_quantized=True)`."""
Q8_0_GROUP = 32
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


def open_gguf(path: Path):
    """A `gguf.GGUFReader` over `path` (memory-mapped; nothing is read yet).

    **Raises:**

    `CheckpointError` naming the file when it is missing, truncated or not a GGUF file.
    """
    import gguf

    if not path.is_file():
        raise CheckpointError(f"{path}: no such GGUF file.")
    try:
        return gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError, KeyError) as error:
        raise CheckpointError(
            f"{path}: cannot read GGUF file ({error}); it may be truncated or corrupt."
        ) from None


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


def _float16s(pairs: np.ndarray) -> np.ndarray:
    """Float16 numbers stored as pairs of bytes (the last dimension), as float32."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)


class GGUFCheckpoint:
    """A GGUF file seen as a Hugging Face checkpoint: `hf_config` is its config.json, and
    `shape` / `read` give its tensors (dequantised to float32, llama.cpp's changes undone)
    under Hugging Face names, a slice at a time.

    **Arguments:**

    - `path`: the `.gguf` file.
    - `keep_quantized`: whether the decoder's linear layers stored as Q4_0 / Q4_1 in
        every layer (`int4_modules`) are read as the `codes`, `scales` and `offsets` of
        an `eqdel.Int4Linear` with groups of 32 rather than as a float `weight`, those
        stored as Q8_0 in every layer (`int8_modules`) as the `codes` and `scales` of an
        `eqdel.Int8Linear` with groups of 32, and token embeddings stored as Q8_0 as the
        `codes` and `scales` of an `eqdel.Int8Embedding` with groups of 32
        (`embedding_group`).

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
        self.int4_modules = self._modules_stored_as(INT4_BLOCK_TYPES) if keep_quantized else []
        self.int8_modules = self._modules_stored_as({"Q8_0"}) if keep_quantized else []
        self._int4_parts = self._layer_parts(self.int4_modules, ("codes", "scales", "offsets"))
        self._int8_parts = self._layer_parts(self.int8_modules, ("codes", "scales"))
        embeddings = self.tensors.get(_EMBEDDINGS)
        q8_0 = keep_quantized and embeddings is not None and embeddings.tensor_type.name == "Q8_0"
        self.embedding_group = Q8_0_GROUP if q8_0 else None
        self._embedding_parts = {
            f"model.embed_tokens.{part}": (_EMBEDDINGS, part)
            for part in (("codes", "scales") if q8_0 else ())
        }
        self._kept_parts = self._int4_parts | self._int8_parts | self._embedding_parts
        self.names -= {name for name, _ in self._kept_parts.values()}
        self.names |= set(self._kept_parts)

    def _modules_stored_as(self, types) -> list[str]:
        """The decoder's linear layers (by field name, e.g. `q_proj`) stored in blocks of
        one of `types` in every layer."""
        kinds: dict[str, set[bool]] = {}
        for name, tensor in self.tensors.items():
            if name.startswith("model.layers.") and name.endswith(".weight"):
                module = name.split(".")[-2]
                kept = tensor.tensor_type.name in types and len(tensor.shape) == 2
                kinds.setdefault(module, set()).add(kept)
        return sorted(module for module, kind in kinds.items() if kind == {True})

    def _layer_parts(self, modules: list[str], parts: tuple[str, ...]) -> dict:
        """`{layer field name: (the stored weight's name, the field)}` for the fields
        `parts` of every layer's `modules`."""
        return {
            f"{name.removesuffix('.weight')}.{part}": (name, part)
            for name in self.tensors
            if name.startswith("model.layers.") and name.split(".")[-2] in modules
            for part in parts
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
        for the parts of a layer kept as int4, the shape of that `Int4Linear` field."""
        if name in self._int4_parts:
            weight, part = self._int4_parts[name]
            n_out, n_in = self.shape(weight)
            return (n_in // 2 if part == "codes" else n_in // INT4_GROUP, n_out)
        if name in self._int8_parts:
            weight, part = self._int8_parts[name]
            n_out, n_in = self.shape(weight)
            return (n_in if part == "codes" else n_in // Q8_0_GROUP, n_out)
        if name in self._embedding_parts:
            vocab, embed = self.shape(_EMBEDDINGS)
            return (vocab, embed if name.endswith("codes") else embed // Q8_0_GROUP)
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

    def _read_int4(self, name: str, index: tuple) -> np.ndarray:
        """Block `index` of an `Int4Linear` field (`[inputs, outputs]` layout) straight
        from the stored Q4_0 / Q4_1 blocks, with no float round trip for the codes."""
        weight, part = self._int4_parts[name]
        tensor = self.tensors[weight]
        kind = tensor.tensor_type.name
        raw = np.asarray(tensor.data[self._stored_rows(weight, index[1])])
        blocks = raw.reshape(len(raw), -1, INT4_BLOCK_TYPES[kind])
        if part == "codes":
            value = blocks[..., -16:].reshape(len(raw), -1)
        else:
            scales = _float16s(blocks[..., 0:2])
            value = (
                scales
                if part == "scales"
                else (_float16s(blocks[..., 2:4]) if kind == "Q4_1" else -8 * scales)
            )
        return value.T[index[0]]

    def _read_q8_0(self, weight: str, part: str, rows: np.ndarray | slice) -> np.ndarray:
        """The int8 codes (`[rows, entries]`) or float16 scales (`[rows, blocks]`) of
        rows `rows` of `weight`, straight from its stored Q8_0 blocks."""
        raw = np.asarray(self.tensors[weight].data[rows])
        blocks = raw.reshape(len(raw), -1, Q8_0_BLOCK)
        if part == "codes":
            return blocks[..., 2:].copy().view(np.int8).reshape(len(raw), -1)
        return _float16s(blocks[..., 0:2])

    def read(self, name: str, index: tuple) -> np.ndarray:
        """The float32 block `index` (a tuple of slices) of tensor `name` (for the parts
        of a layer kept quantized, the stored codes, scales or offsets).

        Only the rows asked for are dequantised: GGML blocks never cross a row.
        """
        from gguf import dequantize

        tensor = self.tensors[self._kept_parts.get(name, (name,))[0]]
        shape = self.shape(name)
        try:
            if name in self._int4_parts:
                return self._read_int4(name, index)
            if name in self._int8_parts:  # an `Int8Linear` field, `[inputs, outputs]`
                weight, part = self._int8_parts[name]
                rows = self._stored_rows(weight, index[1])
                return self._read_q8_0(weight, part, rows).T[index[0]]
            if name in self._embedding_parts:
                part = self._embedding_parts[name][1]
                return self._read_q8_0(_EMBEDDINGS, part, index[0])[:, index[1]]
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
