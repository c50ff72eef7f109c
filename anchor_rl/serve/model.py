"""The model side of ``anchor-rl serve``: the served model and tokenizer, sampling the rows
of jobs with the built-in sampler (each row with its own seed and counter) and reloading
weights."""

from __future__ import annotations

import base64
import json
import tempfile
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.anchors.keys import fingerprint_model, fingerprint_tokenizer
from anchor_rl.models.tokenizer import id_count
from anchor_rl.rollout.sampling import StopSet, Turn, eos_ids, generate_turn
from anchor_rl.serve.adapters import Adapters
from anchor_rl.serve.protocol import BadRequest, Job


class ModelServer:
    """The served model and tokenizer; sampling and weight reloads, one call at a time (the
    :class:`~anchor_rl.serve.batcher.Batcher` runs them on its single model thread).

    name: the served model's name (the ``model`` field of requests).
    max_batch: most rows per forward batch (a larger job runs in chunks of that size, like
        the ``hf`` engine's ``max_batch``).
    adapters: the LoRA adapters loaded at run time (:mod:`anchor_rl.serve.adapters`); a job
        naming one samples with it applied.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        name: str,
        max_batch: int = 256,
    ) -> None:
        if tokenizer.pad_token_id is None:
            raise ValueError("the tokenizer needs a pad token (load_policy sets one)")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.model, self.tokenizer, self.name, self.max_batch = (
            model.eval(),
            tokenizer,
            name,
            max_batch,
        )
        self.limit: int | None = getattr(model.config, "max_position_embeddings", None)
        self.vocab = id_count(model, tokenizer)  # the ids a prompt may hold
        self.eos = eos_ids(model, tokenizer)
        self.revision = uuid.uuid4().hex
        self.weights_path: str | None = None
        self.created = int(time.time())
        self.tokenizer_fingerprint = fingerprint_tokenizer(tokenizer)
        self._fingerprint: tuple[str, str] | None = None  # (revision, fingerprint_model)
        self.batches = self.rows = 0
        self.adapters = Adapters(model, name)
        with tempfile.TemporaryDirectory(prefix="anchor-rl-serve-") as folder:
            tokenizer.save_pretrained(folder)
            self.tokenizer_files = {
                p.name: base64.b64encode(p.read_bytes()).decode()
                for p in sorted(Path(folder).iterdir())
                if p.is_file()
            }

    def fingerprint(self) -> str:
        """``fingerprint_model`` of the current weights (computed once per revision)."""
        return self.revision_fingerprint()[1]

    def revision_fingerprint(self) -> tuple[str, str]:
        """``(revision, fingerprint_model)`` of the current weights, computed once per revision
        (it reads every weight: call it on the model thread, between batches and reloads)."""
        known = self.known_fingerprint()
        if known is None:
            known = self._fingerprint = (self.revision, fingerprint_model(self.model))
        return known

    def known_fingerprint(self) -> tuple[str, str] | None:
        """``(revision, fingerprint)`` of the current weights if :meth:`revision_fingerprint`
        computed it already, else None. Safe on the event loop while the model thread
        samples (``GET /v1/models`` need not wait for a batch): it reads one tuple, replaced
        whole, so the pair always names the same weights."""
        known = self._fingerprint
        return known if known is not None and known[0] == self.revision else None

    def generate(self, jobs: Sequence[Job]) -> list[list[Turn]]:
        """One ``generate_turn`` over the rows of ``jobs`` (equal keys), in chunks of
        ``max_batch`` rows; the turns of each job, in its row order."""
        first = jobs[0]
        contexts = [c for j in jobs for c in j.contexts]
        budgets = [b for j in jobs for b in j.budgets]
        seeds = [s for j in jobs for s in j.seeds]
        counters = [c for j in jobs for c in j.counters]
        stops = StopSet.build(self.tokenizer, list(first.stop), self.eos)
        turns: list[Turn] = []
        model = self.model if first.adapter is None else self.adapters.model(first.adapter)
        model.eval()
        for start in range(0, len(contexts), self.max_batch):
            part = slice(start, start + self.max_batch)
            turns += generate_turn(
                model, self.tokenizer, contexts[part], budgets[part], first.temperature,
                first.top_p, stops, seeds[part], counters[part],
            )  # fmt: skip
        self.batches += 1
        self.rows += len(contexts)
        for job in jobs:  # reloads run on this thread too: these are the weights that sampled
            job.revision = self.revision
        out, at = [], 0
        for j in jobs:
            out.append(turns[at : at + len(j)])
            at += len(j)
        return out

    def reload(self, path: str) -> dict[str, Any]:
        """Load the weights at ``path`` (a safetensors file or a Hugging Face model directory)
        into the model; BadRequest when they do not fit it. Returns the new revision."""
        try:
            state = _read_weights(Path(path))
        except BadRequest:
            raise
        except Exception as exc:  # a corrupt file, a header error...
            raise BadRequest(f"cannot read weights from {path}: {exc}", "path") from exc
        own = self.model.state_dict()
        unexpected = sorted(set(state) - set(own))
        if unexpected:
            raise BadRequest(
                f"{path} has {len(unexpected)} tensors the served model does not have, e.g. "
                f"{unexpected[:3]}: is it a checkpoint of this architecture?",
                "path",
            )
        loaded = {own[k].data_ptr() for k in state}
        missing = sorted(k for k in set(own) - set(state) if own[k].data_ptr() not in loaded)
        if missing:  # tied weights (lm_head = embed_tokens) may be left out
            raise BadRequest(f"{path} lacks {len(missing)} tensors, e.g. {missing[:3]}", "path")
        shapes = [
            f"{k}: {tuple(state[k].shape)} vs {tuple(own[k].shape)}"
            for k in state
            if tuple(state[k].shape) != tuple(own[k].shape)
        ]
        if shapes:
            raise BadRequest(f"{path} has tensors of other shapes: {shapes[:3]}", "path")
        for k, v in state.items():  # NaN weights sample noise, with log-probs JSON cannot hold
            if v.is_floating_point() and not bool(torch.isfinite(v).all()):
                raise BadRequest(
                    f"{path} has NaN or infinite values in tensor {k!r}; the served weights stay",
                    "path",
                )
        with torch.no_grad():
            self.model.load_state_dict(state, strict=False)
        self._fingerprint = None
        self.revision, self.weights_path = uuid.uuid4().hex, str(path)
        return {"revision": self.revision, "tensors": len(state), "path": str(path)}


def _read_weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if path.is_file():
        if path.suffix != ".safetensors":
            raise BadRequest(
                f"{path} is not a .safetensors file; send a safetensors file or a model directory",
                "path",
            )
        return load_file(str(path))
    if path.is_dir():
        if (path / "model.safetensors").is_file():
            return load_file(str(path / "model.safetensors"))
        index = path / "model.safetensors.index.json"
        if index.is_file():
            state: dict[str, torch.Tensor] = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                state.update(load_file(str(path / shard)))
            return state
        if (path / "config.json").is_file():
            from anchor_rl.models.loading import load_policy

            return load_policy(path)[0].state_dict()
        raise BadRequest(
            f"{path} holds no model weights (no model.safetensors or config.json)", "path"
        )
    raise BadRequest(f"no such file or directory: {path}", "path")
