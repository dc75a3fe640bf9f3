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
