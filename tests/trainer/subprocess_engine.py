"""A second Engine, for the seam test: the built-in engine's sampling, run in another process.

The child process builds its own copy of the model from the learner's config (random
weights), then samples only from weights it received through ``sync_weights``, saved by
the learner as a safetensors checkpoint (what a remote engine would load). Importing this
module registers it as the ``subprocess`` engine (``rollout.engine=subprocess``).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from anchor_rl.rollout.engine import ENGINES, Request, make_engine, register_engine

THREADS = 1


def _serve(conn, model_dir: str) -> None:
    """The child: build the model, then answer ``sync`` and ``rollout`` messages until ``stop``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir)).eval()
    engine = make_engine("hf", model, tokenizer)
    while True:
        kind, payload = conn.recv()
        if kind == "stop":
            return
        try:
            if kind == "sync":
                engine.sync_weights(load_file(payload))
                conn.send(("ok", None))
            else:
                requests, params, tools, instruction = payload
                conn.send(("ok", engine.rollout(requests, params, tools, instruction)))
        except Exception as exc:  # report it to the parent instead of dying silently
            conn.send(("error", repr(exc)))


class SubprocessEngine:
    """An :class:`~anchor_rl.rollout.engine.Engine` whose model lives in a child process."""

    def __init__(self, model, tokenizer) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="engine-")
        model.config.save_pretrained(self._dir.name)
        tokenizer.save_pretrained(self._dir.name)
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, self._dir.name), daemon=True)
        self._process.start()
        self.syncs = 0
        self._stop = weakref.finalize(self, _stop, self._conn, self._process)

    def close(self) -> None:
        """Stop the child process (idempotent)."""
        self._stop()

    @property
    def alive(self) -> bool:
        """Whether the child process runs."""
        return self._process.is_alive()

    def _ask(self, kind: str, payload):
        self._conn.send((kind, payload))
        status, value = self._conn.recv()
        if status != "ok":
            raise RuntimeError(f"engine process failed: {value}")
        return value

    def rollout(
        self,
        requests: Sequence[Request],
        params,
        tools=None,
        instruction: str | None = None,
    ):
        return self._ask("rollout", (list(requests), params, tools, instruction))

    def sync_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        path = Path(self._dir.name) / "weights.safetensors"
        tensors = {k: v.detach().cpu().contiguous() for k, v in state.items()}
        # tied weights (lm_head = embed_tokens) share storage: safetensors wants one copy each
        save_file({k: v.clone() for k, v in tensors.items()}, str(path))
        self._ask("sync", str(path))
        self.syncs += 1


def _stop(conn, process) -> None:
    with contextlib.suppress(BrokenPipeError, OSError):
        conn.send(("stop", None))
    process.join(timeout=10)
    if process.is_alive():
        process.kill()


def _factory(model, tokenizer) -> SubprocessEngine:
    engine = SubprocessEngine(model, tokenizer)
    engine.sync_weights(model.state_dict())  # the child starts from the learner's weights
    return engine


if "subprocess" not in ENGINES:
    register_engine("subprocess")(_factory)
