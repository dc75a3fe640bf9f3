"""Bad checkpoints raise errors that name the problem; failed saves lose nothing."""

import json
import os
from pathlib import Path

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


def _assert_holds(path, model):
    """The checkpoint at `path` loads back as exactly `model`."""
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(_load(path))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


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
    _assert_holds(path, model)


def _snapshot(root):
    """Every path under `root` with its bytes (files), link target or `None` (dirs)."""
    found = {}
    for p in sorted(root.rglob("*")):
        if p.is_symlink():
            found[p.relative_to(root)] = ("link", os.readlink(p))
        elif p.is_file():
            found[p.relative_to(root)] = p.read_bytes()
        else:
            found[p.relative_to(root)] = None
    return found


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ("lots", r"max_shard_size 'lots' is not a size"),
        (True, r"max_shard_size True is not a size"),
        (-5, r"max_shard_size -5 must be a positive number of bytes"),
        (0, r"max_shard_size 0 must be a positive"),
        ("0GB", r"max_shard_size '0GB' must be a positive"),
    ],
)
def test_bad_shard_size_writes_nothing(checkpoint, size, message):
    path, model = checkpoint
    before = _snapshot(path.parent)
    with pytest.raises(ValueError, match=message):
        eqdel.save_pretrained(model, path, max_shard_size=size)
    assert _snapshot(path.parent) == before


def test_save_to_a_file_or_read_only_directory_writes_nothing(checkpoint, monkeypatch):
    path, model = checkpoint
    file = path.parent / "weights.bin"
    file.write_bytes(b"mine")
    before = _snapshot(path.parent)
    with pytest.raises(NotADirectoryError, match=r"weights\.bin is a file"):
        eqdel.save_pretrained(model, file)
    # A directory this user may not write (simulated: the superuser may write anywhere).
    access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != path and access(p, mode))
    with pytest.raises(PermissionError, match=r"ckpt is not writable; nothing was saved"):
        eqdel.save_pretrained(model, path)
    with pytest.raises(PermissionError, match=r"ckpt is not writable; nothing was saved"):
        eqdel.save_pretrained(model, path / "inner")
    assert _snapshot(path.parent) == before


def test_save_into_a_used_directory_replaces_only_its_own_files(tmp_path, getkey):
    path = tmp_path / "ckpt"
    old = LlamaForCausalLM(CONFIG, key=getkey())
    eqdel.save_pretrained(old, path, max_shard_size="4KB")
    shards = sorted(p.name for p in path.glob("model-*.safetensors"))
    assert len(shards) > 2
    mine = {
        "README.md": b"# my fine-tune\n",
        "tokenizer.json": b"{}",
        "special_tokens_map.json": b"{}",
        "notes/run1.txt": b"lr 1e-4",
        "pytorch_model.bin": b"not ours",
    }
    for name, data in mine.items():
        (path / name).parent.mkdir(exist_ok=True)
        (path / name).write_bytes(data)
    (path / "latest").symlink_to("notes/run1.txt")
    path.chmod(0o750)
    inode = (path / "README.md").stat().st_ino

    new = LlamaForCausalLM(CONFIG, key=getkey())
    eqdel.save_pretrained(new, path)

    names = {str(p.relative_to(path)) for p in path.rglob("*")}
    assert names == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "notes",
        "latest",
        *mine,
    }  # stale shards and their index are gone; the user's files stay
    for name, data in mine.items():
        assert (path / name).read_bytes() == data
    assert os.readlink(path / "latest") == "notes/run1.txt"
    assert (path / "README.md").stat().st_ino == inode  # the same file, not a copy
    assert path.stat().st_mode & 0o777 == 0o750
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging left behind
    _assert_holds(path, new)


def test_generation_config_travels_with_the_model(tmp_path, getkey):
    path = tmp_path / "ckpt"
    eqdel.save_pretrained(LlamaForCausalLM(CONFIG, key=getkey()), path)
    settings = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "eos_token_id": [2, 7]}
    (path / "generation_config.json").write_text(json.dumps(settings))
    model = _load(path)
    loaded = eqdel.GenerationConfig.from_model_config(model.config)
    assert (loaded.do_sample, loaded.temperature, loaded.top_p) == (True, 0.6, 0.9)
    assert loaded.eos_token_id == (2, 7)
    saved = json.loads(
        (eqdel.save_pretrained(model, tmp_path / "copy") / "generation_config.json").read_text()
    )
    assert {k: saved[k] for k in settings} == settings
    (path / "generation_config.json").write_text(json.dumps({"top_p": 3.0}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: top_p must be in"):
        _load(path)


def test_save_without_an_atomic_swap_still_keeps_other_files(checkpoint, monkeypatch, getkey):
    import eqdel.checkpoint._replace as replace_module

    path, _ = checkpoint
    (path / "README.md").write_text("notes")
    monkeypatch.setattr(replace_module, "_exchange", lambda new, target: False)
    new = LlamaForCausalLM(CONFIG, key=getkey())
    eqdel.save_pretrained(new, path)
    assert (path / "README.md").read_text() == "notes"
    assert [p.name for p in path.parent.iterdir()] == ["ckpt"]
    _assert_holds(path, new)


def test_save_through_a_link_writes_where_it_points(checkpoint, getkey):
    path, _ = checkpoint
    link = path.parent / "latest"
    link.symlink_to(path.name)
    new = LlamaForCausalLM(CONFIG, key=getkey())
    assert eqdel.save_pretrained(new, link) == path
    assert link.is_symlink()
    _assert_holds(path, new)


def test_a_save_killed_between_two_renames_is_put_right_by_the_next(checkpoint, getkey):
    path, _ = checkpoint
    (path / "README.md").write_text("notes")
    # Where directories cannot be swapped, a kill between the two renames leaves the old
    # checkpoint beside the missing target.
    path.rename(path.with_name(".ckpt.eqdel-save-0123456789ab.old"))
    (path.parent / ".ckpt.eqdel-save-ba9876543210").mkdir()  # an unfinished save
    new = LlamaForCausalLM(CONFIG, key=getkey())
    eqdel.save_pretrained(new, path)
    assert (path / "README.md").read_text() == "notes"
    assert [p.name for p in path.parent.iterdir()] == ["ckpt"]
    _assert_holds(path, new)
