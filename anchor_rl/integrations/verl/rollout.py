"""Rollouts through verl's own machinery: presampling, V0.5's top-ups, the teacher agent loop.

verl 0.9.1's v1 trainer samples by putting prompt rows into its TransferQueue (partition
``train``, one entry per ``uid``) and handing them to its ``AgentLoopManager``, whose workers
run ``rollout.n`` agent loops per prompt (or the row's own ``__rollout_n__``: verl's hook for
a per-prompt budget) against the LLM servers and write each trajectory back under
``{uid}_{session}_{output}``. Everything here uses that path, so presampled rollouts,
top-ups and teacher rows are sampled, rendered and scored exactly as training rollouts
are. It needs verl's servers (GPUs): nothing here runs on a CPU-only machine.

* :func:`run_rollouts`: submit rows with their budgets, wait for them, return the
  trajectory keys per prompt;
* :class:`VerlSampler`: :func:`anchor_rl.anchors.presample.presample`'s sampler over it;
* :func:`top_up`: V0.5's adaptive budget on a sampled batch;
* :class:`TeacherAgentLoop` (``anchor_rl_teacher``): the single-turn agent loop that returns a
  prompt's teacher trajectory for its last session instead of sampling it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import numpy as np
import torch
import transfer_queue as tq
from tensordict import TensorDict
from torch import Tensor
from transfer_queue import KVBatchMeta
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.utils import tensordict_utils as tu

from anchor_rl.integrations.verl import AGENT_LOOPS
from anchor_rl.integrations.verl.data import as_list, batch_row_keys
from anchor_rl.methods.groups import first_rows, group_index
from anchor_rl.tasks.base import Record

Trainer = Any
"""An :class:`~anchor_rl.integrations.verl.trainer.AnchorRLTrainer` (not imported: the trainer
module imports this one)."""

__all__ = [
    "TEACHER_FIELD",
    "TEACHER_LOGPROBS",
    "TeacherAgentLoop",
    "VerlSampler",
    "run_rollouts",
    "session_rewards",
    "top_up",
    "with_budget",
]

PARTITION = "train"
TEACHER_FIELD = "anchor_rl_teacher"
"""The per-row field carrying a prompt's teacher trajectory to the agent loop (``{}`` if none),
and the ``extra_fields`` flag of the trajectory the loop injected."""
TEACHER_LOGPROBS = "anchor_rl_teacher_logprobs"
"""The ``extra_fields`` entry holding an injected trajectory's teacher log-probs ``log pi_gt``."""
POLL_SECONDS = 0.5


def with_budget(
    rows: TensorDict, n: Sequence[int], global_steps: int
) -> tuple[TensorDict, list[str]]:
    """A copy of prompt ``rows`` (verl's batch layout) with fresh uids and ``__rollout_n__``;
    returns it and the uids."""
    uids = [str(uuid.uuid4()) for _ in range(len(rows))]
    batch = rows.clone()
    tu.assign_non_tensor_stack(batch, "uid", uids)
    batch["__rollout_n__"] = torch.as_tensor(list(n), dtype=torch.long)
    tu.assign_non_tensor_data(batch, "global_steps", global_steps)
    return batch, uids


def _session(key: str) -> tuple[int, int]:
    _, session, index = key.rsplit("_", 2)
    return int(session), int(index)


def wait_for(
    uids: Sequence[str], timeout: float | None = None
) -> dict[str, list[tuple[str, dict]]]:
    """Wait until every prompt ``uid`` is finished; its trajectories ``[(key, tag)]`` per uid,
    in session order. A failed prompt (or the timeout) is a RuntimeError."""
    started, want = time.monotonic(), set(uids)
    while True:
        items = (tq.kv_list(PARTITION) or {}).get(PARTITION, {})
        status = {u: items.get(u, {}).get("status") for u in want}
        failed = sorted(u for u, s in status.items() if s == "failure")
        if failed:
            raise RuntimeError(
                f"verl's rollout failed for {len(failed)} prompt(s) (first {failed[0]})"
            )
        if all(s == "finished" for s in status.values()):
            break
        if timeout is not None and time.monotonic() - started > timeout:
            raise RuntimeError(f"verl's rollout did not finish {len(want)} prompts in {timeout} s")
        time.sleep(POLL_SECONDS)
    out: dict[str, list[tuple[str, dict]]] = {u: [] for u in uids}
    for key, tag in items.items():
        if tag.get("is_prompt", False):
            continue
        uid = key.rsplit("_", 2)[0]
        if uid in out:
            out[uid].append((key, dict(tag)))
    for trajectories in out.values():
        trajectories.sort(key=lambda kt: _session(kt[0]))
    return out


def run_rollouts(
    trainer: Trainer, rows: TensorDict, n: Sequence[int]
) -> tuple[list[str], dict[str, list[tuple[str, dict]]]]:
    """Sample ``n[i]`` rollouts of prompt row ``i`` through verl (its TransferQueue, agent loops
    and servers, with the training sampling settings); returns the uids and trajectories."""
    batch, uids = with_budget(rows, n, trainer.global_steps)
    trainer._submit_batch_to_rollout(batch)
    return uids, wait_for(uids)


def session_rewards(keys: Sequence[str]) -> Tensor:
    """FloatTensor[len(keys)]: each trajectory's outcome (its ``rm_scores`` summed)."""
    if not keys:
        return torch.zeros(0)
    data = tq.kv_batch_get(keys=list(keys), partition_id=PARTITION, select_fields=["rm_scores"])
    return data["rm_scores"].to_padded_tensor(0.0).float().sum(dim=-1)


def _final_outputs(trajectories: Sequence[tuple[str, dict]]) -> list[str]:
    """The last output key of each session (multi-output agent loops score the final one)."""
    final: dict[int, tuple[int, str]] = {}
    for key, _ in trajectories:
        session, index = _session(key)
        if session not in final or final[session][0] < index:
            final[session] = (index, key)
    return [final[s][1] for s in sorted(final)]


class VerlSampler:
    """:data:`anchor_rl.anchors.presample.Sampler` over verl's rollout: ``n`` rollouts of each
    record, scored by verl's reward; correct when the reward reaches ``threshold``.

    ``rows(records)`` returns the records' prompt rows in verl's batch layout. verl's
    servers do not take a per-request seed, so ``first`` and ``seed`` only number the
    rollouts (the anchors rest on the sampled rewards, not on replayable seeds).
    """

    def __init__(
        self,
        trainer: Trainer,
        rows: Callable[[Sequence[Record]], TensorDict],
        threshold: float,
    ) -> None:
        self.trainer, self.rows, self.threshold = trainer, rows, threshold

    def __call__(
        self, records: Sequence[Record], n: int, first: Sequence[int], seed: Hashable
    ) -> tuple[Tensor, Tensor]:
        uids, groups = run_rollouts(self.trainer, self.rows(records), [n] * len(records))
        keys = [_final_outputs(groups[u]) for u in uids]
        everything = [k for u in uids for k, _ in groups[u]]
        try:
            short = [r.id for r, k in zip(records, keys, strict=True) if len(k) != n]
            if short:
                raise RuntimeError(f"{len(short)} prompt(s) came back without {n} rollouts")
            rewards = session_rewards([k for ks in keys for k in ks]).reshape(len(records), n)
        finally:
            tq.kv_clear(keys=everything + uids, partition_id=PARTITION)
        return rewards.double(), rewards >= self.threshold


def top_up(trainer: Trainer, batch: KVBatchMeta) -> KVBatchMeta:
    """V0.5 on a sampled batch: the prior's prediction and the first fusion, then (adaptive
    budget) up to ``top_up_rounds`` rounds of extra rollouts for the prompts whose rollouts
    reject the prior. The top-up trajectories join the batch under their prompt's uid."""
    state, vc = trainer.state, trainer.method_cfg.v05
    fields = tq.kv_batch_get(
        keys=batch.keys,
        partition_id=batch.partition_id,
        select_fields=["uid", "rm_scores", "raw_prompt", "reward_model", "data_source"],
    )
    uids = [str(u) for u in as_list(fields["uid"])]
    multi = [k for k in batch.keys if _session(k)[1] > 0]
    if multi:
        raise ValueError(
            "anchor_rl.method=v05 fuses one reward per rollout: agent loops with several outputs "
            f"per session are not supported (e.g. {multi[0]})"
        )
    rewards = fields["rm_scores"].to_padded_tensor(0.0).float().sum(dim=-1)
    group, order = group_index(uids)
    keys = batch_row_keys(fields, first_rows(group, len(order)))
    plan = state.v05_plan(order, keys, rewards, group)
    if vc.budget != "adaptive":
        return batch
    all_keys, all_tags = list(batch.keys), list(batch.tags)
    for _ in range(vc.top_up_rounds):
        extra = state.v05_extra(rewards, group)
        wanted = extra.nonzero().flatten().tolist()
        if not wanted:
            break
        rows = trainer.step_rows([order[g] for g in wanted])
        new_uids, groups = run_rollouts(trainer, rows, [int(extra[g]) for g in wanted])
        new_keys, new_tags, new_group = [], [], []
        for g, uid in zip(wanted, new_uids, strict=True):
            for key, tag in groups[uid]:
                new_keys.append(key)
                new_tags.append(tag)
                new_group.append(g)
        tq.kv_clear(keys=new_uids, partition_id=PARTITION)  # the prompt entries, not the rows
        if new_keys:
            tq.kv_batch_put(
                keys=new_keys, partition_id=PARTITION,
                fields=tu.get_tensordict({"uid": np.array([order[g] for g in new_group], dtype=object)}),
            )  # fmt: skip
            all_keys += new_keys
            all_tags += new_tags
            rewards = torch.cat([rewards, session_rewards(new_keys)])
            group = torch.cat([group, torch.tensor(new_group, dtype=torch.long)])
        plan.rounds += 1
    return KVBatchMeta(
        keys=all_keys, tags=all_tags, partition_id=batch.partition_id, fields=batch.fields,
        extra_info=batch.extra_info,
    )  # fmt: skip


def teacher_payload(
    token_ids: Sequence[int], logprobs: Sequence[float], mask: Sequence[float], session: int
) -> dict[str, Any]:
    """The per-row teacher field: the trajectory and the session it replaces."""
    return {
        "token_ids": [int(t) for t in token_ids],
        "logprobs": [float(x) for x in logprobs],
        "mask": [int(m) for m in mask],
        "session": int(session),
    }


@register(AGENT_LOOPS[0])
class TeacherAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop, except that the session a prompt's teacher payload names
    (the last of its ``rollout.n``) returns the teacher trajectory instead of sampling: the
    prompt rendered as for any rollout, the teacher's tokens (cut at ``response_length``) and
    log-probs, flagged ``extra_fields["anchor_rl_teacher"]``. verl's reward then scores it in
    the worker like any rollout."""

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        teacher = kwargs.get(TEACHER_FIELD) or {}
        if not teacher or int(kwargs.get("session_id", -1)) != int(teacher["session"]):
            return await super().run(sampling_params, **kwargs)
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        n = self.response_length
        logprobs = [float(x) for x in teacher["logprobs"]][:n]
        steps = int(kwargs.get("global_steps", 1)) - 1
        return AgentLoopOutput(
            prompt_ids=list(prompt_ids),
            response_ids=list(teacher["token_ids"])[:n],
            response_mask=list(teacher["mask"])[:n],
            # as for any rollout: log-probs only when the rollout reports them
            response_logprobs=logprobs if self.rollout_config.calculate_log_probs else None,
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={
                TEACHER_FIELD: True,
                TEACHER_LOGPROBS: logprobs,
                "turn_scores": [],
                "tool_rewards": [],
                "min_global_steps": steps,
                "max_global_steps": steps,
            },
        )
