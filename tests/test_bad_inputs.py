"""Bad inputs, one case each: every one raises an error that names the offending file,
tensor, argument or value, and leaves every file on disk as it was. docs/errors.md lists
the same cases with their messages."""

import re
import shutil
from functools import partial
from pathlib import Path

import equinox as eqx
import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file
from tiny import corpus_file, train_tokenizer

import eqdel
from eqdel.checkpoint import CheckpointError
from eqdel.models import LlamaConfig, LlamaForCausalLM
from eqdel.train import (
    NonFiniteError,
    causal_lm_loss,
    init_train_state,
    make_train_step,
    read_texts,
    restore_train_state,
    save_train_state,
)

CONFIG = LlamaConfig(
    vocab_size=300,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    eos_token_id=1,
)


class World:
    """A directory with a good checkpoint (and its tokenizer and chat template), a
    train-state checkpoint, a data file and a file that is not a directory."""

    def __init__(self, root: Path):
        self.root = root
        self.model = LlamaForCausalLM(CONFIG, key=jax.random.key(0))
        self.tokenizer = train_tokenizer(corpus_file().read_text().splitlines(), 300)
        self.template = eqdel.ChatTemplate(
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        )
        self.ckpt = eqdel.save_pretrained(
            self.model, root / "ckpt", tokenizer=self.tokenizer, chat_template=self.template
        )
        self.state = init_train_state(self.model, optax.sgd(0.1), jax.random.key(1))
        save_train_state(root / "train", self.state)
        self.data = root / "data.jsonl"
        self.data.write_text('{"text": "fine"}\n{"text": "also fine"\n')
        self.file = root / "notes.txt"
        self.file.write_text("mine")

    def copy(self, name: str) -> Path:
        """A copy of the good checkpoint to spoil (made before the snapshot)."""
        target = self.root / name
        target.mkdir()
        for file in self.ckpt.iterdir():
            (target / file.name).write_bytes(file.read_bytes())
        return target


def _rewrite_weights(path: Path, change) -> Path:
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _spoil(world: World, name: str, file: str, data: bytes | None = None, change=None):
    path = world.copy(name)
    if change is not None:
        return _rewrite_weights(path, change)
    if data is None:
        (path / file).unlink()
    else:
        (path / file).write_bytes(data)
    return path


def _gguf(world: World, name: str, architecture: str, keep: float = 1.0) -> Path:
    path = world.root / name
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((300, 16), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def _load(path, **kwargs):
    return eqdel.from_pretrained(path, progress=False, **kwargs)


def _generate(world: World, ids, mask=None, model=None):
    ids = jnp.asarray(ids, jnp.int32)
    mask = None if mask is None else jnp.asarray(mask, jnp.int32)
    eqdel.generate(model or world.model, ids, mask, max_new_tokens=3)


def _with_nan_norm(model):
    nan = jnp.full_like(model.model.norm.weight, jnp.nan)
    return eqx.tree_at(lambda m: m.model.norm.weight, model, nan)


def _nan_loss_step(world: World):
    model = _with_nan_norm(world.model)
    optimizer = optax.sgd(0.1)
    step = make_train_step(causal_lm_loss, optimizer)
    state = init_train_state(model, optimizer, jax.random.key(1))
    step(state, {"input_ids": jnp.ones((1, 8), jnp.int32)})


def _strict_placement(world: World):
    config = eqdel.ShardingConfig(axis_dims=(1, 1, 8, 1), strict=True)
    eqdel.shard(world.model, config)


def _weights_as_int(tensors):
    tensors["model.norm.weight"] = tensors["model.norm.weight"].astype(np.int32)


def _spoiled_load(name, file, data=None, change=None, **kwargs):
    """A case that loads a spoiled copy of the good checkpoint."""
    return lambda w: partial(_load, _spoil(w, name, file, data, change), **kwargs)


def _call(function, *args, **kwargs):
    """A case with nothing to prepare: `function(world-derived args)` is the call."""
    return lambda w: partial(function, *(a(w) if callable(a) else a for a in args), **kwargs)


def _overflow(tensors):
    tensors["model.norm.weight"][0] = 1e6


def _wrong_shape(tensors):
    tensors["model.norm.weight"] = np.zeros(7, np.float32)


def _extra(tensors):
    tensors["extra"] = np.zeros(2, np.float32)


def _drop(tensors):
    del tensors["model.norm.weight"]


def _other_optimizer(w):
    return init_train_state(w.model, optax.adamw(1e-3), jax.random.key(1))


# (case, make, exception, message pattern): `make(world)` prepares the input and returns
# the call that must fail. The pattern names the thing at fault.
CASES = [
    ("config.json missing", _spoiled_load("a", "config.json"),
     CheckpointError, r"a: no config\.json"),
    ("config.json not JSON", _spoiled_load("a", "config.json", b"{oops"),
     CheckpointError, r"a/config\.json: not valid JSON"),
    ("unknown model_type", _spoiled_load("a", "config.json", b'{"model_type": "bert"}'),
     CheckpointError, r"unknown model_type 'bert'; eqdel supports"),
    ("weight file missing", _spoiled_load("a", "model.safetensors"),
     CheckpointError, r"a: no model\.safetensors"),
    ("weight missing from the file", _spoiled_load("a", "", change=_drop),
     CheckpointError, r"a does not fit the model; missing weights: model\.norm\.weight"),
    ("unexpected weight in the file", _spoiled_load("a", "", change=_extra),
     CheckpointError, r"a does not fit the model; unexpected weights: extra"),
    ("weight of the wrong shape", _spoiled_load("a", "", change=_wrong_shape),
     CheckpointError, r"model\.norm\.weight: .*\(7,\).*\(16,\)"),
    ("weight stored as integers", _spoiled_load("a", "", change=_weights_as_int),
     CheckpointError, r"model\.norm\.weight is stored as int32"),
    ("truncated safetensors file",
     lambda w: partial(_load, _spoil(w, "a", "model.safetensors",
                                     (w.ckpt / "model.safetensors").read_bytes()[:-100])),
     CheckpointError, r"a/model\.safetensors"),
    ("corrupt safetensors header",
     _spoiled_load("a", "model.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{{{{"),
     CheckpointError, r"a/model\.safetensors"),
    ("index naming a missing shard",
     _spoiled_load("a", "model.safetensors.index.json",
                   b'{"weight_map": {"model.norm.weight": "gone.safetensors"}}'),
     CheckpointError, r"lists gone\.safetensors, which does not exist"),
    ("index that is not an index", _spoiled_load("a", "model.safetensors.index.json", b"[]"),
     CheckpointError, r"model\.safetensors\.index\.json: not a safetensors index"),
    ("integer dtype requested", _call(_load, lambda w: w.ckpt, dtype=jnp.int8),
     CheckpointError, r"dtype int8 cannot hold model weights"),
    ("weights that overflow float16", _spoiled_load("a", "", change=_overflow, dtype=jnp.float16),
     CheckpointError, r"model\.norm\.weight: values up to 1e\+06 overflow float16"),
    ("invalid generation_config.json",
     _spoiled_load("a", "generation_config.json", b'{"temperature": -1}'),
     CheckpointError, r"a/generation_config\.json: temperature must be >= 0"),
    ("GGUF file missing", _call(_load, lambda w: w.root / "none.gguf"),
     CheckpointError, r"none\.gguf: no such GGUF file"),
    ("file that is not GGUF",
     lambda w: partial(_load, _write(w.root / "text.gguf", b"hello world" * 10)),
     CheckpointError, r"text\.gguf: cannot read GGUF file"),
    ("truncated GGUF file", lambda w: partial(_load, _gguf(w, "cut.gguf", "llama", keep=0.5)),
     CheckpointError, r"cut\.gguf: cannot read GGUF file"),
    ("unknown GGUF architecture", lambda w: partial(_load, _gguf(w, "m.gguf", "mamba")),
     CheckpointError, r"GGUF architecture 'mamba' is not supported"),
    ("tokenizer missing",
     lambda w: partial(eqdel.load_tokenizer, _spoil(w, "a", "tokenizer.json")),
     CheckpointError, r"a: no tokenizer\.json"),
    ("chat template missing",
     lambda w: partial(eqdel.load_chat_template, _spoil(w, "a", "chat_template.jinja")),
     CheckpointError, r"a: no chat template"),
    ("chat message with an unknown role",
     lambda w: partial(w.template.render, [{"role": "wizard", "content": "hi"}]),
     ValueError, r"message 0 has role 'wizard'; roles are"),
    ("chat message without a role", lambda w: partial(w.template.render, [{"content": "hi"}]),
     ValueError, r"message 0 is not a dict with a 'role'"),
    ("empty conversation", lambda w: partial(w.template.render, []),
     ValueError, r"a conversation needs at least one message"),
    ("token id beyond the vocabulary", lambda w: partial(_generate, w, [[5, 300]]),
     ValueError, r"input_ids holds token 300, outside the vocabulary \[0, 300\)"),
    ("negative token id", lambda w: partial(_generate, w, [[-1, 5]]),
     ValueError, r"input_ids holds token -1"),
    ("empty prompt", lambda w: partial(_generate, w, np.zeros((1, 0), np.int32)),
     ValueError, r"at least one token, not \(1, 0\)"),
    ("prompt row that is all padding",
     lambda w: partial(_generate, w, [[5, 6], [7, 8]], [[1, 1], [0, 0]]),
     ValueError, r"prompt row 1 is all padding"),
    ("non-finite logits while generating",
     lambda w: partial(_generate, w, [[5, 6]], model=_with_nan_norm(w.model)),
     Exception, r"logits hold NaN or inf"),
    ("invalid sampling setting",
     lambda w: partial(eqdel.generate, w.model, jnp.ones((1, 2), jnp.int32), top_p=2.0),
     ValueError, r"top_p must be in \(0, 1\], not 2\.0"),
    ("sharding that does not divide", lambda w: partial(_strict_placement, w),
     ValueError, r"not divisible by 8"),
    ("mesh larger than the devices",
     lambda w: lambda: eqdel.ShardingConfig(axis_dims=(1, 16, 1, 1)).mesh(),
     ValueError, r"16"),
    ("NaN in the loss", lambda w: partial(_nan_loss_step, w),
     NonFiniteError, r"non-finite loss \(nan\)"),
    ("train state of another structure",
     _call(restore_train_state, lambda w: w.root / "train", _other_optimizer),
     ValueError, r"train/0: the checkpoint does not match the state; missing: opt_state"),
    ("data line that is not JSON", _call(read_texts, lambda w: w.data),
     ValueError, r"data\.jsonl:2: not a JSON record"),
    ("data record without the field", _call(read_texts, lambda w: w.data, field="prompt"),
     ValueError, r"data\.jsonl:1: record has no 'prompt' field"),
    ("shard size not positive",
     _call(eqdel.save_pretrained, lambda w: w.model, lambda w: w.ckpt, max_shard_size=-5),
     ValueError, r"max_shard_size -5 must be a positive number of bytes"),
    ("shard size that is not a size",
     _call(eqdel.save_pretrained, lambda w: w.model, lambda w: w.ckpt, max_shard_size="lots"),
     ValueError, r"max_shard_size 'lots' is not a size"),
    ("save to a path that is a file",
     _call(eqdel.save_pretrained, lambda w: w.model, lambda w: w.file),
     NotADirectoryError, r"notes\.txt is a file"),
    ("chat template without its tokenizer",
     lambda w: partial(eqdel.save_pretrained, w.model, w.ckpt, chat_template=w.template),
     ValueError, r"a chat template is saved with its tokenizer"),
    ("quantization to unsupported bits", _call(eqdel.quantize, lambda w: w.model, bits=3),
     ValueError, r"bits must be 8 \(int8\) or 4 \(NF4 or int4\), not 3"),
    ("adapters saved from a model without any",
     _call(eqdel.save_lora, lambda w: w.model, lambda w: w.root / "adapter"),
     ValueError, r"The model has no LoRA adapters to save"),
]  # fmt: skip


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _snapshot(root: Path) -> dict:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() else None
        for p in sorted(root.rglob("*"))
    }


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return World(tmp_path_factory.mktemp("world"))


_SPOILED = ("a", "cut.gguf", "m.gguf", "text.gguf")


@pytest.mark.parametrize(("case", "make", "error", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_named_and_changes_nothing(world, case, make, error, message):
    try:
        call = make(world)
        before = _snapshot(world.root)
        with pytest.raises(error, match=message):
            call()
        assert _snapshot(world.root) == before
    finally:
        for name in _SPOILED:
            target = world.root / name
            if target.is_dir():
                shutil.rmtree(target)
            elif target.exists():
                target.unlink()


def test_battery_is_large_and_documented():
    assert len(CASES) >= 30
    table = (Path(__file__).parents[1] / "docs" / "errors.md").read_text()
    documented = re.findall(r"^\| ([^|]+?) \|", table, re.MULTILINE)[1:]
    assert documented == [case for case, *_ in CASES]
