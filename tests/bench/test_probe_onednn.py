"""benchmarks/probe_onednn.py: each product is timed on MKL and oneDNN, and the memory of
oneDNN's primitive cache is measured for one and for many row counts."""

from __future__ import annotations

import probe_onednn as probe
import pytest

from anchor_rl.models import packed

pytestmark = pytest.mark.skipif(not packed.HAS_ONEDNN, reason="PyTorch built without oneDNN")


def test_products_are_timed_on_mkl_and_onednn_and_the_cache_growth_measured() -> None:
    products = probe.product_times(1, shapes={"toy": [(300, 16, 32), (8, 16, 32)]})
    assert len(products) == 2 * 3  # forward, input and weight gradients of each shape
    assert all(v["mkl_us"] > 0 and v["onednn_us"] > 0 for v in products.values())
    growth = probe.cache_growth(shapes=3, k=16, n=32)
    assert set(growth) == {"one row count", "distinct row counts"}
    assert all(g["products"] == 3 for g in growth.values())
