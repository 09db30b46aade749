"""cost_models/quick_init.py: the faster __init__ makes the object the dataclass-generated one makes (defaults, default
factories, __post_init__, the same errors), replaced() what dataclasses.replace makes, and FsdpConfig.with_batch what
replace() of the micro-batch, accumulation and shard group makes, with the same checks."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from cost_models.quick_init import quick_init, replaced
from cost_models.specs import FsdpConfig, SpecError


def _point_class():
    @dataclass(frozen=True)
    class Point:
        x: int
        y: int = 2
        tags: list = field(default_factory=list)
        seen: tuple = ()

        def __post_init__(self):
            object.__setattr__(self, "seen", (self.x, self.y))

    return Point


def test_quick_init_makes_what_the_generated_init_makes():
    slow, fast = _point_class(), quick_init(_point_class())
    for args, kwargs in (((1,), {}), ((1, 5), {}), ((), {"x": 3, "tags": [1]}), ((4,), {"y": 0})):
        a, b = slow(*args, **kwargs), fast(*args, **kwargs)
        assert dataclasses.astuple(a) == dataclasses.astuple(b) and vars(a) == vars(b)
    assert fast(1).tags is not fast(1).tags  # a fresh default each time
    for bad in (lambda cls: cls(), lambda cls: cls(1, z=3), lambda cls: cls(1, 2, [], (), 5)):
        with pytest.raises(TypeError):
            bad(slow)
        with pytest.raises(TypeError):
            bad(fast)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast(1).x = 2


def test_quick_init_refuses_what_it_cannot_copy():
    @dataclass
    class Plain:
        x: int = 0

    with pytest.raises(TypeError, match="frozen"):
        quick_init(Plain)


def test_replaced_is_replace_without_post_init():
    @quick_init
    @dataclass(frozen=True)
    class Pair:
        a: int
        b: tuple = ()

    p = Pair(1, (2,))
    assert replaced(p, b=(3,)) == dataclasses.replace(p, b=(3,)) == Pair(1, (3,)) and p == Pair(1, (2,))
    with pytest.raises(TypeError, match="no field"):
        replaced(p, c=1)
    with pytest.raises(TypeError, match="__post_init__"):
        replaced(quick_init(_point_class())(1), x=2)  # its post-init derives a field: replace() it


def test_fsdp_config_with_batch_is_replace_of_the_batch_and_group():
    base = FsdpConfig(sharding="HYBRID_SHARD", precision="bf16", ac_every=2, tp=2, compile=True, async_tp=True,
                      micro_batch=1, grad_accum=8)
    for mb, accum, group in ((4, 2, 0), (1, 1, 16), (8, 3, 4)):
        new = base.with_batch(mb, accum, group)
        assert new == dataclasses.replace(base, micro_batch=mb, grad_accum=accum, shard_group_gpus=group)
        assert hash(new) == hash(dataclasses.replace(base, micro_batch=mb, grad_accum=accum, shard_group_gpus=group))
    for mb, accum, group, name in ((0, 1, 0, "micro_batch"), (1, -1, 0, "grad_accum"), (1, 1, 3, "shard_group_gpus")):
        with pytest.raises(SpecError) as err:
            base.with_batch(mb, accum, group)
        assert err.value.field == name
    with pytest.raises(SpecError, match="shard_group_gpus"):  # a group only HYBRID strategies size
        FsdpConfig().with_batch(1, 1, 16)


def test_fsdp_config_parses_and_normalises_as_before():
    """__post_init__ sets fields through the instance dict now: the spellings it reads and the errors it raises."""
    c = FsdpConfig(sharding="hybrid_shard", precision="bf16-pure", ac_every="selective-op", attention="eager",
                   attention_kernel="fa3", pp=4, pp_schedule="interleaved-1f1b", norm_kernel="liger")
    assert (c.sharding.value, c.precision.value, c.ac_every, c.selective_op_ac, c.attention_kernel.value,
            c.pp_stages_per_rank, c.norm_kernel.value, c.sequence_parallel) == (
        "HYBRID_SHARD", "bf16-pure", 0, True, "flash2", 2, "liger", True)
    assert FsdpConfig(ac_every="every-4") == FsdpConfig(ac_every=4)
    for kwargs, name in (({"sharding": "zero3"}, "sharding"), ({"ac_every": -1}, "activation_checkpointing"),
                         ({"tp": 0}, "tp"), ({"pp": True}, "pp"), ({"micro_batch": 0}, "micro_batch"),
                         ({"async_tp": True}, "async_tp"), ({"loss_kernel": "fused"}, "loss_kernel")):
        with pytest.raises(SpecError) as err:
            FsdpConfig(**kwargs)
        assert err.value.field == name
