"""GGUF files written here from tiny random transformers models, the way llama.cpp's
converter writes them (its names, its query/key row permutation for Llama, Gemma's
`1 + weight` norms): eqdel loads them to the transformers logits, and refuses bad files by
name."""

import warnings

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from hf_reference import hf_logits, make_hf_model, random_ids
from tiny import corpus_file, train_tokenizer

import eqdel
from eqdel.checkpoint import CheckpointError
from eqdel.nn import Linear

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA2_LAYER_NAMES = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _gguf_name(name: str, architecture: str) -> str:
    for hf, ours in {"model.embed_tokens": "token_embd", "model.norm": "output_norm"}.items():
        if name.startswith(hf + "."):
            return ours + name[len(hf) :]
    if name.startswith("lm_head."):
        return "output" + name[len("lm_head") :]
    _, _, layer, rest = name.split(".", 3)
    module, suffix = rest.rsplit(".", 1)
    names = {**_LAYER_NAMES, **(_GEMMA2_LAYER_NAMES if architecture == "gemma2" else {})}
    return f"blk.{layer}.{names[module]}.{suffix}"


def _llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    rows = weight.shape[0]
    return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _q4_k(rows: np.ndarray) -> np.ndarray:
    """Q4_K blocks of `rows` (entries a multiple of 256): per 32 entries a 6-bit scale
    and minimum times the block's float16 `d` and `dmin`, codes from 0 to 15."""
    x = rows.reshape(-1, 8, 32).astype(np.float32)
    low = np.minimum(x.min(-1), 0)
    step = (x.max(-1) - low) / 15
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = ((-low).max(-1) / 63).astype(np.float16)
    sc = np.rint(step / np.maximum(d.astype(np.float32), 1e-30)[:, None]).astype(np.uint8)
    mins = np.rint(-low / np.maximum(dmin.astype(np.float32), 1e-30)[:, None]).astype(np.uint8)
    scale = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mins
    q = np.rint((x + offset[..., None]) / np.maximum(scale, 1e-30)[..., None])
    q = np.clip(q, 0, 15).astype(np.uint8).reshape(-1, 4, 2, 32)
    packed_scales = np.concatenate(
        [
            (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6),
            (mins[:, :4] & 63) | ((mins[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 15) | ((mins[:, 4:] & 15) << 4),
        ],
        axis=-1,
    )
    codes = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    halves = [a.view(np.uint8).reshape(-1, 2) for a in (d, dmin)]
    return np.concatenate([*halves, packed_scales, codes], axis=-1)


def _q6_k(rows: np.ndarray) -> np.ndarray:
    """Q6_K blocks of `rows` (entries a multiple of 256): per 16 entries an int8 scale
    times the block's float16 `d`, codes from -32 to 31 stored plus 32."""
    x = rows.reshape(-1, 16, 16).astype(np.float32)
    step = np.abs(x).max(-1) / 31
    d = (step.max(-1) / 127).astype(np.float16)
    sc = np.rint(step / np.maximum(d.astype(np.float32), 1e-30)[:, None]).astype(np.int8)
    scale = d.astype(np.float32)[:, None] * sc
    q = np.rint(x / np.where(scale == 0, 1, scale)[..., None])
    q = (np.clip(q, -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    low = (q & 15).reshape(-1, 2, 2, 64)
    low = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    high = q >> 4
    high = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [low, high.reshape(-1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(-1, 2)], axis=-1
    )


def stored_as(array: np.ndarray, kind: str) -> np.ndarray:
    """`array`'s rows as GGML blocks of type `kind` (bytes), as a converter stores them."""
    encode = {"Q4_K": _q4_k, "Q6_K": _q6_k}.get(kind)
    if encode is None:
        return gguf.quantize(array, gguf.GGMLQuantizationType[kind])
    return encode(array).reshape(array.shape[0], -1)


K_QUANT_SIZES = dict(hidden_size=256, intermediate_size=512)
"""A tiny model whose rows split into the K-quants' blocks of 256."""


def write_gguf(
    hf_model, path, architecture: str, tensor_type: str = "F32", types=None, **metadata
):
    """Write `hf_model` as llama.cpp would; 2-D weights stored as `tensor_type`, or as
    `types[name]` for the GGUF tensor names in `types`."""
    config = hf_model.config
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    head_dim = (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    writer.add_key_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    if architecture == "gemma2":
        writer.add_float32("gemma2.attn_logit_softcapping", config.attn_logit_softcapping)
        writer.add_float32("gemma2.final_logit_softcapping", config.final_logit_softcapping)
        writer.add_uint32("gemma2.attention.sliding_window", config.sliding_window)
    for key, value in metadata.items():
        writer.add_key_value(key, *value)
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        array = tensor.detach().numpy().astype(np.float32)
        if architecture in ("gemma", "gemma2") and name.endswith("norm.weight"):
            array = array + 1
        if architecture == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = config.num_attention_heads if "q_proj" in name else config.num_key_value_heads
            array = _llama_cpp_permute(array, heads)
        stored_name = _gguf_name(name, architecture)
        kind = (types or {}).get(stored_name, tensor_type if array.ndim == 2 else "F32")
        kind = gguf.GGMLQuantizationType[kind]
        stored = array if kind.name == "F32" else stored_as(array, kind.name)
        writer.add_tensor(stored_name, stored, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("architecture", ["llama", "qwen2", "phi3", "gemma", "gemma2"])
def test_float_gguf_loads_to_the_transformers_logits(architecture, tmp_path):
    overrides = {
        "phi3": {"pad_token_id": 0},
        "gemma": {"head_dim": 8},
        "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8},
    }.get(architecture, {})
    hf_model = make_hf_model(architecture, **overrides)
    path = write_gguf(hf_model, tmp_path / "model.gguf", architecture)
    model = eqdel.from_pretrained(path, progress=False)
    ids = random_ids(2, 16)
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids)).logits), hf_logits(hf_model, ids), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize(
    "tensor_type", ["F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q6_K"]
)
def test_quantized_gguf_loads_the_dequantised_weights(tensor_type, tmp_path):
    """Each 2-D weight is what `gguf.dequantize` gives for the stored blocks, so the model
    computes what transformers computes with those dequantised weights."""
    hf_model = make_hf_model("llama", **K_QUANT_SIZES)
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", tensor_type)
    kind = gguf.GGMLQuantizationType[tensor_type]

    def as_read(t):
        return gguf.dequantize(stored_as(t.numpy(), tensor_type), kind) if t.ndim == 2 else t

    state = {name: as_read(t) for name, t in hf_model.state_dict().items()}
    hf_model.load_state_dict({name: torch.as_tensor(a) for name, a in state.items()})
    model = eqdel.from_pretrained(path, progress=False)
    ids = random_ids(2, 16)
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids)).logits), hf_logits(hf_model, ids), atol=1e-5, rtol=0
    )


def _check_kept(kept, float_model, path, tmp_path):
    """Checks a GGUF model loaded with `keep_quantized=True` against its float load, and
    returns it loaded again sharded."""
    # The stored codes unchanged: dequantised, every weight is the float load's exactly.
    for a, b in zip(jax.tree.leaves(eqdel.dequantize(kept)), jax.tree.leaves(float_model)):
        np.testing.assert_array_equal(a, b)
    ids = jnp.asarray(random_ids(2, 16))
    np.testing.assert_allclose(kept(ids).logits, float_model(ids).logits, atol=1e-5, rtol=0)
    eqdel.save_pretrained(kept, tmp_path / "saved")
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.from_pretrained(path, sharding=cfg, progress=False, keep_quantized=True)
    for again in (sharded, eqdel.from_pretrained(tmp_path / "saved", progress=False)):
        for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(kept), strict=True):
            assert a.dtype == b.dtype
            np.testing.assert_array_equal(a, b)
    return sharded


@pytest.mark.parametrize("tensor_type", ["Q4_0", "Q4_1", "Q4_K"])
def test_q4_blocks_kept_quantized_compute_the_dequantised_model(tensor_type, tmp_path):
    hf_model = make_hf_model("llama", **K_QUANT_SIZES)
    # One layer's value projection in Q8_0: no layer's value projection stays int4.
    types = {"blk.1.attn_v.weight": "Q8_0"}
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", tensor_type, types)
    float_model = eqdel.from_pretrained(path, progress=False)
    kept = eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    attention = kept.model.layers.self_attn
    assert isinstance(attention.q_proj, eqdel.Int4Linear) and attention.q_proj.group_size == 32
    assert attention.q_proj.codes.dtype == jnp.uint8
    assert isinstance(attention.v_proj, Linear)
    sharded = _check_kept(kept, float_model, path, tmp_path)
    assert sharded.model.layers.self_attn.q_proj.codes.sharding.spec != (None, None, None)


@pytest.mark.parametrize("tensor_type, group", [("Q8_0", 32), ("Q5_0", 32), ("Q6_K", 16)])
def test_int8_blocks_kept_quantized_compute_the_dequantised_model(tensor_type, group, tmp_path):
    """A Q8_0, Q5_0 or Q6_K file of a tied model kept as int8: the linear layers and the
    token embeddings (which the head reads too) hold the stored codes and scales, and the
    model computes what the float load does."""
    hf_model = make_hf_model("llama", tie_word_embeddings=True, **K_QUANT_SIZES)
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", tensor_type)
    float_model = eqdel.from_pretrained(path, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept = eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    table = kept.model.embed_tokens
    assert isinstance(table, eqdel.Int8Embedding) and table.group_size == group
    assert table.codes.dtype == jnp.int8 and kept.lm_head is None
    layer = kept.model.layers
    for linear in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(linear, eqdel.Int8Linear) and linear.group_size == group
        assert linear.codes.dtype == jnp.int8
        assert linear.scales.shape == (2, linear.codes.shape[1] // group, linear.codes.shape[2])
    sharded = _check_kept(kept, float_model, path, tmp_path)
    assert sharded.model.layers.mlp.down_proj.codes.sharding.spec != (None, None, None)


def test_q4_and_q8_0_layers_kept_side_by_side(tmp_path):
    """A Q4_1 file whose value projections are Q8_0 in every layer keeps both: int4 and
    int8 layers in one model, computing what the float load does. Saving it names the
    mix."""
    hf_model = make_hf_model("llama")
    types = {f"blk.{i}.attn_v.weight": "Q8_0" for i in range(2)}
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", "Q4_1", types)
    float_model = eqdel.from_pretrained(path, progress=False)
    kept = eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    attention = kept.model.layers.self_attn
    assert isinstance(attention.q_proj, eqdel.Int4Linear)
    assert isinstance(attention.v_proj, eqdel.Int8Linear) and attention.v_proj.group_size == 32
    for a, b in zip(jax.tree.leaves(eqdel.dequantize(kept)), jax.tree.leaves(float_model)):
        np.testing.assert_array_equal(a, b)
    ids = jnp.asarray(random_ids(2, 16))
    np.testing.assert_allclose(kept(ids).logits, float_model(ids).logits, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="mixes quantizations"):
        eqdel.save_pretrained(kept, tmp_path / "saved")


def test_k_quant_mix_keeps_each_layer_that_one_type_holds(tmp_path):
    """A file mixed as llama.cpp's Q4_K_M mixes: Q4_K layers, value projections in Q6_K,
    down projections Q6_K in one layer and Q4_K in the other, Q6_K token embeddings and
    head. Each kind kept holds the stored blocks; the mixed one loads as float."""
    hf_model = make_hf_model("llama", **K_QUANT_SIZES)
    types = {
        "blk.0.attn_v.weight": "Q6_K",
        "blk.1.attn_v.weight": "Q6_K",
        "blk.0.ffn_down.weight": "Q6_K",
        "token_embd.weight": "Q6_K",
        "output.weight": "Q6_K",
    }
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", "Q4_K", types)
    float_model = eqdel.from_pretrained(path, progress=False)
    kept = eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    layer = kept.model.layers
    assert isinstance(layer.self_attn.q_proj, eqdel.Int4Linear)
    assert isinstance(layer.mlp.gate_proj, eqdel.Int4Linear)
    assert isinstance(layer.self_attn.v_proj, eqdel.Int8Linear)
    assert layer.self_attn.v_proj.group_size == 16
    assert isinstance(layer.mlp.down_proj, Linear)
    assert isinstance(kept.model.embed_tokens, eqdel.Int8Embedding)
    assert isinstance(kept.lm_head, eqdel.Int8Linear) and kept.lm_head.group_size == 16
    for a, b in zip(jax.tree.leaves(eqdel.dequantize(kept)), jax.tree.leaves(float_model)):
        np.testing.assert_array_equal(a, b)
    ids = jnp.asarray(random_ids(2, 16))
    np.testing.assert_allclose(kept(ids).logits, float_model(ids).logits, atol=1e-5, rtol=0)
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    sharded = eqdel.from_pretrained(path, sharding=cfg, progress=False, keep_quantized=True)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(kept), strict=True):
        np.testing.assert_array_equal(a, b)


def test_keep_quantized_without_kept_blocks_warns_or_is_refused(tmp_path):
    hf_model = make_hf_model("llama")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", "F16")
    with pytest.warns(UserWarning, match="model.gguf stores no linear layer"):
        model = eqdel.from_pretrained(path, progress=False, keep_quantized=True)
    assert isinstance(model.model.layers.self_attn.q_proj, Linear)
    assert isinstance(model.model.embed_tokens, eqdel.nn.Embedding)
    eqdel.save_pretrained(model, tmp_path / "saved")
    with pytest.raises(CheckpointError, match="keep_quantized applies to GGUF files"):
        eqdel.from_pretrained(tmp_path / "saved", progress=False, keep_quantized=True)


def test_sharded_gguf_load_equals_one_device(tmp_path):
    hf_model = make_hf_model("llama")
    path = write_gguf(hf_model, tmp_path / "model.gguf", "llama", "Q8_0")
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    single = eqdel.from_pretrained(path, progress=False)
    sharded = eqdel.from_pretrained(path, sharding=cfg, progress=False)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert sharded.model.layers.self_attn.q_proj.weight.sharding.spec != (None, None, None)


def _tokenizer_metadata(tokenizer) -> dict:
    import json

    model = json.loads(tokenizer.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    kinds = [3 if token in ("<s>", "</s>") else 1 for token in tokens]
    types = gguf.GGUFValueType
    return {
        "tokenizer.ggml.model": ("gpt2", types.STRING),
        "tokenizer.ggml.pre": ("gpt2", types.STRING),
        "tokenizer.ggml.tokens": (tokens, types.ARRAY, types.STRING),
        "tokenizer.ggml.merges": (merges, types.ARRAY, types.STRING),
        "tokenizer.ggml.token_type": (kinds, types.ARRAY, types.INT32),
        "tokenizer.ggml.bos_token_id": (0, types.UINT32),
        "tokenizer.ggml.eos_token_id": (1, types.UINT32),
        "tokenizer.chat_template": (
            "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}",
            types.STRING,
        ),
    }


def test_gguf_tokenizer_and_chat_template(tmp_path):
    texts = corpus_file().read_text().splitlines()
    tokenizer = train_tokenizer(texts, 300)
    hf_model = make_hf_model("llama", vocab_size=tokenizer.get_vocab_size())
    path = write_gguf(hf_model, tmp_path / "m.gguf", "llama", **_tokenizer_metadata(tokenizer))
    ours = eqdel.load_tokenizer(path)
    text = " ".join(texts[:5]) + " <s> unusual wørds 42"
    assert ours.encode(text).ids == tokenizer.encode(text).ids
    assert ours.decode(ours.encode(text).ids) == tokenizer.decode(tokenizer.encode(text).ids)

    template = eqdel.load_chat_template(path)
    assert template.special_tokens == {"bos_token": "<s>", "eos_token": "</s>"}
    messages = [{"role": "user", "content": "The river"}]
    assert template.render(messages) == "<s>user: The river</s><s>assistant: "
    ids = template.encode(ours, messages)
    assert ids[0] == 0 and ids.count(1) == 1  # the special tokens are single ids

    out = eqdel.save_pretrained(
        eqdel.from_pretrained(path, progress=False),
        tmp_path / "hf",
        tokenizer=ours,
        chat_template=template,
    )
    assert eqdel.load_chat_template(out).render(messages) == template.render(messages)
    assert eqdel.load_tokenizer(out).encode(text).ids == ours.encode(text).ids


def test_unknown_architecture_is_named(tmp_path):
    path = write_gguf(make_hf_model("llama"), tmp_path / "m.gguf", "llama")
    data = path.read_bytes().replace(b"llama", b"mamba", 1)
    (tmp_path / "mamba.gguf").write_bytes(data)
    with pytest.raises(CheckpointError, match="GGUF architecture 'mamba' is not supported"):
        eqdel.from_pretrained(tmp_path / "mamba.gguf", progress=False)


def test_unread_tensor_type_is_named(tmp_path):
    hf_model = make_hf_model("llama")
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "llama")
    kind = gguf.GGMLQuantizationType.IQ4_NL
    block, size = gguf.GGML_QUANT_SIZES[kind]
    weight = hf_model.model.embed_tokens.weight
    raw = np.zeros((weight.shape[0], weight.shape[1] // block * size), np.uint8)
    writer.add_tensor("token_embd.weight", raw, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(CheckpointError, match=r"'token_embd\.weight' is stored as IQ4_NL"):
        eqdel.from_pretrained(tmp_path / "m.gguf", progress=False)


def test_truncated_gguf_is_named(tmp_path):
    path = write_gguf(make_hf_model("llama"), tmp_path / "m.gguf", "llama")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated or corrupt"):
        eqdel.from_pretrained(tmp_path / "cut.gguf", progress=False)
    with pytest.raises(CheckpointError, match="no such GGUF file"):
        eqdel.from_pretrained(tmp_path / "missing.gguf", progress=False)


def test_gguf_without_tokenizer_or_template_is_named(tmp_path):
    path = write_gguf(make_hf_model("llama"), tmp_path / "m.gguf", "llama")
    with pytest.raises(CheckpointError, match=r"m\.gguf: GGUF tokenizer model None"):
        eqdel.load_tokenizer(path)
    with pytest.raises(CheckpointError, match=r"m\.gguf: no chat template"):
        eqdel.load_chat_template(path)


def test_readers_kept_parse_a_file_once_while_it_is_unchanged(tmp_path):
    from eqdel.checkpoint._gguf import open_gguf, readers_kept

    path = write_gguf(make_hf_model("llama"), tmp_path / "m.gguf", "llama")
    assert open_gguf(path) is not open_gguf(path)  # outside the block, parsed every time
    with readers_kept():
        first = open_gguf(path)
        assert open_gguf(path) is first
        with readers_kept():  # nested: the same readers
            assert open_gguf(tmp_path / "." / "m.gguf") is first
        write_gguf(make_hf_model("llama", seed=1), path, "llama", tensor_type="F16")
        again = open_gguf(path)
        assert again is not first and open_gguf(path) is again
        loaded = eqdel.from_pretrained(path, progress=False)
    expected = eqdel.from_pretrained(path, progress=False)
    ids = jnp.asarray(random_ids(1, 8))
    np.testing.assert_array_equal(loaded(ids).logits, expected(ids).logits)
