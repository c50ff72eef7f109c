"""A learner rank's entry point that counts the tensor bytes the rank holds while it starts
(the spawned process imports this module by name: the tests' directory is on its path)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

REPORT = "ANCHOR_RL_TEST_RANK_BYTES"
"""The environment variable naming the file the rank writes its figures to."""


class HeldBytes(TorchDispatchMode):
    """The bytes of the live tensor storages that operations create while the mode is on
    (each storage once, at its current size: FSDP resizes its unsharded buffers to 0 in
    place; a DTensor's: its local tensor's), after every operation, and their peak;
    ``largest`` the largest storage seen."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.peak = self.largest = 0

    def held(self) -> int:
        return sum(storage.nbytes() for storage in list(self.storages.keys()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            self.track(t)
        self.peak = max(self.peak, self.held())
        return out

    def track(self, t: Any) -> None:
        if is_traceable_wrapper_subclass(t):  # a DTensor: what it wraps, not its full shape
            for name in t.__tensor_flatten__()[0]:
                self.track(getattr(t, name))
        elif hasattr(t, "untyped_storage") and t.device.type != "meta":
            storage = t.untyped_storage()
            self.storages[storage] = True
            self.largest = max(self.largest, storage.nbytes())


def measured_learner(*args: Any) -> None:
    """``learners._learner_main`` under :class:`HeldBytes`; writes ``{"peak", "end",
    "largest"}`` (bytes) to the file ``$ANCHOR_RL_TEST_RANK_BYTES`` names once the rank is set
    up (as it builds its ``DataParallel``, the last step of its set-up)."""
    from anchor_rl.cluster import learners

    counter = HeldBytes()
    real = learners.DataParallel

    def report(*dp_args: Any) -> Any:
        figures = {"peak": counter.peak, "end": counter.held(), "largest": counter.largest}
        Path(os.environ[REPORT]).write_text(json.dumps(figures))
        return real(*dp_args)

    learners.DataParallel = report
    with counter:
        learners._learner_main(*args)
