import dataclasses

import jax
import pytest
from jax.sharding import AxisType

import eqdel
from eqdel import axes


def test_minus_one_absorbs_remaining_devices():
    cfg = eqdel.ShardingConfig(axis_dims=(2, -1, 2, 1))
    mesh = cfg.mesh()
    assert dict(mesh.shape) == {"dp": 2, "fsdp": 2, "tp": 2, "sp": 1}
    assert mesh.axis_types == (AxisType.Auto,) * 4
    assert sorted(d.id for d in mesh.devices.flat) == list(range(8))


def test_strings_are_parsed_strictly():
    cfg = eqdel.ShardingConfig(axis_dims="1, -1,1,1", axis_names="dp,fsdp,tp,sp")
    assert cfg.axis_dims == (1, -1, 1, 1) and cfg.axis_names == ("dp", "fsdp", "tp", "sp")
    for bad in ("1,-1,1,1; import os", "(1,-1,1,1)", "1,,2", "__import__('os')"):
        with pytest.raises(ValueError, match="not a comma-separated list of integers"):
            eqdel.ShardingConfig(axis_dims=bad)
    with pytest.raises(ValueError, match="not a comma-separated list of names"):
        eqdel.ShardingConfig(axis_names="dp,fsdp;tp,sp")


def test_config_is_frozen_and_hashable():
    cfg = eqdel.ShardingConfig(axis_dims=(1, 2, 2, 2))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.strict = True
    assert hash(cfg) == hash(eqdel.ShardingConfig(axis_dims=[1, 2, 2, 2]))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"axis_dims": (1, -1, 1)}, "has 3 entries but axis_names"),
        ({"axis_dims": (-1, -1, 1, 1)}, "more than one -1"),
        ({"axis_dims": (1, 0, 1, 1)}, "invalid size 0"),
        ({"axis_dims": (1, -2, 1, 1)}, "invalid size -2"),
        ({"axis_names": ("dp", "dp", "tp", "sp")}, "repeats a name"),
        ({"parameter_rules": {axes.EMBED: ("model",)}}, "mesh axis 'model', which is not one"),
        ({"activation_rules": {"embed": ("tp",)}}, "'embed', which is not a semantic axis"),
        ({"mode_rules": {"decode": {}}}, "unknown mode 'decode'"),
    ],
)
def test_bad_configs_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        eqdel.ShardingConfig(**kwargs)


@pytest.mark.parametrize(
    ("dims", "message"),
    [
        ((3, -1, 1, 1), r"needs a multiple of 3 devices; found 8"),
        ((2, 2, 1, 1), r"needs 4 devices; found 8"),
    ],
)
def test_mesh_must_fit_the_device_count(dims, message):
    with pytest.raises(ValueError, match=message):
        eqdel.ShardingConfig(axis_dims=dims).mesh()


def test_user_rules_override_defaults():
    cfg = eqdel.ShardingConfig(
        axis_dims=(1, 2, 4, 1),
        parameter_rules={axes.VOCAB: ("fsdp",), axes.EMBED: None},
        mode_rules={axes.MODE_DECODE: {axes.KV_LENGTH: ()}},
    )
    assert cfg.rules()[axes.VOCAB] == ("fsdp",)
    assert cfg.rules()[axes.EMBED] == ()
    assert cfg.rules(axes.MODE_DECODE, "activation")[axes.KV_LENGTH] == ()
    assert cfg.rules(axes.MODE_TRAIN, "activation")[axes.KV_LENGTH] == ("sp",)


def test_config_does_not_touch_devices_until_asked(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("devices queried at construction")

    monkeypatch.setattr(jax, "devices", fail)
    eqdel.ShardingConfig(axis_dims=(1, -1, 1, 1))
