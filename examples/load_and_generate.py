"""Load a Hugging Face checkpoint and generate from it: greedy, sampled, streamed, and a
left-padded batch of prompts of different lengths.

    python examples/load_and_generate.py path/to/checkpoint --prompt "The river"
    python examples/load_and_generate.py   # writes a tiny random-weight Llama first

With a `tokenizer.json` in the checkpoint the prompts are text; without one they are
token ids.
"""

import argparse
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import eqdel
from eqdel.models import LlamaConfig, LlamaForCausalLM


def tiny_checkpoint(directory: Path) -> Path:
    """A random-weight Llama saved as a Hugging Face checkpoint."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    return eqdel.save_pretrained(LlamaForCausalLM(config, key=jax.random.key(0)), directory)


def encode_left_padded(prompts: list[list[int]], pad_id: int) -> tuple[jax.Array, jax.Array]:
    """`input_ids` and `attention_mask`, both `[batch, longest]`, padded on the left."""
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad_id, np.int32)
    mask = np.zeros((len(prompts), width), np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return jnp.asarray(ids), jnp.asarray(mask)


def main(model_dir: Path, prompt: str, max_new_tokens: int) -> None:
    model = eqdel.from_pretrained(model_dir, dtype=jnp.float32, progress=False)
    print(model)
    tokenizer_file = model_dir / "tokenizer.json"
    if tokenizer_file.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_file))
        encode, decode = (lambda text: tokenizer.encode(text).ids), tokenizer.decode
    else:
        encode = lambda text: [2 + ord(ch) % 250 for ch in text]  # noqa: E731
        decode = lambda ids: " ".join(map(str, ids))  # noqa: E731
    pad_id = model.config.pad_token_id or 0

    ids = jnp.asarray([encode(prompt)], jnp.int32)
    greedy = eqdel.generate(model, ids, max_new_tokens=max_new_tokens)
    print("greedy: ", decode(np.asarray(greedy[0, ids.shape[1] :]).tolist()))

    sampled = eqdel.generate(
        model,
        ids,
        max_new_tokens=max_new_tokens,
        do_sample=True,
        temperature=0.8,
        top_k=50,
        top_p=0.95,
        repetition_penalty=1.1,
        key=jax.random.key(0),
    )
    print("sampled:", decode(np.asarray(sampled[0, ids.shape[1] :]).tolist()))

    print("streamed:", end=" ", flush=True)
    for tokens in eqdel.stream_generate(model, ids, max_new_tokens=max_new_tokens):
        print(decode([int(tokens[0])]), end=" ", flush=True)  # one token per step
    print()

    prompts = [encode(prompt), encode(prompt + prompt)]
    batch, mask = encode_left_padded(prompts, pad_id)
    out = eqdel.generate(
        model, batch, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad_id
    )
    # Row 0 continues its prompt exactly as it did alone: padding changes nothing.
    print(
        "batched row 0 equals greedy:",
        bool(jnp.all(out[0, -max_new_tokens:] == greedy[0, -max_new_tokens:])),
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir", nargs="?", type=Path, help="Hugging Face checkpoint")
    parser.add_argument("--prompt", default="The river")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir or tiny_checkpoint(Path(tmp) / "tiny-llama")
        main(model_dir, args.prompt, args.max_new_tokens)
