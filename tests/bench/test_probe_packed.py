"""benchmarks/probe_packed.py: products and passes are timed both ways, and the module's
switch is restored after."""

from __future__ import annotations

import probe_packed as probe
import pytest

from anchor_rl.models import packed

pytestmark = pytest.mark.skipif(not packed.HAS_ONEDNN, reason="PyTorch built without oneDNN")


@pytest.fixture(autouse=True)
def packing_on(monkeypatch):
    """On whatever ANCHOR_RL_PACKED says in the environment running the tests."""
    monkeypatch.setattr(packed, "ENABLED", True)


def test_products_and_passes_are_timed_plain_and_packed(monkeypatch) -> None:
    products = probe.product_times(1, shapes={"toy": [(4, 16, 32)]})
    timed = [v for v in products.values() if isinstance(v, dict)]
    assert len(timed) == 2  # float32 and bfloat16
    assert all(v["plain_us"] > 0 and v["packed_us"] > 0 for v in timed)
    monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 1)  # random:tiny's weights are below it
    passes = probe.pass_times("random:tiny", 1, max_new_tokens=4)
    assert packed.ENABLED  # restored
    assert passes["packed_weights"] == 7 * 4  # q, k, v, o, gate, up, down of 4 layers
    assert set(passes["fp32"]) == {
        "rollout, plain",
        "rollout, packed",
        "reference, plain",
        "reference, packed",
    }
    assert set(passes["bf16 sampling"]) == {"rollout, plain", "rollout, packed"}
    assert all(s > 0 for s in [*passes["fp32"].values(), *passes["bf16 sampling"].values()])
