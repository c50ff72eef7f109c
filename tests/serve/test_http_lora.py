"""Adapter-only weight sync of a LoRA policy through the `http` engine (vLLM's runtime LoRA
API, which `anchor-rl serve` implements): the server's endpoints, rollouts scored with the
updated policy's log-probs and equal to the merged-weights path, the bytes a sync writes,
the fallback to merged weights and the error when adapters are forced."""

from __future__ import annotations

import httpx
import pytest
import torch

import anchor_rl.rollout.http  # noqa: F401  (registers the http engine)
from anchor_rl.models.factory import build_model
from anchor_rl.models.lora import sampling_state, save_adapter
from anchor_rl.rollout.engine import make_engine
from anchor_rl.rollout.http_client import ServerError
from anchor_rl.rollout.http_lora import save_peft_adapter
from anchor_rl.rollout.lora_check import (
    PARAMS,
    check_requests,
    lora_policy,
    sampled_gaps,
    update_adapters,
)
from anchor_rl.serve.app import ServerThread, build_app
from anchor_rl.serve.model import ModelServer


@pytest.fixture
def moved(tokenizer):
    """A tiny LoRA policy (base: seed 0) after a real update of its adapters."""
    policy = lora_policy(build_model("tiny", tokenizer, seed=0))
    update_adapters(make_engine("hf", policy, tokenizer), policy)
    return policy


def _server(tokenizer, seed: int = 0, lora: bool = True) -> ServerThread:
    """`anchor-rl serve` of a tiny model (seed ``seed``), without the LoRA endpoints unless ``lora``."""
    app = build_app(ModelServer(build_model("tiny", tokenizer, seed=seed), tokenizer, "tiny"))
    if not lora:
        app.router.routes[:] = [r for r in app.routes if "lora" not in getattr(r, "path", "")]
    return ServerThread(app)


def test_the_server_loads_lists_samples_and_unloads_adapters(tokenizer, moved, tmp_path) -> None:
    save_adapter(moved, None, tmp_path / "a")
    with _server(tokenizer) as thread, httpx.Client(base_url=thread.url + "/v1") as http:
        load = {"lora_name": "a1", "lora_path": str(tmp_path / "a")}
        answer = http.post("/load_lora_adapter", json=load)
        assert answer.status_code == 200 and "a1" in answer.text
        again = http.post("/load_lora_adapter", json=load)
        assert again.status_code == 400 and "loaded already" in again.text
        bad = http.post("/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tmp_path)})
        assert bad.status_code == 400 and "adapter" in bad.text
        cards = {c["id"]: c for c in http.get("/models").json()["data"]}
        assert set(cards) == {"tiny", "a1"} and cards["a1"]["parent"] == "tiny"
        body = {"prompt": "1+2=", "max_tokens": 4, "seed": 3, "logprobs": 1}
        lora = http.post("/completions", json={**body, "model": "a1"}).json()
        plain = http.post("/completions", json={**body, "model": "tiny"}).json()
        assert lora["model"] == "a1" and plain["model"] == "tiny"
        assert lora["choices"][0]["logprobs"] != plain["choices"][0]["logprobs"]
        assert http.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 200
        assert http.post("/unload_lora_adapter", json={"lora_name": "a1"}).status_code == 404
        assert http.post("/completions", json={**body, "model": "a1"}).status_code == 404


def test_adapter_sync_samples_the_policy_as_merged_sync_does(tokenizer, moved) -> None:
    """After an update, the http engine syncing only the adapter samples with the LoRA
    policy's log-probs (not the base model's), the same rollout as the merged-weights path,
    and writes the adapter's bytes, a small part of the model's."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with _server(tokenizer, seed=9) as thread:  # not the policy's base: loaded first
            adapter = make_engine("http", moved, tokenizer, url=thread.url)
            assert adapter.sync_mode == "adapter"
            adapter.sync_weights(sampling_state(moved))  # a second sync: the adapter alone
            assert adapter.sync_mode == "adapter" and adapter.lora.name is not None
            to_policy, to_base = sampled_gaps(adapter, moved)
            merged = make_engine("http", moved, tokenizer, url=thread.url, lora_sync="merged")
            assert merged.sync_mode == "merged"
            requests = check_requests(n=2, seed=5)
            by_merged = merged.rollout(requests, PARAMS)
            by_adapter = adapter.rollout(requests, PARAMS)  # reloads the base model first
            again = sampled_gaps(adapter, moved)
            adapter_bytes, merged_bytes = adapter.sync_bytes, merged.sync_bytes
            adapter.close()
            merged.close()
    finally:
        torch.set_num_threads(before)
    assert to_policy < 1e-4 and to_base > 1e-2, (to_policy, to_base)
    assert again[0] < 1e-4, again
    assert torch.equal(by_adapter.response_ids, by_merged.response_ids)
    assert torch.allclose(by_adapter.logprobs, by_merged.logprobs, atol=1e-4)
    assert 0 < adapter_bytes < merged_bytes / 10, (adapter_bytes, merged_bytes)


def test_without_the_endpoints_auto_merges_and_adapter_is_refused(tokenizer, moved) -> None:
    with _server(tokenizer, lora=False) as thread:
        auto = make_engine("http", moved, tokenizer, url=thread.url)
        assert auto.sync_mode == "merged" and auto.lora.name is None
        assert sampled_gaps(auto, moved)[0] < 1e-4
        auto.close()
        with pytest.raises(ServerError, match="VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"):
            make_engine("http", moved, tokenizer, url=thread.url, lora_sync="adapter")
        plain = build_model("tiny", tokenizer, seed=0)
        with pytest.raises(ValueError, match="not a LoRA policy's"):
            make_engine("http", plain, tokenizer, url=thread.url, lora_sync="adapter")
        with pytest.raises(ValueError, match="lora_sync must be one of"):
            make_engine("http", moved, tokenizer, url=thread.url, lora_sync="delta")


def test_the_adapter_files_are_peft_format(tokenizer, moved, tmp_path) -> None:
    """What the engine writes loads with PEFT's own `PeftModel.from_pretrained` (the format
    vLLM reads) and computes the policy's outputs."""
    peft = pytest.importorskip("peft")
    size = save_peft_adapter(moved, tmp_path)
    loaded = peft.PeftModel.from_pretrained(build_model("tiny", tokenizer, seed=0), tmp_path)
    ids = torch.tensor([[5, 17, 30, 44, 9, 60]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, moved(ids).logits, atol=1e-5)
    assert size == sum(f.stat().st_size for f in tmp_path.iterdir())


def test_the_config_check_names_a_bad_lora_sync() -> None:
    from anchor_rl.trainer.plugins import engines
    from anchor_rl.trainer.rules import _engine_option_errors

    factory = engines().lookup("http")
    assert _engine_option_errors("http", factory, {"lora_sync": "adapter"}) == []
    (error,) = _engine_option_errors("http", factory, {"lora_sync": "delta"})
    assert "rollout.engine_args.lora_sync='delta'" in error
