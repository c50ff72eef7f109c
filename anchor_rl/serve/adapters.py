"""LoRA adapters loaded into ``anchor-rl serve`` at run time, with vLLM's runtime LoRA API:
``POST /v1/load_lora_adapter`` ``{"lora_name": NAME, "lora_path": DIR}`` loads a PEFT adapter
directory under ``NAME``, ``POST /v1/unload_lora_adapter`` ``{"lora_name": NAME}`` drops it,
``GET /v1/models`` lists each loaded adapter (``parent``: the served model) and a completion
with ``model=NAME`` samples the served model with that adapter applied.

Each adapter is a second module tree over the served model's *own* weight tensors (no copy of
the weights; a ``POST /v1/weights`` reload, which writes those tensors in place, moves every
adapter's base with it) with the adapter's LoRA layers injected by ``peft``
(:func:`anchor_rl.models.lora.load_adapter`, what ``serve --adapter`` loads with).
As in vLLM, loading a name that is loaded already is refused (load a new name, then unload
the old one).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from anchor_rl.errors import AnchorRLError
from anchor_rl.serve.protocol import BadRequest


@dataclass
class Adapter:
    """One loaded adapter: its name, directory, and the served model with it applied."""

    name: str
    path: str
    model: torch.nn.Module
    created: int = field(default_factory=lambda: int(time.time()))


class Adapters:
    """The adapters loaded into one served model, by name.

    base: the served model (its parameters are shared, never copied).
    reserved: names an adapter may not take (the served model's own name).
    Loading and unloading run on the model thread (the batcher's), like weight reloads.
    """

    def __init__(self, base: torch.nn.Module, reserved: str) -> None:
        self.base, self.reserved = base, reserved
        self.loaded: dict[str, Adapter] = {}

    def __contains__(self, name: object) -> bool:
        return name in self.loaded

    def model(self, name: str) -> torch.nn.Module:
        """The served model with adapter ``name`` applied; BadRequest 404 when it is not
        loaded (e.g. unloaded after the request was accepted)."""
        adapter = self.loaded.get(name)
        if adapter is None:
            raise BadRequest(
                f"the LoRA adapter {name!r} is not loaded", "model", 404, "NotFoundError"
            )
        return adapter.model

    def load(self, name: str, path: str) -> str:
        """Load the PEFT adapter directory ``path`` under ``name``; the confirmation text.
        BadRequest: a name in use, or a directory that is no adapter of this model."""
        if name == self.reserved or name in self.loaded:
            what = "the served model's name" if name == self.reserved else "loaded already"
            raise BadRequest(
                f"the LoRA adapter {name!r} is {what}; load it under another name "
                "(and unload the old one)",
                "lora_name",
            )
        from anchor_rl.models.lora import load_adapter

        shared: dict[int, Any] = {id(p): p for p in self.base.parameters()}
        twin = copy.deepcopy(self.base, shared)  # the module tree; the weights stay shared
        grads = {p: p.requires_grad for p in self.base.parameters()}
        try:
            model = load_adapter(twin, Path(path))
        except AnchorRLError as exc:
            raise BadRequest(str(exc), "lora_path") from None
        finally:
            for p, g in grads.items():  # load_adapter freezes the base tensors it shares
                p.requires_grad_(g)
        self.loaded[name] = Adapter(name, str(path), model.eval())
        return f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> str:
        """Drop adapter ``name``; the confirmation text. BadRequest 404 when it is not loaded."""
        if self.loaded.pop(name, None) is None:
            raise BadRequest(
                f"the LoRA adapter {name!r} cannot be found", "lora_name", 404, "NotFoundError"
            )
        return f"Success: LoRA adapter '{name}' removed successfully."

    def cards(self, parent: str, max_model_len: int | None) -> list[dict[str, Any]]:
        """The ``GET /v1/models`` cards of the loaded adapters (vLLM's fields: ``root`` the
        adapter directory, ``parent`` the served model)."""
        return [
            {
                "id": a.name,
                "object": "model",
                "created": a.created,
                "owned_by": "anchor-rl",
                "root": a.path,
                "parent": parent,
                "max_model_len": max_model_len,
            }
            for a in self.loaded.values()
        ]
