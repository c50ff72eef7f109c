"""Adapter-only weight sync of the ``http`` engine (:mod:`anchor_rl.rollout.http`) for LoRA
policies, over vLLM's runtime LoRA API.

vLLM started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` (and
``anchor-rl serve``, :mod:`anchor_rl.serve.adapters`) has ``POST /v1/load_lora_adapter``
``{"lora_name", "lora_path"}`` (a PEFT adapter directory the server can read) and ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}``; a completion asking for ``model=<lora_name>``
samples the base model with that adapter. vLLM refuses to load a name that is loaded already,
so each sync writes the adapter to a fresh directory, loads it under a new name, switches the
engine's completions to it and unloads the previous one: the server reads kilobytes to
megabytes (the adapters' tensors) instead of the whole model.

The adapter only makes sense on the policy's own base model. On ``anchor-rl serve``, which
has a weight-reload endpoint, the base model's weights are loaded before the first adapter
(once per engine: whatever the server was started with) and again whenever another client
reloaded the served weights since (``GET /v1/weights`` reports their revision); a vLLM
server must have been started with the base model.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from anchor_rl.models.lora import ADAPTER_WEIGHTS, MergedState, require_peft
from anchor_rl.rollout.http_client import ServerError

LoraSync = Literal["auto", "adapter", "merged"]
LORA_SYNC: tuple[str, ...] = get_args(LoraSync)
"""How a LoRA policy reaches the server: ``adapter`` (only the adapter, through the runtime
LoRA endpoints), ``merged`` (the merged weights, ``POST /v1/weights``), ``auto`` (``adapter``
where the server has the endpoints, else ``merged``)."""


class AdapterSync:
    """The adapter side of one :class:`~anchor_rl.rollout.http.HTTPEngine`'s weight sync.

    engine: that engine (its client, info, folder and weight post).
    mode: one of :data:`LORA_SYNC`.
    name: the adapter the engine's completions ask for (None: the served model itself).
    """

    def __init__(self, engine: Any, mode: str) -> None:
        if mode not in LORA_SYNC:
            raise ValueError(f"lora_sync must be one of {', '.join(LORA_SYNC)}, got {mode!r}")
        self.engine, self.mode = engine, mode
        self.name: str | None = None
        self.folder: Path | None = None
        self.endpoints: bool | None = None  # whether the server has them (asked once)
        self._prefix = f"anchor-rl-lora-{uuid.uuid4().hex[:8]}"
        self._policy: torch.nn.Module | None = None
        self._base_revision: str | None = None  # the served weights' revision we checked

    def policy_of(self, state: Mapping[str, torch.Tensor]) -> torch.nn.Module | None:
        """The LoRA policy to sync as its adapter, or None to sync ``state`` as weights.
        ``state`` is a LoRA policy's when it is its ``sampling_state``
        (:class:`~anchor_rl.models.lora.MergedState`). ValueError for ``adapter`` mode
        without a LoRA policy, ServerError for it against a server without the endpoints."""
        policy = state.source if isinstance(state, MergedState) else None
        if policy is None and self.mode == "adapter":
            raise ValueError(
                "lora_sync='adapter' sends a LoRA policy's adapter; these weights are not a LoRA "
                "policy's (sampling_state of a LoRA policy): use lora_sync='auto' or 'merged'"
            )
        if policy is None or self.mode == "merged":
            return None
        if self.endpoints is None:
            self.endpoints = self._probe()
        if not self.endpoints and self.mode == "adapter":
            raise ServerError(
                f"lora_sync='adapter': {self.engine.url} has no runtime LoRA endpoints (POST "
                "/v1/load_lora_adapter and /v1/unload_lora_adapter). Start vLLM with "
                "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (or use anchor-rl "
                "serve), or set lora_sync='merged' (rollout.engine_args.lora_sync)"
            )
        return policy if self.endpoints else None

    def _probe(self) -> bool:
        """``POST /v1/unload_lora_adapter`` with an empty name, which changes nothing: a
        server with the endpoint refuses the name (a 4xx other than 404 and 405), one
        without it answers 404 or 405."""
        try:
            self.engine.client.request("POST", "/unload_lora_adapter", {"lora_name": ""}, True)
        except ServerError as exc:
            return exc.status is not None and exc.status < 500 and exc.status not in (404, 405)
        return True

    def sync(self, policy: torch.nn.Module, version: int) -> None:
        """Write ``policy``'s adapter, load it under a new name (``version`` in it), switch
        to it, unload the previous one and remove its directory."""
        self._policy = policy
        if self._base_revision is None:
            self.ensure_base(force=True)
        name = f"{self._prefix}-{version}"
        folder = self.engine._folder() / name
        self.engine.sync_bytes += save_peft_adapter(policy, folder)
        client = self.engine.client
        body = {"lora_name": name, "lora_path": str(folder)}
        try:
            client.request("POST", "/load_lora_adapter", body, True)
        except ServerError:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        old, old_folder = self.name, self.folder
        self.name, self.folder = name, folder
        if old is not None:
            try:
                client.request("POST", "/unload_lora_adapter", {"lora_name": old}, True)
            except ServerError as exc:
                if exc.status != 404:  # unloaded already is fine
                    raise
        if old_folder is not None:
            shutil.rmtree(old_folder, ignore_errors=True)

    def ensure_base(self, force: bool = False) -> None:
        """Make ``anchor-rl serve``'s weights the policy's base model: with ``force``, or when
        another client reloaded them since (``GET /v1/weights``' revision), load the base
        model's weights there (``POST /v1/weights``). Other servers have no such endpoint:
        nothing to do (they must serve the base model)."""
        engine = self.engine
        if self._policy is None or not engine.info().anchor_rl:
            self._base_revision = self._base_revision or "unchecked"
            return
        if not force:
            current = engine.client.request("GET", "/weights")
            if isinstance(current, dict) and current.get("revision") == self._base_revision:
                return
        from anchor_rl.models.lora import lora_base

        written = engine.sync_bytes
        engine._sync_state(lora_base(self._policy).state_dict())
        if not force:  # between syncs: the last sync's bytes stay what it wrote
            engine.sync_bytes = written
        self._base_revision = engine._revision or "unchecked"


def save_peft_adapter(model: torch.nn.Module, folder: Path) -> int:
    """Write the adapter of ``model`` (a LoRA policy, adapters injected by ``peft``) to
    ``folder`` as ``PeftModel.save_pretrained`` does (``adapter_config.json``, and
    ``adapter_model.safetensors`` with the adapters' tensors only, named
    ``base_model.model.<module>``: what vLLM and PEFT read); the bytes written."""
    from safetensors.torch import save_file

    peft: Any = require_peft()
    folder.mkdir(parents=True, exist_ok=True)
    state = peft.get_peft_model_state_dict(model, adapter_name="default")
    tensors = {f"base_model.model.{k}": v.detach().cpu().contiguous() for k, v in state.items()}
    save_file(tensors, str(folder / ADAPTER_WEIGHTS))
    model.peft_config["default"].save_pretrained(str(folder))
    return sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
