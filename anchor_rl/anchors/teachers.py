"""Teachers: where PVPO gets a correct trajectory for a prompt the reference never solves.

A teacher returns, per prompt, a completion the task's verifier accepts, as the POLICY's
token ids, with per-token log-probs ``log pi_gt`` that the trainer uses as the "old"
log-probs of that trajectory's importance ratio ``pi_theta / pi_gt``. ``pi_gt`` is the
probability under the distribution the trajectory was drawn from (its temperature and
top-p included), the quantity an importance ratio needs. Three kinds:

- :class:`OracleTeacher`: the task's reference solution (``task.trace``). Nothing sampled
  it: a deterministic oracle writes its trace with probability 1, so ``log pi_gt = 0``
  (``oracle``) and the ratio is ``pi_theta`` itself -- never above 1, so a clip at
  ``1 + eps_high`` never stops the policy from learning the trace, while the gradient
  ``A * pi_theta * grad log pi_theta`` is small on tokens the policy finds unlikely. The
  variant ``oracle:reference`` scores the trace with the reference policy at the rollout
  temperature instead: the ratio then starts near 1 and the clip stops a token once the
  policy gives it ``(1 + eps_high)`` times the reference's probability (cumulatively over
  the run, since pi_gt never changes).
- :class:`HFTeacher`: a (larger) local Hugging Face model. Samples up to ``tries``
  responses per prompt with the rollout engine and keeps the first correct one, with the
  log-probs the engine drew its tokens with (the teacher at the sampling temperature and
  top-p). Its vocabulary must equal the policy's (else a :class:`TokenizerMismatchError`).
- :class:`OpenAITeacher`: an OpenAI-compatible completions endpoint that returns token
  log-probs (vLLM, SGLang, ...). They must be the sampled distribution's (vLLM: serve with
  ``--logprobs-mode processed_logprobs``; its default reports the raw model's). The
  returned tokens must be exactly the policy's tokenisation of the returned text, else a
  :class:`TokenizerMismatchError`.

A teacher's ``settings`` (sampling, temperature, log-prob kind) are part of its store key.
Tool turns: tool output tokens carry ``loss_mask`` 0 and log-prob 0, like in rollouts.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from anchor_rl.anchors.keys import (
    AnchorKey,
    canonical_json,
    fingerprint_model,
    fingerprint_tokenizer,
    sampling_settings,
)
from anchor_rl.anchors.presample import task_params
from anchor_rl.anchors.store import TeacherTrajectory
from anchor_rl.batch import RolloutBatch
from anchor_rl.models.scoring import token_logprobs
from anchor_rl.models.tokenizer import encode_completion, encode_prompt
from anchor_rl.rollout.engine import Request, group_requests, make_engine, request_seed
from anchor_rl.rollout.types import SamplingParams
from anchor_rl.tasks.base import Record, Task

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


class TokenizerMismatchError(ValueError):
    """A teacher's tokens cannot be expressed as the policy's tokens."""


@runtime_checkable
class Teacher(Protocol):
    """What the group-sampling filter needs from a teacher.

    name: short kind name (``hf``, ``http``, ``oracle``).
    fingerprint: identity of the model or source that writes the trajectories.
    settings: JSON-serialisable settings that change its output (sampling, tries).
    tries: most samples per prompt.
    generates: whether its trajectories are model generations (counted as rollouts:
        ``tries`` per prompt asked, fewer when it succeeds early); False for the oracle,
        which writes the task's reference solution.
    policy_tokenizer: the tokenizer the trajectories' ids are in.
    """

    name: str
    fingerprint: str
    settings: dict[str, Any]
    tries: int
    generates: bool
    policy_tokenizer: PreTrainedTokenizerBase

    def solve(self, records: Sequence[Record]) -> list[TeacherTrajectory | None]:
        """A verified trajectory per record, or None where the teacher failed ``tries`` times."""
        ...


def teacher_key(teacher: Teacher, task_id: str) -> AnchorKey:
    """The store key of a teacher's trajectories on a task, in the teacher's policy tokenizer."""
    return AnchorKey(
        model=teacher.fingerprint,
        tokenizer=fingerprint_tokenizer(teacher.policy_tokenizer),
        sampling=teacher.settings,
        task=task_id,
        tag=f"teacher/{teacher.name}",
    )


def tokenizer_name(tokenizer: PreTrainedTokenizerBase) -> str:
    """A readable name: the path it was loaded from (if any), class and vocabulary size."""
    where = getattr(tokenizer, "name_or_path", "") or "built in memory"
    return f"{where!r} ({type(tokenizer).__name__}, {len(tokenizer)} tokens)"


def require_same_vocab(
    teacher: PreTrainedTokenizerBase, policy: PreTrainedTokenizerBase, who: str
) -> None:
    """Raise :class:`TokenizerMismatchError` unless both tokenizers map the same strings to the same ids."""
    if teacher.get_vocab() != policy.get_vocab():
        raise TokenizerMismatchError(
            f"the {who} tokenizer {tokenizer_name(teacher)} has a different vocabulary from the policy "
            f"tokenizer {tokenizer_name(policy)}; a {who} model can only score its own token ids, and a "
            "teacher trajectory must be in the policy's ids: use a teacher that shares the policy's tokenizer"
        )


def _pad(rows: Sequence[Sequence[float]], value: float, dtype: torch.dtype) -> Tensor:
    """Right-pad ragged rows into a ``[len(rows), max(1, longest)]`` tensor."""
    out = torch.full((len(rows), max([1, *(len(r) for r in rows)])), value, dtype=dtype)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=dtype)
    return out


def _tool_blocks(mask: Sequence[float]) -> int:
    """Runs of tool-output tokens (mask 0) in a loss mask."""
    return sum(
        1 for prev, cur in zip([1.0, *mask[:-1]], mask, strict=True) if prev != 0 and cur == 0
    )


def _rows_batch(
    prompt_ids: Sequence[Sequence[int]],
    ids: Sequence[Sequence[int]],
    masks: Sequence[Sequence[float]],
    logprobs: Sequence[Sequence[float]],
    texts: Sequence[str],
    group: Sequence[int] | Tensor,
    pad_id: int,
) -> RolloutBatch:
    if not ids:
        raise ValueError("a batch needs at least one response")
    return RolloutBatch(
        group=torch.as_tensor(group, dtype=torch.long),
        prompt_ids=[list(p) for p in prompt_ids],
        response_ids=_pad(ids, pad_id, torch.long),
        attention_mask=_pad([[1.0] * len(i) for i in ids], 0.0, torch.float32),
        loss_mask=_pad(masks, 0.0, torch.float32),
        logprobs=_pad(logprobs, 0.0, torch.float32),
        texts=list(texts),
        tool_calls=torch.as_tensor([_tool_blocks(m) for m in masks], dtype=torch.long),
        truncated=torch.zeros(len(ids), dtype=torch.bool),
        pad_id=pad_id,
    )


def teacher_batch(
    trajectories: Sequence[TeacherTrajectory],
    prompt_ids: Sequence[Sequence[int]],
    group: Sequence[int] | Tensor,
    pad_id: int,
) -> RolloutBatch:
    """Teacher trajectories as a ``RolloutBatch`` (B = len(trajectories)) to join the policy's rollouts.

    ``logprobs`` holds the teacher's log pi_gt, so a trainer that takes the ratio against
    ``batch.logprobs`` takes it against pi_gt for these rows, as PVPO prescribes.
    ``prompt_ids[i]`` is the policy's tokenised prompt of row i, ``group[i]`` its group.
    ``tool_calls`` counts the tool-output blocks; ``truncated`` is False (they were verified).
    """
    if not len(trajectories) == len(prompt_ids) == len(group):
        raise ValueError("trajectories, prompt_ids and group must have the same length")
    return _rows_batch(
        prompt_ids,
        [t.token_ids.tolist() for t in trajectories],
        [t.loss_mask.tolist() for t in trajectories],
        [t.logprobs.tolist() for t in trajectories],
        [t.text for t in trajectories],
        group,
        pad_id,
    )


def score_responses(
    model: PreTrainedModel,
    prompt_ids: Sequence[Sequence[int]],
    responses: Sequence[tuple[Sequence[int], Sequence[float]]],
    pad_id: int,
    micro_batch: int | None = None,
    temperature: float = 1.0,
) -> list[Tensor]:
    """Per-token log-probs of each ``(ids, loss_mask)`` response under ``model`` at ``temperature``.

    Returns one FloatTensor[L_i] per response on the CPU, 0 where the mask is 0.
    """
    ids = [list(r[0]) for r in responses]
    masks = [list(r[1]) for r in responses]
    zeros = [[0.0] * len(i) for i in ids]
    batch = _rows_batch(prompt_ids, ids, masks, zeros, [""] * len(ids), range(len(ids)), pad_id)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logp, _ = token_logprobs(model, batch, micro_batch=micro_batch, temperature=temperature)
    finally:
        model.train(was_training)
    logp = (logp.cpu() * batch.loss_mask).float()
    return [logp[i, : len(ids[i])].clone() for i in range(len(ids))]


class OracleTeacher:
    """The task's reference solution (``task.trace``) as a teacher trajectory.

    The trace is tokenised with the policy tokenizer segment by segment (tool result
    blocks get loss mask 0). Its log-probs are 0 (``log pi_gt`` of a deterministic writer)
    unless ``scorer`` is given: then they are the scorer's at ``temperature`` (the
    ``oracle:reference`` teacher scores with the reference at the rollout temperature;
    top-p is not applied, a trace may hold tokens outside a nucleus). The scorer's
    vocabulary must equal the policy's. A trace the task's verifier rejects counts as
    unsolved. See the module docstring for what each choice does to the ratio.
    """

    name = "oracle"
    tries = 1
    generates = False

    def __init__(
        self,
        task: Task,
        policy_tokenizer: PreTrainedTokenizerBase,
        scorer: PreTrainedModel | None = None,
        scorer_tokenizer: PreTrainedTokenizerBase | None = None,
        temperature: float = 1.0,
        micro_batch: int | None = None,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.task, self.policy_tokenizer, self.scorer = task, policy_tokenizer, scorer
        self.scorer_tokenizer = scorer_tokenizer or policy_tokenizer
        self.temperature, self.micro_batch = temperature, micro_batch
        if scorer is None:
            self.fingerprint = "oracle"
            self.settings: dict[str, Any] = {"logprobs": "deterministic"}
        else:
            require_same_vocab(self.scorer_tokenizer, policy_tokenizer, "scoring")
            self.fingerprint = "oracle:" + fingerprint_model(scorer)
            self.settings = {
                "logprobs": "scorer",
                "temperature": temperature,
                "scorer_tokenizer": fingerprint_tokenizer(self.scorer_tokenizer),
            }

    def solve(self, records: Sequence[Record]) -> list[TeacherTrajectory | None]:
        """The trace of each record with its log-probs, or None where the verifier rejects it."""
        texts = [self.task.trace(r) for r in records]
        ok = [
            i
            for i, (r, text) in enumerate(zip(records, texts, strict=True))
            if self.task.correct(text, r)
        ]
        out: list[TeacherTrajectory | None] = [None] * len(records)
        if not ok:
            return out
        encoded = []
        for i in ok:
            ids, policy = encode_completion(self.policy_tokenizer, texts[i], bool(self.task.tools))
            encoded.append((ids, [float(p) for p in policy]))
        if self.scorer is None:
            logps = [torch.zeros(len(ids)) for ids, _ in encoded]
        else:
            prompts = [
                encode_prompt(self.scorer_tokenizer, records[i].prompt, self.task.instruction)
                for i in ok
            ]
            logps = score_responses(
                self.scorer, prompts, encoded, self.policy_tokenizer.pad_token_id,
                self.micro_batch, self.temperature,
            )  # fmt: skip
        for i, (ids, mask), lp in zip(ok, encoded, logps, strict=True):
            out[i] = TeacherTrajectory(
                prompt_id=records[i].id,
                token_ids=torch.tensor(ids, dtype=torch.long),
                logprobs=lp,
                loss_mask=torch.tensor(mask),
                text=texts[i],
                reward=self.task.reward(texts[i], records[i]),
                teacher=self.name,
            )
        return out


class HFTeacher:
    """A local Hugging Face causal LM that samples until the task's verifier accepts.

    Rounds of ``per_round`` samples per unsolved prompt (default: all ``tries`` at once)
    until each prompt has a correct sample or ``tries`` samples are spent. The first
    correct sample is kept with the log-probs the engine drew its tokens with: the
    teacher's distribution at ``params``' temperature and top-p, the one it sampled from.
    """

    name = "hf"
    generates = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        task: Task,
        policy_tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        tries: int = 8,
        per_round: int | None = None,
        seed: int = 0,
    ) -> None:
        require_same_vocab(tokenizer, policy_tokenizer, "teacher")
        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        self.model, self.tokenizer, self.task = model, tokenizer, task
        self.policy_tokenizer = policy_tokenizer
        self.engine = make_engine("hf", model, tokenizer)
        self.params = task_params(params, task)
        self.tries, self.per_round = tries, min(per_round or tries, tries)
        self.seed = seed
        self.fingerprint = "hf:" + fingerprint_model(model)
        self.settings = {
            "logprobs": "sampled",
            "sampling": sampling_settings(self.params),
            "tokenizer": fingerprint_tokenizer(tokenizer),
            "tries": tries,
            "per_round": self.per_round,
            "seed": seed,
        }

    def solve(self, records: Sequence[Record]) -> list[TeacherTrajectory | None]:
        """The first correct sample of each record within ``tries``, or None."""
        out: list[TeacherTrajectory | None] = [None] * len(records)
        pending, used = list(range(len(records))), 0
        while pending and used < self.tries:
            n = min(self.per_round, self.tries - used)
            requests = group_requests(
                [records[i].prompt for i in pending], [records[i].id for i in pending], n,
                "teacher", self.seed, first=used,
            )  # fmt: skip
            batch = self.engine.rollout(
                requests, self.params, tools=self.task.tools or None,
                instruction=self.task.instruction,
            )  # fmt: skip
            chosen: list[tuple[int, int, int]] = []  # (record index, batch row, tries so far)
            for j, i in enumerate(pending):
                for k in range(n):
                    row = j * n + k
                    if _trainable(batch, row) and self.task.correct(batch.texts[row], records[i]):
                        chosen.append((i, row, used + k + 1))
                        break
            used += n
            if chosen:
                self._keep(records, batch, chosen, out)
            solved = {i for i, _, _ in chosen}
            pending = [i for i in pending if i not in solved]
        return out

    def _keep(
        self,
        records: Sequence[Record],
        batch: RolloutBatch,
        chosen: Sequence[tuple[int, int, int]],
        out: list[TeacherTrajectory | None],
    ) -> None:
        for i, row, tries in chosen:
            out[i] = _row_trajectory(batch, row, records[i], self.task, self.name, tries)


class OpenAITeacher:
    """A teacher behind an OpenAI-compatible ``/completions`` endpoint that returns log-probs.

    It samples through the ``http`` engine (:class:`~anchor_rl.rollout.http.HTTPEngine`):
    the prompt sent is the policy's own prompt (its chat template rendered by
    ``encode_prompt``), as token ids, so the teacher conditions on what the policy sees.
    Each turn asks for ``logprobs: 1`` and the task's stop strings; the stop string must
    be kept in the output (``include_stop_str_in_output``, a vLLM option, is sent by
    default through ``extra_body``; SGLang calls it ``no_stop_trim``). The returned
    tokens, either ``token_id:N`` (vLLM ``return_tokens_as_token_ids``, which is asked for)
    or strings, must be the policy's tokens of the returned text, else a
    :class:`TokenizerMismatchError`. Tool calls run locally between turns with the task's
    tools, as in the rollout engine; later turns send prompt + response so far.

    One sample per unsolved record per round, ``concurrency`` requests at a time, up to
    ``tries`` rounds. Sample ``k`` of a record is seeded by ``("teacher", seed, record id,
    k)`` when ``seed`` is given (``anchor-rl serve`` then samples reproducibly; other
    servers get it as ``seed``), else by a fresh random seed. ``timeout`` is per HTTP
    request; ``retries`` retry connection errors, timeouts and 5xx answers with back-off.

    ``fingerprint`` defaults to the URL and model name: a server that swaps weights under
    the same name is not detected; pass ``model_fingerprint`` to pin a content hash.
    Only loopback or trusted endpoints: prompts and tool results are sent as they are.
    """

    name = "http"
    generates = True

    def __init__(
        self,
        base_url: str,
        model: str,
        task: Task,
        policy_tokenizer: PreTrainedTokenizerBase,
        params: SamplingParams,
        tries: int = 4,
        api_key: str | None = None,
        timeout: float = 60.0,
        concurrency: int = 4,
        extra_body: Mapping[str, Any] | None = None,
        seed: int | None = None,
        model_fingerprint: str | None = None,
        retries: int = 3,
    ) -> None:
        from anchor_rl.rollout.http import HTTPEngine

        if tries < 1:
            raise ValueError(f"tries must be >= 1, got {tries}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {concurrency}")
        self.url = base_url.rstrip("/") + "/completions"
        self.model, self.task, self.policy_tokenizer = model, task, policy_tokenizer
        self.params = task_params(params, task)
        self.tries, self.seed = tries, seed
        self.extra_body = (
            dict(extra_body) if extra_body is not None else {"include_stop_str_in_output": True}
        )
        self.engine = HTTPEngine(
            policy_tokenizer, base_url, model, timeout=timeout, retries=retries, api_key=api_key,
            concurrency=concurrency, extra_body=self.extra_body,
        )  # fmt: skip
        self.fingerprint = model_fingerprint or "http:" + canonical_json(
            {"url": self.url, "model": model}
        )
        self.settings = {
            "logprobs": "server",
            "sampling": sampling_settings(self.params),
            "tries": tries,
            "extra_body": self.extra_body,
            "seed": seed,
        }

    def _seed(self, record: Record, attempt: int) -> int:
        if self.seed is None:
            return secrets.randbits(63)
        return request_seed("teacher", self.seed, record.id, attempt)

    def _rollout(self, requests: Sequence[Request]) -> RolloutBatch:
        from anchor_rl.rollout.http import TokenMismatchError
        from anchor_rl.rollout.http_client import ServerUnreachableError

        try:
            return self.engine.rollout(
                requests, self.params, tools=self.task.tools or None,
                instruction=self.task.instruction,
            )  # fmt: skip
        except TokenMismatchError as exc:
            raise TokenizerMismatchError(
                f"the teacher endpoint {self.url} (model {self.model!r}) tokenises its text differently from the "
                f"policy tokenizer {tokenizer_name(self.policy_tokenizer)}: {exc.detail}. "
                "A teacher trajectory must be in the policy's tokens: serve a teacher with the policy's tokenizer"
            ) from exc
        except ServerUnreachableError as exc:
            raise ConnectionError(f"cannot reach the teacher endpoint {self.url}: {exc}") from exc

    def solve(self, records: Sequence[Record]) -> list[TeacherTrajectory | None]:
        """Up to ``tries`` samples per record (one per round for the records still unsolved);
        the first the verifier accepts, or None."""
        out: list[TeacherTrajectory | None] = [None] * len(records)
        pending, name = list(range(len(records))), f"{self.name}:{self.model}"
        for attempt in range(self.tries):
            if not pending:
                break
            requests = [
                Request(records[i].prompt, self._seed(records[i], attempt), group=j)
                for j, i in enumerate(pending)
            ]
            batch = self._rollout(requests)
            solved = set()
            for row, i in enumerate(pending):
                if _trainable(batch, row) and self.task.correct(batch.texts[row], records[i]):
                    out[i] = _row_trajectory(batch, row, records[i], self.task, name, attempt + 1)
                    solved.add(i)
            pending = [i for i in pending if i not in solved]
        return out


TEACHER_SPECS = ("oracle", "oracle:reference", "hf:MODEL", "http:URL")


def _row_trajectory(
    batch: RolloutBatch, row: int, record: Record, task: Task, teacher: str, tries: int
) -> TeacherTrajectory:
    """Row ``row`` of a sampled ``batch`` as ``record``'s trajectory, scored by ``task``."""
    length = int(batch.attention_mask[row].sum())
    return TeacherTrajectory(
        prompt_id=record.id,
        token_ids=batch.response_ids[row, :length].clone(),
        logprobs=batch.logprobs[row, :length].clone(),
        loss_mask=batch.loss_mask[row, :length].clone(),
        text=batch.texts[row],
        reward=task.reward(batch.texts[row], record),
        teacher=teacher,
        tries=tries,
    )


def _trainable(batch: RolloutBatch, row: int) -> bool:
    """Whether a sampled response can be a trajectory: at least one token, one of them the
    policy's (an empty answer a lenient verifier accepts teaches nothing)."""
    return bool(batch.attention_mask[row].any()) and bool(batch.loss_mask[row].any())


TEACHER_SEED = 0
"""Seed of the sampling teachers' draws wherever trajectories are made for training (the
trainer, ``anchor-rl anchors filter``): part of the teacher key, so trajectories one makes
are the ones the other looks up."""


def make_teacher(
    spec: str,
    task: Task,
    policy_tokenizer: PreTrainedTokenizerBase,
    reference: PreTrainedModel | None,
    params: SamplingParams,
    *,
    load_model: Callable[[str], tuple[PreTrainedModel, PreTrainedTokenizerBase]],
    tries: int,
    seed: int = 0,
    teacher_model: str | None = None,
) -> Teacher:
    """The teacher a spec names (:data:`TEACHER_SPECS`).

    ``oracle`` (log pi_gt = 0); ``oracle:reference`` (the trace scored by ``reference`` at
    ``params.temperature``); ``hf:MODEL`` (``load_model(MODEL)`` samples, up to ``tries``);
    ``http:URL`` (an OpenAI-compatible endpoint serving ``teacher_model``). The sampling
    teachers are seeded by ``seed`` (reproducible draws). ValueError for anything else.
    """
    kind, _, target = spec.partition(":")
    if spec == "oracle":
        return OracleTeacher(task, policy_tokenizer)
    if spec == "oracle:reference":
        if reference is None:
            raise ValueError("the oracle:reference teacher needs the reference model")
        return OracleTeacher(task, policy_tokenizer, reference, temperature=params.temperature)
    if kind == "hf" and target:
        model, tokenizer = load_model(target)
        return HFTeacher(model, tokenizer, task, policy_tokenizer, params, tries=tries, seed=seed)
    if kind == "http" and target:
        if not teacher_model:
            raise ValueError(f"the teacher {spec!r} needs the served model's name")
        return OpenAITeacher(
            target, teacher_model, task, policy_tokenizer, params, tries=tries, seed=seed
        )
    raise ValueError(f"unknown teacher {spec!r}; use one of {', '.join(TEACHER_SPECS)}")
