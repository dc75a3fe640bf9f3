"""llama.cpp's quantized blocks read as eqdel's integer codes, scales and offsets, with
no float round trip for the codes.

Every block covers consecutive entries of one row. Each reader takes the raw bytes of
some rows (`[rows, bytes per row]`) and the part wanted, and returns it with one entry
per row:

- int4 types (`Int4Linear`, groups of 32, `w = q * scale + offset`): `codes`
    `[rows, entries / 2]` packed as `Int4Linear` packs them (in every group of 32, byte
    `k` holds entry `k` in its low four bits and entry `k + 16` in its high four),
    `scales` and `offsets` `[rows, groups]`;
- int8 types (`Int8Linear` / `Int8Embedding`, `w = q * scale`): `codes`
    `[rows, entries]` and `scales` `[rows, groups]`.

The scales and offsets are float32 and exactly what llama.cpp multiplies by (a float16
scale times a sub-block's integer scale is exact in float32), so the codes times them
give `gguf.dequantize`'s weights bit for bit.
"""

import numpy as np

KEPT_TYPES = {
    "Q4_0": ("int4", 32),
    "Q4_1": ("int4", 32),
    "Q4_K": ("int4", 32),
    "Q5_0": ("int8", 32),
    "Q8_0": ("int8", 32),
    "Q6_K": ("int8", 16),
}
"""GGML tensor types that `from_pretrained(..., keep_quantized=True)` keeps as codes:
type → (eqdel scheme, entries per scale)."""

_BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q5_0": 22, "Q8_0": 34, "Q6_K": 210}


def _float16s(pairs: np.ndarray) -> np.ndarray:
    """Float16 numbers stored as pairs of bytes (the last dimension), as float32."""
    return pairs.copy().view(np.float16)[..., 0].astype(np.float32)


def _blocks(kind: str, raw: np.ndarray) -> np.ndarray:
    """`[rows, bytes]` → `[rows, blocks, bytes per block]`."""
    return raw.reshape(len(raw), -1, _BLOCK_BYTES[kind])


def _q4_k_scales_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minima of a Q4_K block from its 12 bytes: bytes 0-3 hold
    the low six bits of scales 0-3, bytes 4-7 those of minima 0-3, and bytes 8-11 the
    low four bits of scales 4-7 (low nibble) and minima 4-7 (high nibble), whose top two
    bits are the top two bits of bytes 0-3 and 4-7."""
    low_scales, low_mins, high = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low_scales & 63, (high & 15) | ((low_scales >> 2) & 48)], axis=-1)
    mins = np.concatenate([low_mins & 63, (high >> 4) | ((low_mins >> 2) & 48)], axis=-1)
    return scales, mins


def _int4_from_chunks(chunks: np.ndarray) -> np.ndarray:
    """Codes stored as Q4_K stores them, 32 bytes per 64 entries (byte `i` holds entry
    `i` low and entry `i + 32` high), repacked as `Int4Linear` packs groups of 32."""
    low, high = chunks[..., :16], chunks[..., 16:]
    first = (low & 15) | (high << 4)  # entries 0-15 and 16-31
    second = (low >> 4) | (high & 240)  # entries 32-47 and 48-63
    return np.stack([first, second], axis=-2)


def int4_part(kind: str, raw: np.ndarray, part: str) -> np.ndarray:
    """The `Int4Linear` `codes`, `scales` or `offsets` (`part`) of rows stored as Q4_0,
    Q4_1 or Q4_K."""
    blocks = _blocks(kind, raw)
    rows = len(raw)
    if kind != "Q4_K":
        if part == "codes":
            return blocks[..., -16:].reshape(rows, -1)
        scales = _float16s(blocks[..., 0:2])
        if part == "scales":
            return scales
        return _float16s(blocks[..., 2:4]) if kind == "Q4_1" else -8 * scales
    if part == "codes":
        return _int4_from_chunks(blocks[..., 16:].reshape(rows, -1, 4, 32)).reshape(rows, -1)
    scales, mins = _q4_k_scales_mins(blocks[..., 4:16])
    if part == "scales":
        return (_float16s(blocks[..., 0:2])[..., None] * scales).reshape(rows, -1)
    return -(_float16s(blocks[..., 2:4])[..., None] * mins).reshape(rows, -1)


def int8_part(kind: str, raw: np.ndarray, part: str) -> np.ndarray:
    """The int8 `codes` or `scales` (`part`) of rows stored as Q8_0, Q5_0 or Q6_K."""
    blocks = _blocks(kind, raw)
    rows = len(raw)
    if part == "scales":
        if kind != "Q6_K":
            return _float16s(blocks[..., 0:2])
        sub_scales = blocks[..., 192:208].copy().view(np.int8).astype(np.float32)
        return (_float16s(blocks[..., 208:210])[..., None] * sub_scales).reshape(rows, -1)
    if kind == "Q8_0":
        return blocks[..., 2:].copy().view(np.int8).reshape(rows, -1)
    if kind == "Q5_0":  # a float16 scale, the fifth bits of 32 entries, then 16 bytes of
        # four bits as Q4_0 packs them; the codes run from -16 to 15
        fifth = np.unpackbits(blocks[..., 2:6], axis=-1, bitorder="little")
        nibbles = blocks[..., 6:]
        low = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
        return ((low | (fifth << 4)).astype(np.int8) - 16).reshape(rows, -1)
    # Q6_K: 128 bytes of low four bits, 64 of high two bits, 16 int8 scales (one per 16
    # entries) and a float16 scale; each half of 128 entries takes 64 low bytes (entries
    # i and i + 64) and 32 high bytes (entries i, i + 32, i + 64, i + 96)
    low = blocks[..., :128].reshape(rows, -1, 2, 64)
    high = blocks[..., 128:192].reshape(rows, -1, 2, 1, 32)
    low = np.concatenate([low & 15, low >> 4], axis=-1)
    high = (high >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    return ((low | (high.reshape(low.shape) << 4)).astype(np.int8) - 32).reshape(rows, -1)
