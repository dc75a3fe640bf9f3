import jax

# Eight simulated host devices, set before any backend starts, so every test can build
# meshes such as (1, 2, 2, 2).
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_numpy_dtype_promotion", "strict")
jax.config.update("jax_numpy_rank_promotion", "raise")

import pytest  # noqa: E402


@pytest.fixture
def getkey():
    """A fresh PRNG key on every call."""
    keys = iter(jax.random.split(jax.random.key(0), 10_000))
    return lambda: next(keys)


@pytest.fixture(scope="session")
def smollm2_file():
    """SmolLM2-135M-Instruct's GGUF file, fetched once into the cache; a skip naming the
    reason when it is not cached and cannot be fetched."""
    from eqdel._smollm2 import smollm2_gguf

    try:
        return smollm2_gguf()
    except OSError as error:
        pytest.skip(f"SmolLM2 is not cached and cannot be fetched: {error}")
