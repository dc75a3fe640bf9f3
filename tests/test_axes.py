import pytest
from jax.sharding import PartitionSpec as P

import eqdel
from eqdel import axes

CFG = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
CFG_EP = eqdel.ShardingConfig(
    axis_dims=(1, 2, 2, 1, 2), axis_names=("dp", "fsdp", "tp", "sp", "ep")
)


@pytest.mark.parametrize(
    ("preset", "shape", "expected"),
    [
        (axes.HiddenStateSharding, (4, 8, 16), P(("dp", "fsdp"), "sp", "tp")),
        (axes.HiddenStateSharding, (4, 1, 16), P(("dp", "fsdp"), None, "tp")),
        (axes.AttnQSharding, (4, 8, 4, 8), P(("dp", "fsdp"), "sp", "tp", None)),
        (axes.AttnQSharding, (4, 1, 4, 8), P(("dp", "fsdp"), None, "tp", None)),
        (axes.AttnKVSharding, (4, 8, 2, 8), P(("dp", "fsdp"), "sp", "tp", None)),
        (axes.RowWise, (8, 8), P("tp", ("fsdp", "sp"))),
        (axes.SRowWise, (8,), P("tp")),
        (axes.ColumnWise, (8, 8), P(("fsdp", "sp"), "tp")),
        (axes.SColumnWise, (8,), P(("fsdp", "sp"))),
        (axes.Replicated, (8,), P(None)),
        (axes.ExpertActivationsAlt, (4, 8, 16), P("dp", "sp", ("tp", "fsdp"))),
    ],
)
def test_presets(preset, shape, expected):
    assert CFG.resolve(preset, shape=shape) == expected


@pytest.mark.parametrize(
    ("preset", "shape", "expected"),
    [
        (axes.ExpertColumnWise, (4, 8, 8), P("ep", "fsdp", "tp")),
        (axes.ExpertRowWise, (4, 8, 8), P("ep", "tp", "fsdp")),
        (axes.ExpertColumnWiseAlt, (4, 8, 8), P("ep", ("fsdp", "sp"), "tp")),
        (axes.ExpertRowWiseAlt, (4, 8, 8), P("ep", "tp", ("fsdp", "sp"))),
        (axes.UnifiedExpertColumnWise, (8, 8, 8), P(("fsdp", "sp", "ep"), None, "tp")),
        (axes.UnifiedExpertRowWise, (8, 8, 8), P(("fsdp", "sp", "ep"), "tp", None)),
        (axes.ExpertActivations, (4, 8, 4, 8), P("dp", "sp", "ep", "tp")),
    ],
)
def test_expert_presets(preset, shape, expected):
    assert CFG_EP.resolve(preset, shape=shape) == expected


def test_expert_token_without_ep_axis_is_unsharded():
    assert CFG.resolve(axes.ExpertColumnWise, shape=(4, 8, 8)) == P(None, "fsdp", "tp")


def test_semantic_axes_per_table_and_mode():
    names = (axes.BATCH, axes.LENGTH, axes.EMBED)
    assert CFG.resolve(names, axes.MODE_TRAIN, (8, 16, 64)) == P(("dp", "fsdp"), "sp", "tp")
    assert CFG.resolve(names, axes.MODE_TRAIN, (8, 16, 64), kind="parameter") == P(
        ("dp", "fsdp"), "sp", None
    )
    assert CFG.resolve(names, axes.MODE_DECODE, (8, 1, 64)) == P(("dp", "fsdp"), None, "tp")
    weight = (axes.EMBED, axes.HEAD)
    assert CFG.resolve(weight, kind="parameter") == P(("fsdp", "sp"), "tp")


def test_decode_keeps_the_cache_length_on_sp():
    kv = (axes.BATCH, axes.KV_LENGTH, axes.KV_HEAD, axes.KV_HEAD_DIM)
    assert CFG.resolve(kv, axes.MODE_DECODE, (4, 16, 2, 8)) == P(("dp", "fsdp"), "sp", "tp", None)


def test_integer_mode_reads_the_shape():
    names = (axes.BATCH, axes.QUERY_LENGTH, axes.EMBED)
    assert CFG.resolve(names, 1, (8, 1, 64)) == P(("dp", "fsdp"), None, "tp")
    assert CFG.resolve(names, 1, (8, 4, 64)) == P(("dp", "fsdp"), "sp", "tp")
    with pytest.raises(ValueError, match="needs the shape"):
        CFG.resolve(names, 1)


def test_mesh_axis_used_once_per_spec():
    assert CFG.resolve((axes.FSDP, (axes.FSDP, axes.TP))) == P("fsdp", "tp")
    assert CFG.resolve((axes.EMBED, axes.EMBED), kind="parameter") == P(("fsdp", "sp"), None)


def test_non_divisible_dimension_is_replicated_or_raises():
    spec, fallbacks = CFG.resolve_with_fallbacks((axes.VOCAB, axes.EMBED), shape=(7, 8))
    assert spec == P(None, "tp")
    assert len(fallbacks) == 1 and fallbacks[0].dim == 0 and fallbacks[0].mesh_axes == ("tp",)
    strict = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2), strict=True)
    with pytest.raises(ValueError, match=r"w: dim 0 \(size 7\) not divisible by 2"):
        strict.resolve_with_fallbacks((axes.VOCAB, axes.EMBED), shape=(7, 8), where="w")


def test_axes_count_must_match_shape():
    with pytest.raises(ValueError, match="name 2 dimensions but the shape"):
        CFG.resolve((axes.EMBED, axes.HEAD), shape=(8,))


def test_unknown_axis_name_is_rejected():
    with pytest.raises(ValueError, match="'heads' is neither a semantic axis"):
        CFG.resolve(("heads",))


def test_sentinel_and_constants():
    assert axes.NOT_GIVEN is type(axes.NOT_GIVEN)()
    assert not axes.NOT_GIVEN and axes.NOT_GIVEN is not None
    assert axes.DEFAULT_MASK_VALUE < -1e38
    assert {axes.MODE_DECODE, axes.MODE_INSERT} == axes.GENERATION_MODES
    assert axes.DP == axes.DATA_PARALLEL and axes.FSDP == axes.FULLY_SHARDED_DATA_PARALLEL
    assert axes.TP == axes.TENSOR_PARALLEL and axes.EP == axes.EXPERT_PARALLEL
    assert axes.SP == axes.SEQUENCE_PARALLEL
    for name in axes.__all__:
        assert hasattr(axes, name), name
