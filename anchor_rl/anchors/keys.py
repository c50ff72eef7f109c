"""Keys that say what produced a row of the anchor store, and the fingerprints they are made of.

An anchor is only valid for the exact model, tokenizer, sampling settings and task that
produced it. Every row of the store is filed under the digest of an :class:`AnchorKey`
built from content fingerprints, so a second reference model, other sampling settings
or another task can never silently reuse old anchors: their key differs and a lookup
finds nothing.

Fingerprints hash content, not names: the same weights loaded from two directories (or
saved again) give the same key, and a fine-tuned checkpoint in the same directory gives
a new one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from anchor_rl.models.lora import inert_lora_base

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

    from anchor_rl.tasks.base import Task

__all__ = [
    "AnchorKey",
    "canonical_json",
    "fingerprint_model",
    "fingerprint_tokenizer",
    "inert_lora_base",
    "sampling_settings",
    "task_identity",
]


def canonical_json(value: Any) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal strings.

    Values JSON cannot represent (paths, enums) are written as their ``str``.
    """
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


@dataclass(frozen=True)
class AnchorKey:
    """The identity of whatever produced a set of rows (anchors or teacher trajectories).

    model: fingerprint of the sampling model's weights (:func:`fingerprint_model`), or of
        the teacher (see ``anchor_rl.anchors.teachers.teacher_key``).
    tokenizer: fingerprint of the tokenizer the rows' tokens are in.
    sampling: the sampling settings (JSON-serialisable; :func:`sampling_settings`).
    task: the task identity (:func:`task_identity`).
    tag: what kind of rows: ``presample`` for the anchors made before training,
        ``refresh/<mode>/step=<k>`` for a refresh, ``teacher/<name>`` for trajectories.

    Rows are stored under :attr:`digest`; the full key is stored once beside them so an
    export shows what every digest means.
    """

    model: str
    tokenizer: str
    sampling: Mapping[str, Any] = field(default_factory=dict)
    task: str = ""
    tag: str = "presample"

    def to_dict(self) -> dict[str, Any]:
        """The key as plain JSON-serialisable data."""
        return {
            "model": self.model,
            "tokenizer": self.tokenizer,
            "sampling": dict(self.sampling),
            "task": self.task,
            "tag": self.tag,
        }

    @property
    def digest(self) -> str:
        """32 hex characters of the SHA-256 of the canonical JSON of :meth:`to_dict`."""
        return _digest(canonical_json(self.to_dict()))

    def replace(self, **changes: Any) -> AnchorKey:
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def __hash__(self) -> int:
        return hash(self.digest)


def fingerprint_model(model: torch.nn.Module) -> str:
    """Hash of a model's class and every tensor of its state dict (names, dtypes, shapes, bytes).

    Reads each tensor once (moved to the CPU one at a time), so it costs about one pass
    over the weights: a few seconds for a 7B model. The same weights in another dtype
    give another fingerprint, which is right: they sample differently. A PEFT model whose
    LoRA adapters add nothing yet (:func:`~anchor_rl.models.lora.inert_lora_base`: a fresh
    LoRA, wrapped by PEFT or injected in place) samples as its base model and is hashed as
    that, so anchors presampled from the base model serve it.
    """
    import torch

    kind, state = type(model).__name__, None
    if (base := inert_lora_base(model)) is not None:
        kind, state = base
    h = hashlib.blake2b(digest_size=16)
    h.update(kind.encode())
    for name, tensor in sorted((model.state_dict() if state is None else state).items()):
        t = tensor.detach()
        h.update(f"|{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def fingerprint_tokenizer(tokenizer: PreTrainedTokenizerBase) -> str:
    """Hash of what decides a tokenizer's ids: its vocabulary and rules, special tokens, chat template.

    A fast tokenizer is hashed through its full serialisation (vocabulary, merges,
    normaliser, pre-tokeniser, added tokens); any other through its sorted vocabulary.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        rules = json.loads(backend.to_str())
    else:
        rules = sorted(tokenizer.get_vocab().items())
    content = {
        "rules": rules,
        "special": sorted(tokenizer.all_special_tokens),
        "chat_template": tokenizer.chat_template,
    }
    return _digest(canonical_json(content))


def sampling_settings(params: Any) -> dict[str, Any]:
    """Sampling settings as a plain dict: a dataclass (``SamplingParams``) or a mapping."""
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return dataclasses.asdict(params)
    if isinstance(params, Mapping):
        return dict(params)
    raise TypeError(
        f"sampling settings must be a dataclass or a mapping, got {type(params).__name__}"
    )


def task_identity(name: str, task: Task, kwargs: Mapping[str, Any] | None = None) -> str:
    """A task's identity for keys: its name, constructor arguments, instruction, tools, stops
    and, when a run replaced it, its reward (``task.reward_spec()``).

    Record ids must be stable for one identity (the built-in tasks are seeded), since
    rows are looked up by record id under the key.
    """
    identity = {
        "name": name,
        "kwargs": dict(kwargs or {}),
        "instruction": task.instruction,
        "tools": sorted(task.tools),
        "stop": list(task.stop),
    }
    if (reward := task.reward_spec()) is not None:
        identity["reward"] = reward
    return canonical_json(identity)
