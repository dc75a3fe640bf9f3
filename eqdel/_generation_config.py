"""`GenerationConfig`: the sampling controls of transformers, frozen."""

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class GenerationConfig:
    """How [`eqdel.generate`][] picks tokens. Field names and defaults follow transformers.

    - `max_new_tokens`: tokens to generate after the prompt.
    - `do_sample`: sample (`True`) or take the most likely token (`False`).
    - `temperature`: divides the logits before sampling; `0` means greedy.
    - `top_k`: keep the `k` most likely tokens (`0`: all).
    - `top_p`: keep the smallest set of tokens whose probability reaches `top_p`.
    - `min_p`: keep tokens with at least `min_p` times the top token's probability.
    - `repetition_penalty`: divides positive (multiplies negative) logits of tokens
        already in the sequence (`1.0`: off).
    - `eos_token_id`: one id or several; a row stops after emitting one.
    - `pad_token_id`: emitted by finished rows.
    """

    max_new_tokens: int = 20
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_id: int | Sequence[int] | None = ()
    pad_token_id: int | None = None

    def __post_init__(self):
        eos = self.eos_token_id
        if eos is None:
            eos = ()
        elif isinstance(eos, int):
            eos = (eos,)
        object.__setattr__(self, "eos_token_id", tuple(int(e) for e in eos))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, not {self.max_new_tokens}.")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, not {self.temperature}.")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, not {self.top_k}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], not {self.top_p}.")
        if not 0 <= self.min_p < 1:
            raise ValueError(f"min_p must be in [0, 1), not {self.min_p}.")
        if self.repetition_penalty <= 0:
            raise ValueError(
                f"repetition_penalty must be positive, not {self.repetition_penalty}."
            )

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature == 0

    @classmethod
    def from_model_config(cls, config, **overrides) -> "GenerationConfig":
        """Defaults for a model: the generation config it was loaded with, else its
        config's end and pad tokens."""
        if (loaded := getattr(config, "generation_config", None)) is not None:
            return dataclasses.replace(loaded, **overrides)
        values = dict(
            eos_token_id=getattr(config, "eos_token_id", None) or (),
            pad_token_id=getattr(config, "pad_token_id", None),
        )
        return cls(**{**values, **overrides})

    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> "GenerationConfig":
        """Read a transformers `generation_config.json` dict; unknown keys are ignored."""
        floats = {f.name for f in dataclasses.fields(cls) if isinstance(f.default, float)}
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in hf.items() if k in names and v is not None}
        values.update({k: float(v) for k, v in values.items() if k in floats})
        values.update(overrides)
        return cls(**values)

    def to_hf(self, bos_token_id: int | None = None) -> dict:
        """The transformers `generation_config.json` dict of this config: the fields that
        differ from the defaults (and `top_k` when sampling, whose default there is 50)."""
        hf = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != f.default or (f.name == "top_k" and self.do_sample)
        }
        eos = list(self.eos_token_id)
        hf["eos_token_id"] = eos[0] if len(eos) == 1 else (eos or None)
        if bos_token_id is not None:
            hf["bos_token_id"] = bos_token_id
        return {name: value for name, value in hf.items() if value is not None}

    @classmethod
    def from_pretrained(cls, path, **overrides) -> "GenerationConfig":
        """Read `generation_config.json` from a checkpoint directory (defaults if absent)."""
        file = Path(path) / "generation_config.json"
        hf = json.loads(file.read_text()) if file.is_file() else {}
        return cls.from_hf(hf, **overrides)
