"""Bad checkpoints raise errors that name the problem; failed saves lose nothing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import eqdel
from eqdel.checkpoint import CheckpointError
from eqdel.models import LlamaConfig, LlamaForCausalLM

CONFIG = LlamaConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
)


@pytest.fixture
def checkpoint(tmp_path, getkey):
    model = LlamaForCausalLM(CONFIG, key=getkey())
    return eqdel.save_pretrained(model, tmp_path / "ckpt"), model


def _rewrite(path, change):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _load(path, **kwargs):
    return eqdel.from_pretrained(path, progress=False, **kwargs)


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match=r"no config.json"):
        _load(tmp_path)


def test_unknown_model_type(checkpoint):
    path, _ = checkpoint
    (path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(CheckpointError, match=r"unknown model_type 'bert'; eqdel supports \["):
        _load(path)


def test_missing_weights(checkpoint):
    path, _ = checkpoint
    _rewrite(path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing weights: model\.layers\.1\.mlp\.up_proj"):
        _load(path)


def test_unexpected_weights(checkpoint):
    path, _ = checkpoint
    _rewrite(path, lambda t: t.update(extra_head=np.zeros(3, np.float32)))
    with pytest.raises(CheckpointError, match=r"unexpected weights: extra_head"):
        _load(path)


def test_shape_mismatch_names_tensor_and_shapes(checkpoint):
    path, _ = checkpoint
    _rewrite(path, lambda t: t.update({"model.norm.weight": np.ones(15, np.float32)}))
    with pytest.raises(
        CheckpointError,
        match=r"model\.norm\.weight: checkpoint shape \(15,\) but the model expects \(16,\)",
    ):
        _load(path)


def test_truncated_file(checkpoint):
    path, _ = checkpoint
    file = path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read"):
        _load(path)


def test_corrupt_header(checkpoint):
    path, _ = checkpoint
    file = path / "model.safetensors"
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match=r"truncated or corrupt"):
        _load(path)


def test_index_lists_missing_file(checkpoint):
    path, model = checkpoint
    eqdel.save_pretrained(model, path, max_shard_size="4KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    lost = sorted(set(index["weight_map"].values()))[1]
    (path / lost).unlink()
    with pytest.raises(CheckpointError, match=rf"lists {lost}, which does not exist"):
        _load(path)


def test_dtype_that_cannot_hold_weights(checkpoint):
    path, _ = checkpoint
    with pytest.raises(CheckpointError, match=r"dtype int8 cannot hold model weights"):
        _load(path, dtype=jnp.int8)
    _rewrite(path, lambda t: t["model.norm.weight"].__setitem__(0, 1e6))
    with pytest.raises(
        CheckpointError, match=r"model\.norm\.weight: values up to 1e\+06 overflow float16"
    ):
        _load(path, dtype=jnp.float16)
    loaded = _load(path, dtype=jnp.bfloat16)
    assert loaded.model.norm.weight.dtype == jnp.bfloat16


def test_failed_save_keeps_previous_checkpoint(checkpoint, monkeypatch, getkey):
    path, model = checkpoint
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    import eqdel.checkpoint._save as save_module

    calls = []

    def failing_save(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError("disk full")
        return save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(save_module, "save_file", failing_save)
    other = LlamaForCausalLM(CONFIG, key=getkey())
    with pytest.raises(OSError, match="disk full"):
        eqdel.save_pretrained(other, path, max_shard_size="4KB")
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert [p.name for p in path.parent.iterdir()] == ["ckpt"]  # no staging left behind
    again = _load(path)
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bad_shard_size(checkpoint):
    path, model = checkpoint
    with pytest.raises(ValueError, match=r"max_shard_size 'lots' is not a size"):
        eqdel.save_pretrained(model, path, max_shard_size="lots")
