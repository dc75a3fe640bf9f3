"""Reading rotary settings from both Hugging Face config.json layouts."""

from collections.abc import Mapping


def read_rope(hf: Mapping) -> tuple[float, str, dict]:
    """`(rope_theta, rope_type, parameters)` from either layout.

    The newer layout has `rope_parameters: {rope_type, rope_theta, ...}`; the older one has
    a top-level `rope_theta` and an optional `rope_scaling: {type | rope_type, ...}`.
    """
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "su":  # the older name of longrope
        rope_type = "longrope"
    return float(theta), rope_type, params


def write_rope(theta: float, rope_type: str, parameters: Mapping) -> dict:
    """The config.json keys for rotary settings, in the newer layout plus the older
    top-level `rope_theta` (read by both generations of transformers)."""
    rope = {"rope_type": rope_type, "rope_theta": theta, **parameters}
    return {"rope_theta": theta, "rope_parameters": rope}
