"""The rollout batch every stage after generation reads, and the mini-batch schedule of updates.

Shapes: B responses, T response tokens (the longest response in the batch).

It lives at the bottom of the package (torch only), so the models that score a batch,
the engines that produce one and the trainer that learns from one share it without any
of them importing another.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace

import torch


@dataclass
class RolloutBatch:
    """B sampled responses with their prompts, masks and sampling log-probs.

    group: LongTensor[B], index into the prompt list given to ``rollout`` (the GRPO group).
    prompt_ids: B tokenised prompts (unpadded).
    response_ids: LongTensor[B, T], right-padded with ``pad_id``.
    attention_mask: FloatTensor[B, T], 1 on every real response token (policy and tool output).
    loss_mask: FloatTensor[B, T], 1 only on tokens the policy sampled.
    logprobs: FloatTensor[B, T], log-probs of the sampled tokens under the distribution
        they were drawn from (see ``anchor_rl.rollout.engine``), 0 where ``loss_mask`` is 0.
    texts: decoded completions (special tokens skipped, tool turns included).
    tool_calls: LongTensor[B], tool calls executed per response.
    truncated: BoolTensor[B], the response hit ``max_new_tokens`` without finishing.
    pad_id: the id ``response_ids`` is padded with.
    """

    group: torch.Tensor
    prompt_ids: list[list[int]]
    response_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    logprobs: torch.Tensor
    texts: list[str]
    tool_calls: torch.Tensor
    truncated: torch.Tensor
    pad_id: int = 0

    def __post_init__(self) -> None:
        b = len(self.group)
        shape = self.response_ids.shape
        if len(shape) != 2 or shape[0] != b:
            raise ValueError(f"response_ids must be [B={b}, T], got {tuple(shape)}")
        for name in ("attention_mask", "loss_mask", "logprobs"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"{name} has shape {tuple(getattr(self, name).shape)}, expected {tuple(shape)}"
                )
        for name in ("prompt_ids", "texts", "tool_calls", "truncated"):
            if len(getattr(self, name)) != b:
                raise ValueError(f"{name} has {len(getattr(self, name))} rows, expected {b}")

    def __len__(self) -> int:
        return len(self.group)

    @property
    def lengths(self) -> torch.Tensor:
        """LongTensor[B]: policy-sampled tokens per response (``loss_mask.sum(-1)``)."""
        return self.loss_mask.sum(-1).long()

    def select(self, idx: Sequence[int] | torch.Tensor) -> RolloutBatch:
        """The rows ``idx`` (indices or a bool mask), in that order; T is kept."""
        idx = torch.as_tensor(idx)
        if idx.dtype == torch.bool:
            if idx.shape != (len(self),):
                raise ValueError(
                    f"bool mask of shape {tuple(idx.shape)} for a batch of {len(self)}"
                )
            idx = idx.nonzero().flatten()
        idx = idx.long().flatten()
        rows = idx.tolist()
        return RolloutBatch(
            group=self.group[idx],
            prompt_ids=[self.prompt_ids[i] for i in rows],
            response_ids=self.response_ids[idx],
            attention_mask=self.attention_mask[idx],
            loss_mask=self.loss_mask[idx],
            logprobs=self.logprobs[idx],
            texts=[self.texts[i] for i in rows],
            tool_calls=self.tool_calls[idx],
            truncated=self.truncated[idx],
            pad_id=self.pad_id,
        )

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch with every tensor field on ``device`` (dtypes kept; a tensor already there
        is the same tensor), the lists and ``pad_id`` as they are."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)

    @property
    def response_width(self) -> int:
        """Columns up to the last one ``attention_mask`` marks, at least 1: the width of the
        longest response, less than T in a micro-batch of :meth:`select` (which keeps T)."""
        real = self.attention_mask.any(0).nonzero()
        return max(int(real[-1]) + 1 if len(real) else 0, 1)

    def trimmed(self) -> RolloutBatch:
        """The batch cut to :attr:`response_width` columns (a padded forward would compute
        every column). ``self`` when there is nothing to cut."""
        t = self.response_width
        if t >= self.response_ids.shape[1]:
            return self
        return replace(
            self,
            response_ids=self.response_ids[:, :t],
            attention_mask=self.attention_mask[:, :t],
            loss_mask=self.loss_mask[:, :t],
            logprobs=self.logprobs[:, :t],
        )

    @staticmethod
    def cat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Rows of all batches in order, right-padded to the longest T.

        Group ids are kept as they are: concatenate batches whose groups index the same
        prompt list, or renumber them first.
        """
        if not batches:
            raise ValueError("RolloutBatch.cat needs at least one batch")
        pad_ids = {b.pad_id for b in batches}
        if len(pad_ids) > 1:
            raise ValueError(f"cannot concatenate batches with different pad ids {sorted(pad_ids)}")
        t = max(b.response_ids.shape[1] for b in batches)

        def padded(name: str, value: float) -> torch.Tensor:
            parts = [getattr(b, name) for b in batches]
            return torch.cat(
                [torch.nn.functional.pad(p, (0, t - p.shape[1]), value=value) for p in parts]
            )

        pad_id = batches[0].pad_id
        return RolloutBatch(
            group=torch.cat([b.group for b in batches]),
            prompt_ids=[p for b in batches for p in b.prompt_ids],
            response_ids=padded("response_ids", pad_id),
            attention_mask=padded("attention_mask", 0.0),
            loss_mask=padded("loss_mask", 0.0),
            logprobs=padded("logprobs", 0.0),
            texts=[s for b in batches for s in b.texts],
            tool_calls=torch.cat([b.tool_calls for b in batches]),
            truncated=torch.cat([b.truncated for b in batches]),
            pad_id=pad_id,
        )


def minibatches(
    n: int, epochs: int, mini_batches: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Row indices of ``n`` responses for each optimiser step: ``epochs`` passes, each split
    into ``mini_batches`` parts (shuffled with ``generator`` when there are several, in
    order otherwise; a part may be empty when ``mini_batches > n``)."""
    for _ in range(epochs):
        if mini_batches > 1:
            order = torch.randperm(n, generator=generator, device=generator.device).cpu()
        else:
            order = torch.arange(n)
        yield from torch.tensor_split(order, mini_batches)
