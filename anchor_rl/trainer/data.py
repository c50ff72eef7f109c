"""The prompt stream: a seeded reshuffle each epoch, resumable from one integer."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from anchor_rl.tasks.base import Record


class PromptSampler:
    """Draws records without replacement within an epoch, a new permutation each epoch.

    The permutation of epoch ``e`` depends only on ``(seed, e)``, so the whole stream is a
    function of the seed and the cursor ``consumed`` (records drawn so far): saving that
    one integer is enough to resume.
    """

    def __init__(self, records: Sequence[Record], seed: int, consumed: int = 0) -> None:
        if not records:
            raise ValueError("the prompt set is empty")
        self.records = list(records)
        self.seed = seed
        self.consumed = consumed
        self._epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def peek(self, k: int) -> list[Record]:
        """The next ``k`` records of the stream, leaving the cursor where it is."""
        return PromptSampler(self.records, self.seed, self.consumed).take(k)

    def take(self, k: int) -> list[Record]:
        """The next ``k`` records of the stream."""
        out = []
        for _ in range(k):
            epoch, pos = divmod(self.consumed, len(self.records))
            if epoch != self._epoch:
                self._epoch = epoch
                self._perm = np.random.default_rng((self.seed, epoch)).permutation(
                    len(self.records)
                )
            out.append(self.records[int(self._perm[pos])])
            self.consumed += 1
        return out
