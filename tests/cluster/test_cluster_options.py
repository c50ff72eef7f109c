"""The ``ray`` engine's sharding and its option errors; nothing here starts Ray."""

from __future__ import annotations

import pytest

import anchor_rl.cluster.engine  # noqa: F401  (registers the engine)
from anchor_rl.cluster.engine import shard_by_group
from anchor_rl.rollout.engine import make_engine
from anchor_rl.trainer.config import ConfigError, load_config


def test_every_group_lands_on_one_worker_and_the_loads_balance() -> None:
    groups = [0] * 4 + [1] * 4 + [2] * 8 + [3] * 2 + [4] * 2
    shards = shard_by_group(groups, 2)
    assert sorted(i for s in shards for i in s) == list(range(len(groups)))  # each row once
    assert all(s == sorted(s) for s in shards)  # request order within a shard
    owner = {g: w for w, s in enumerate(shards) for g in {groups[i] for i in s}}
    assert len(owner) == 5 and all(
        {groups[i] for i in s} == {g for g, w in owner.items() if w == k}
        for k, s in enumerate(shards)
    )
    assert [len(s) for s in shards] == [10, 10]  # 8 | 4 + 4, then 2 and 2 each to the lighter


def test_sharding_is_deterministic_and_leaves_extra_workers_idle() -> None:
    groups = [3, 3, 1, 1, 2, 2]  # group ids need not be ordered or start at 0
    assert shard_by_group(groups, 4) == [[0, 1], [2, 3], [4, 5], []]
    assert shard_by_group(groups, 4) == shard_by_group(list(groups), 4)
    assert shard_by_group(groups, 1) == [[0, 1, 2, 3, 4, 5]]
    with pytest.raises(ValueError, match="workers must be >= 1"):
        shard_by_group(groups, 0)


def test_an_unknown_engine_option_is_a_config_error_listing_the_options() -> None:
    with pytest.raises(
        ConfigError,
        match=r"rollout.engine_args: .*'wokers'.*the 'ray' engine takes workers, address, num_cpus_per_worker",
    ):
        load_config("grpo", ["rollout.engine=ray", "rollout.engine_args.wokers=2"])
    cfg = load_config("grpo", ["rollout.engine=ray", "rollout.engine_args.workers=4"])
    assert cfg.rollout.engine_args == {"workers": 4}


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"workers": 0}, r"rollout.engine_args.workers must be an integer >= 1, got 0"),
        ({"workers": 1.5}, r"workers must be an integer >= 1, got 1.5"),
        ({"num_cpus_per_worker": -1}, r"num_cpus_per_worker must be a number >= 0"),
        ({"threads_per_worker": 0}, r"threads_per_worker must be an integer >= 1"),
        ({"max_batch": 0}, r"max_batch must be an integer >= 1"),
        ({"address": ""}, r"address must be 'local', 'auto' or a cluster address"),
    ],
)
def test_bad_option_values_are_refused_before_ray_starts(tokenizer, tiny_model, options, message):
    with pytest.raises(ValueError, match=message):
        make_engine("ray", tiny_model, tokenizer, **options)


def test_an_unreachable_cluster_address_is_named(tokenizer, tiny_model) -> None:
    import ray

    assert not ray.is_initialized()  # else the engine would use that Ray instead of joining
    with pytest.raises(
        ConnectionError,
        match=r"cannot reach the Ray cluster at rollout.engine_args.address='127\.0\.0\.1:1'.*ray start --head",
    ):
        make_engine("ray", tiny_model, tokenizer, address="127.0.0.1:1")
    assert not ray.is_initialized()
