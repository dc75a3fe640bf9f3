"""Tokenizers: a checkpoint's `tokenizer.json`, or the vocabulary in a GGUF file's metadata,
as a `tokenizers.Tokenizer`."""

import json
from pathlib import Path

from .checkpoint._errors import CheckpointError
from .checkpoint._gguf import is_gguf, metadata, open_gguf

_SPLIT_PATTERNS = {
    "llama-bpe": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
"""llama.cpp's pre-tokenizer name → the split pattern applied before byte-level BPE."""
_SPLIT_PATTERNS["llama3"] = _SPLIT_PATTERNS["llama-bpe"]

_GPT2_PRE_TOKENIZERS = ("default", "gpt2", "smollm")
"""Pre-tokenizers that are GPT-2's own regex (SmolLM's vocabulary has no multi-digit
tokens, so its digit split changes nothing)."""

_CONTROL, _USER_DEFINED = 3, 4  # GGUF token types of special and added tokens


def _gguf_pre_tokenizer(pre: str | None, path: Path):
    from tokenizers import Regex, pre_tokenizers

    if pre is None or pre in _GPT2_PRE_TOKENIZERS:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _SPLIT_PATTERNS:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_PATTERNS[pre]), "isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    known = sorted([*_GPT2_PRE_TOKENIZERS, *_SPLIT_PATTERNS])
    raise CheckpointError(
        f"{path}: GGUF pre-tokenizer {pre!r} is not read; eqdel reads {known}. Put the "
        "model's tokenizer.json beside it and load that instead."
    )


def _gguf_tokenizer(path: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    reader = open_gguf(path)
    kind = metadata(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(
            f"{path}: GGUF tokenizer model {kind!r} is not read (eqdel reads byte-level BPE, "
            "'gpt2'); put the model's tokenizer.json beside it and load that instead."
        )
    tokens = metadata(reader, "tokenizer.ggml.tokens")
    merges = [tuple(merge.split(" ", 1)) for merge in metadata(reader, "tokenizer.ggml.merges")]
    kinds = metadata(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    tokenizer = Tokenizer(
        models.BPE({token: i for i, token in enumerate(tokens)}, merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = _gguf_pre_tokenizer(metadata(reader, "tokenizer.ggml.pre"), path)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, kinds) if k == _CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, k in zip(tokens, kinds) if k == _USER_DEFINED]
    )
    bos = metadata(reader, "tokenizer.ggml.bos_token_id")
    if metadata(reader, "tokenizer.ggml.add_bos_token", False) and bos is not None:
        start = tokens[bos]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{start} $A", pair=f"{start} $A $B", special_tokens=[(start, bos)]
        )
    return tokenizer


def load_tokenizer(path):
    """The tokenizer of a checkpoint directory (its `tokenizer.json`) or a GGUF file (built
    from the vocabulary, merges and special tokens in its metadata, as transformers builds
    it from the same file).

    **Arguments:**

    - `path`: a checkpoint directory or a `.gguf` file.

    **Returns:**

    A `tokenizers.Tokenizer`; `encode(text).ids` gives the ids the model was trained on.

    **Raises:**

    `CheckpointError` naming the path when it holds no tokenizer eqdel reads.
    """
    from tokenizers import Tokenizer

    path = Path(path)
    if is_gguf(path):
        return _gguf_tokenizer(path)
    file = path / "tokenizer.json"
    if not file.is_file():
        raise CheckpointError(f"{path}: no tokenizer.json (nor a GGUF file) to tokenize with.")
    return Tokenizer.from_file(str(file))


def special_tokens(tokenizer, config) -> dict[str, str]:
    """The text of the model's special tokens, `{"bos_token": ..., "eos_token": ...,
    "pad_token": ...}`, from the ids in its config (the first end id when it has several)."""
    names = {}
    for name in ("bos_token", "eos_token", "pad_token"):
        token_id = getattr(config, f"{name}_id", None)
        if isinstance(token_id, tuple | list):
            token_id = token_id[0] if token_id else None
        if token_id is not None and (token := tokenizer.id_to_token(token_id)) is not None:
            names[name] = token
    return names


def save_tokenizer(tokenizer, config, directory: Path, chat_template: str | None = None):
    """Write `tokenizer.json`, a `tokenizer_config.json` naming the special tokens, and the
    chat template as `chat_template.jinja`, so that `transformers.AutoTokenizer` loads them.

    **Arguments:**

    - `tokenizer`: a `tokenizers.Tokenizer`.
    - `config`: the model config whose token ids name the special tokens.
    - `directory`: where to write.
    - `chat_template`: the template source, if the model has one.
    """
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **special_tokens(tokenizer, config),
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template)
