"""The main job of `eqdel demo`: a tiny Llama saved, loaded sharded, and run."""

import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from ._explain import explain_sharding
from ._sharding_config import ShardingConfig
from .checkpoint import from_pretrained, save_pretrained
from .models import LlamaConfig, LlamaForCausalLM

TINY_LLAMA = LlamaConfig(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
"""The embedded default model: a random-weight Llama small enough for any CPU."""


def run_demo(cfg: ShardingConfig, workdir: Path | None = None) -> float:
    """Build the tiny Llama, save it as a Hugging Face checkpoint, load it onto the mesh
    of `cfg`, print where every parameter went and compare sharded with single-device
    logits.

    **Returns:**

    The largest absolute difference between sharded and single-device logits.
    """
    model = LlamaForCausalLM(TINY_LLAMA, key=jax.random.key(0))
    print(model)
    with tempfile.TemporaryDirectory(dir=workdir) as tmp:
        path = save_pretrained(model, Path(tmp) / "tiny-llama")
        print(f"saved a Hugging Face checkpoint: {sorted(p.name for p in path.iterdir())}")
        sharded = from_pretrained(path, sharding=cfg, progress=False)
    print(explain_sharding(sharded, cfg))

    ids = jax.random.randint(jax.random.key(1), (4, 64), 0, TINY_LLAMA.vocab_size)
    forward = jax.jit(lambda m, i: m(i).logits)
    start = time.perf_counter()
    logits = forward(sharded, ids).block_until_ready()
    compiled = time.perf_counter() - start
    start = time.perf_counter()
    forward(sharded, ids).block_until_ready()
    seconds = time.perf_counter() - start
    difference = float(jnp.max(jnp.abs(logits - forward(model, ids))))
    print(
        f"logits {logits.shape}: compile+run {compiled:.2f} s, run {seconds * 1e3:.1f} ms "
        f"({ids.size / seconds:,.0f} tokens/s); max |sharded - single device| = "
        f"{difference:.2e}"
    )
    print(f"greedy next tokens: {np.asarray(jnp.argmax(logits[:, -1], axis=-1)).tolist()}")
    return difference
