"""benchmarks/real_size_gpu.py on the CPU: its rows, and the meter's wrapping of the policy's
and the critic's updates (their seconds noted, their results passed on, the originals put
back). The GPU counters themselves need a GPU."""

from __future__ import annotations

from types import SimpleNamespace

import real_size_gpu as bench


def test_the_critic_rows_are_ppo_with_checkpointing_off_and_on() -> None:
    critic = bench.table_rows("critic")
    assert [(r["preset"], r["lora"], r["checkpointing"], r["release"]) for r in critic] == [
        ("ppo", False, False, False),
        ("ppo", False, True, False),
    ]
    policy = bench.table_rows("policy")
    assert len(policy) == 8 and {r["preset"] for r in policy} == {"grpo"}
    assert bench.table_rows() == policy + critic


def test_the_meter_times_both_updates_and_puts_them_back() -> None:
    calls: list[str] = []
    engine = SimpleNamespace(
        rollout=lambda *a: calls.append("rollout") or "batch",
        sync_weights=lambda state: calls.append("sync"),
    )
    ppo_update = lambda *a, **k: calls.append("policy") or {"loss": 1.0}  # noqa: E731
    critic_update = lambda *a, **k: calls.append("critic") or {"critic/loss": 2.0}  # noqa: E731
    loop = SimpleNamespace(ppo_update=ppo_update)
    critic_module = SimpleNamespace(critic_update=critic_update)
    meter = bench.Meter("cpu")
    meter.instrument(SimpleNamespace(engine=engine), loop, critic_module)
    for _ in range(2):  # what a PPO step calls, in its order
        assert engine.rollout() == "batch"
        assert critic_module.critic_update(1, 2) == {"critic/loss": 2.0}
        assert loop.ppo_update(1, x=2) == {"loss": 1.0}
        engine.sync_weights({})
    assert calls == ["rollout", "critic", "policy", "sync"] * 2
    assert set(meter.record) == {"critic_update_seconds", "policy_update_seconds"}  # CPU: no peaks
    assert all(len(v) == 2 and min(v) >= 0 for v in meter.record.values())
    meter.uninstrument()
    assert loop.ppo_update is ppo_update and critic_module.critic_update is critic_update
