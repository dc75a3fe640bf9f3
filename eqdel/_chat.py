"""Chat templates: a model's Jinja template turned into prompt text and ids, rendered as
transformers' `apply_chat_template` renders it."""

import dataclasses
import datetime
import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from .checkpoint._errors import CheckpointError
from .checkpoint._gguf import is_gguf, metadata, open_gguf

ROLES = ("system", "user", "assistant", "tool")
"""The message roles a conversation may hold."""

_GGUF_SPECIAL_IDS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
}


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
            sort_keys=sort_keys,
        )  # fmt: skip

    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return environment


def _check_messages(messages: Sequence[Mapping]) -> None:
    if not messages:
        raise ValueError("a conversation needs at least one message.")
    for number, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message:
            raise ValueError(f"message {number} is not a dict with a 'role': {message!r}.")
        if message["role"] not in ROLES:
            raise ValueError(
                f"message {number} has role {message['role']!r}; roles are {list(ROLES)}."
            )


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A model's chat template.

    **Fields:**

    - `source`: the Jinja template.
    - `special_tokens`: the text of `bos_token`, `eos_token`, ... that the template may use.
    """

    source: str
    special_tokens: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def render(
        self, messages: Sequence[Mapping], *, add_generation_prompt: bool = True, **variables
    ) -> str:
        """The prompt text of a conversation.

        **Arguments:**

        - `messages`: `[{"role": "user", "content": "..."}, ...]`, roles from `ROLES`.
        - `add_generation_prompt`: end with the start of an assistant turn.
        - `variables`: any further template variables (`tools=...`, ...).

        **Returns:**

        The text, exactly as transformers' `apply_chat_template(..., tokenize=False)`.
        """
        _check_messages(messages)
        template = _environment().from_string(self.source)
        return template.render(
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            **{**self.special_tokens, **variables},
        )

    def encode(
        self, tokenizer, messages: Sequence[Mapping], *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt ids of a conversation: `render` tokenized without adding special
        tokens (the template writes them), as transformers' `apply_chat_template`."""
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        return tokenizer.encode(text, add_special_tokens=False).ids


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _from_gguf(path: Path) -> ChatTemplate:
    reader = open_gguf(path)
    source = metadata(reader, "tokenizer.chat_template")
    if source is None:
        raise CheckpointError(f"{path}: no chat template (tokenizer.chat_template) in it.")
    tokens = metadata(reader, "tokenizer.ggml.tokens", [])
    special = {}
    for name, key in _GGUF_SPECIAL_IDS.items():
        token_id = metadata(reader, key)
        if token_id is not None and token_id < len(tokens):
            special[name] = tokens[token_id]
    return ChatTemplate(source, special)


def load_chat_template(path) -> ChatTemplate:
    """The chat template of a GGUF file (`tokenizer.chat_template` in its metadata) or a
    checkpoint directory (`chat_template.jinja`, else `chat_template` in
    `tokenizer_config.json`), with the special tokens it may refer to.

    **Raises:**

    `CheckpointError` naming the path when it has no chat template.
    """
    path = Path(path)
    if is_gguf(path):
        return _from_gguf(path)
    config_file = path / "tokenizer_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    special = {
        name: text
        for name in _GGUF_SPECIAL_IDS
        if (text := _token_text(config.get(name))) is not None
    }
    if (path / "chat_template.jinja").is_file():
        return ChatTemplate((path / "chat_template.jinja").read_text(), special)
    if isinstance(config.get("chat_template"), str):
        return ChatTemplate(config["chat_template"], special)
    raise CheckpointError(
        f"{path}: no chat template (chat_template.jinja or tokenizer_config.json's "
        "chat_template); is this a base model rather than an instruct model?"
    )
