"""scripts/probe_onednn.py: products, layers and an update are timed both ways, and the
module's row threshold is restored after."""

from __future__ import annotations

import pytest
from helpers import load_script

from anchor_rl.models import packed

pytestmark = pytest.mark.skipif(not packed.HAS_ONEDNN, reason="PyTorch built without oneDNN")


def test_products_layers_and_an_update_are_timed_on_mkl_and_onednn(monkeypatch) -> None:
    monkeypatch.setattr(packed, "ENABLED", True)
    probe = load_script("probe_onednn")
    shapes = {"toy": [(300, 16, 32), (8, 16, 32)]}
    products = probe.product_times(1, shapes=shapes)
    assert len(products) == 2 * 3  # forward, input and weight gradients of each shape
    assert all(v["mkl_us"] > 0 and v["onednn_us"] > 0 for v in products.values())
    layers = probe.layer_times(1, shapes=shapes)
    assert list(layers) == ["toy [300, 16] x [16, 32]"]  # 8 rows are below the threshold
    threshold = packed.ONEDNN_MIN_ROWS
    update = probe.update_times("random:tiny", 1, max_new_tokens=4)
    assert threshold == packed.ONEDNN_MIN_ROWS  # restored
    assert set(update["seconds"]) == {"mkl", "onednn"} and update["tokens"] > 0
    assert all(s > 0 for s in update["seconds"].values())
