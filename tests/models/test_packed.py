"""Linear layers with pre-packed (oneDNN-reordered) weights: the same products as the
modules' own forward, which weights are packed, and that a forward with grad never is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anchor_rl.models import packed
from anchor_rl.models.packed import PackedLinears, linears_for, plain

pytestmark = pytest.mark.skipif(not packed.HAS_ONEDNN, reason="PyTorch built without oneDNN")


@pytest.fixture(autouse=True)
def packing_on(monkeypatch):
    """On whatever ANCHOR_RL_PACKED says in the environment running the tests."""
    monkeypatch.setattr(packed, "ENABLED", True)


def layers(dtype: torch.dtype) -> list[nn.Linear]:
    torch.manual_seed(0)
    big = nn.Linear(256, 1024, bias=False)  # exactly PACK_MIN_ELEMENTS weights
    biased = nn.Linear(1024, 256, bias=True)
    small = nn.Linear(128, 128, bias=False)
    return [m.to(dtype) for m in (big, biased, small)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_products_equal_the_modules_forward(dtype):
    """Float32 within its rounding (another summation order), bfloat16 bitwise (the same
    oneDNN kernel); 2-D, 3-D and non-contiguous inputs; a bias; rows other than the hint."""
    big, biased, small = layers(dtype)
    linear = PackedLinears([big, biased, small], rows=64)
    assert set(linear.packed) == {big, biased}  # the 128 x 128 one is below the threshold
    gen = torch.Generator().manual_seed(1)
    inputs = {
        big: [torch.randn(64, 256, generator=gen), torch.randn(5, 1, 256, generator=gen),
              torch.randn(3, 9, 256, generator=gen)[:, 2:]],
        biased: [torch.randn(25, 1024, generator=gen), torch.randn(2, 7, 1024, generator=gen)],
        small: [torch.randn(20, 128, generator=gen)],
    }  # fmt: skip
    with torch.no_grad():
        for module, xs in inputs.items():
            for x in xs:
                x = x.to(dtype)
                got, expected = linear(module, x), module(x)
                assert got.shape == expected.shape and got.dtype == dtype
                if dtype == torch.bfloat16:
                    assert torch.equal(got, expected)
                else:
                    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_forwards_with_grad_and_small_models_are_not_packed(monkeypatch):
    big, biased, small = layers(torch.float32)
    model = nn.Sequential(big, nn.ReLU(), biased)
    assert linears_for(model, 8) is plain  # grad enabled: the update's forward
    with torch.no_grad():
        assert isinstance(linears_for(model, 8), PackedLinears)
        assert linears_for(nn.Sequential(small), 8) is plain  # nothing worth packing
        monkeypatch.setattr(packed, "PACK_MIN_ELEMENTS", 1)
        assert isinstance(linears_for(nn.Sequential(small), 8), PackedLinears)
        assert len(PackedLinears([small.to(torch.float16)], 8)) == 0  # not a packed dtype
        hooked = nn.Linear(128, 128)
        hooked.register_forward_hook(lambda _m, _args, out: out * 2)
        assert len(PackedLinears([hooked], 8)) == 0  # its hook must run
        with torch.autocast("cpu", dtype=torch.bfloat16):  # the bf16 reference pass
            assert linears_for(model, 8) is plain
        monkeypatch.setattr(packed, "ENABLED", False)  # ANCHOR_RL_PACKED=off
        assert linears_for(model, 8) is plain


def test_packs_are_copies_of_the_weights_at_packing_time():
    """A pack holds the weights it was built from: the decoder packs once per turn, and a
    weight update between turns must not be missed or half-seen."""
    big, _, _ = layers(torch.float32)
    x = torch.randn(4, 256)
    with torch.no_grad():
        linear = PackedLinears([big], 4)
        before = linear(big, x)
        big.weight.add_(1.0)
        torch.testing.assert_close(linear(big, x), before, rtol=0, atol=0)
        torch.testing.assert_close(PackedLinears([big], 4)(big, x), big(x), rtol=1e-5, atol=1e-4)


def test_the_environment_turns_packing_off():
    import os
    import subprocess
    import sys

    code = "from anchor_rl.models import packed; print(packed.ENABLED)"
    for value, expected in (("off", "False"), ("0", "False"), ("on", "True")):
        env = {**os.environ, "ANCHOR_RL_PACKED": value}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        assert out.stdout.strip() == expected, out.stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prepared_product_packs_only_when_asked_and_worth_it(dtype):
    """The prepared layers' products: packed (a copy) for a large enough weight when asked,
    else ``F.linear`` on the tensors themselves; the same values either way."""
    big, biased, small = layers(dtype)
    x = torch.randn(6, 256).to(dtype)
    with torch.no_grad():
        for pack in (False, True):
            product = packed.prepared_product(big.weight, None, rows=6, pack=pack)
            assert isinstance(product, packed.PackedProduct) == pack
            torch.testing.assert_close(product(x), big(x), rtol=1e-5, atol=1e-5)
        small_product = packed.prepared_product(small.weight, small.bias, rows=6, pack=True)
        assert not isinstance(small_product, packed.PackedProduct)  # below the threshold
        assert packed.worth_packing(biased.weight, biased.bias)
        assert not packed.worth_packing(big.weight.to(torch.float16))
