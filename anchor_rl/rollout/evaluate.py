"""Sampling-based evaluation: avg@k, unbiased pass@k and the per-prompt accuracy histogram.

For P prompts with k samples each, ``acc_p = c_p / k`` (c_p correct samples);
avg@k is the mean of ``acc_p``; pass@j (j <= k) uses the unbiased estimator
``1 - C(k - c, j) / C(k, j)`` averaged over prompts (Chen et al., 2021). The histogram
gives the fraction of prompts with acc = 0, 0 < acc < 1 and acc = 1, the three classes
PVPO's group sampling treats differently.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from anchor_rl.progress import Progress
from anchor_rl.rewards.extract import extract_answer
from anchor_rl.rollout.engine import Engine, group_requests, make_engine
from anchor_rl.rollout.types import SamplingParams

if TYPE_CHECKING:
    from anchor_rl.tasks.base import Record, Split, Task


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased probability that at least one of k draws (without replacement) from n
    samples with c correct is correct: ``1 - C(n - c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    ratio = 1.0  # C(n-c, k) / C(n, k) = prod_{i=n-c+1}^{n} (1 - k / i)
    for i in range(n - c + 1, n + 1):
        ratio *= 1.0 - k / i
    return 1.0 - ratio


def pass_ks(k: int) -> list[int]:
    """The j reported as pass@j: powers of two below k, and k."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i < k} | {k})


def accuracy_metrics(correct: Sequence[int], k: int) -> dict[str, float]:
    """avg@k, pass@j and the histogram from correct counts per prompt (each in 0..k)."""
    if not correct:
        raise ValueError("no prompts to summarise")
    p = len(correct)
    metrics = {f"avg@{k}": sum(correct) / (p * k)}
    for j in pass_ks(k):
        metrics[f"pass@{j}"] = sum(pass_at_k(k, c, j) for c in correct) / p
    metrics["acc=0"] = sum(c == 0 for c in correct) / p
    metrics["0<acc<1"] = sum(0 < c < k for c in correct) / p
    metrics["acc=1"] = sum(c == k for c in correct) / p
    return metrics


def majority_correct(texts: Sequence[str], correct: Sequence[bool]) -> bool:
    """Whether the majority answer of ``texts`` is correct (maj@k for one prompt).

    Answers are :func:`~anchor_rl.rewards.extract.extract_answer` of each text, stripped;
    texts without one do not vote. The most common answer wins, a tie going to the answer
    seen first; it is correct when the first text that gave it was (``correct[i]`` is the
    task's verdict on ``texts[i]``). No answer at all: False.
    """
    answers = [extract_answer(t) for t in texts]
    votes = Counter(a.strip() for a in answers if a is not None)
    if not votes:
        return False
    top = max(votes.values())
    first = {}
    for i, a in enumerate(answers):
        if a is not None:
            first.setdefault(a.strip(), i)
    winner = min((a for a, n in votes.items() if n == top), key=first.__getitem__)
    return bool(correct[first[winner]])


def by_difficulty(records: Sequence[Record], correct: Sequence[int], k: int) -> dict[str, float]:
    """avg@k per ``record.meta["difficulty"]`` (records without one are left out), keys as
    strings in ascending difficulty."""
    groups: dict[Any, list[int]] = defaultdict(list)
    for record, c in zip(records, correct, strict=True):
        if "difficulty" in record.meta:
            groups[record.meta["difficulty"]].append(c)
    return {str(d): sum(cs) / (len(cs) * k) for d, cs in sorted(groups.items())}


def trace_budget(tokenizer: PreTrainedTokenizerBase, task: Task, records: Sequence[Record]) -> int:
    """A response budget sized from the task's reference traces: 1.5 x the longest trace of
    ``records`` in tokens, rounded up to a multiple of 32. Raises NotImplementedError for a
    task without traces."""
    longest = max(len(tokenizer.encode(task.trace(r), add_special_tokens=False)) for r in records)
    return max(32, 32 * math.ceil(1.5 * longest / 32))


def evaluate(
    engine: Engine,
    task: Task,
    split: Split = "test",
    k: int = 8,
    params: SamplingParams | None = None,
    limit: int | None = None,
    seed: Hashable = 0,
    chunk: int = 256,
    progress: bool = False,
    records: Sequence[Record] | None = None,
) -> dict[str, Any]:
    """Sample k responses for each of the first ``limit`` records of ``split`` and score them.

    ``records``: evaluate these instead of the split's (a validation slice, for example);
    ``split`` then only names them in the result and in the samples' seeds.

    ``params`` defaults to ``SamplingParams(stop=task.stop)``; the task's tools are used.
    Sample ``j`` of record ``r`` is seeded by ``("eval", seed, split, r.id, j)``, so the
    figures do not depend on ``chunk`` (about how many responses each engine call samples).
    Returns the ``accuracy_metrics`` plus ``maj@k`` (k > 1: the share of prompts whose
    majority answer is correct, :func:`majority_correct`), ``mean_reward``,
    ``mean_response_tokens`` (tool output included), ``mean_policy_tokens``,
    ``mean_tool_calls``, ``truncated`` (fraction), counts, ``by_difficulty`` (avg@k per
    ``meta["difficulty"]``) and ``per_prompt`` (record id -> correct count).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    params = params or SamplingParams(stop=task.stop)
    records = list(task.records(split) if records is None else records)[:limit]
    if not records:
        raise ValueError(f"task {task.name!r} has no {split} records")
    per_chunk = max(1, chunk // k)
    correct: list[int] = []
    majority: list[bool] = []
    rewards: list[float] = []
    totals = {"response": 0.0, "policy": 0.0, "tools": 0.0, "truncated": 0.0}
    with Progress(f"eval {task.name}/{split}", len(records), enabled=progress) as bar:
        for start in range(0, len(records), per_chunk):
            part = records[start : start + per_chunk]
            requests = group_requests(
                [r.prompt for r in part], [r.id for r in part], k, "eval", seed, split
            )
            batch = engine.rollout(requests, params, task.tools, task.instruction)
            for i, record in enumerate(part):
                texts = batch.texts[i * k : (i + 1) * k]
                verdicts = [task.correct(t, record) for t in texts]
                correct.append(sum(verdicts))
                majority.append(k > 1 and majority_correct(texts, verdicts))
                rewards += [task.reward(t, record) for t in texts]
            totals["response"] += batch.attention_mask.sum().item()
            totals["policy"] += batch.loss_mask.sum().item()
            totals["tools"] += batch.tool_calls.sum().item()
            totals["truncated"] += batch.truncated.sum().item()
            bar.update(advance=len(part))
    samples = len(records) * k
    return {
        "task": task.name,
        "split": split,
        "k": k,
        "prompts": len(records),
        "samples": samples,
        **accuracy_metrics(correct, k),
        **({f"maj@{k}": sum(majority) / len(records)} if k > 1 else {}),
        "mean_reward": sum(rewards) / samples,
        "mean_response_tokens": totals["response"] / samples,
        "mean_policy_tokens": totals["policy"] / samples,
        "mean_tool_calls": totals["tools"] / samples,
        "truncated": totals["truncated"] / samples,
        "params": {
            "temperature": params.temperature,
            "top_p": params.top_p,
            "max_new_tokens": params.max_new_tokens,
            "max_turns": params.max_turns,
            "stop": list(params.stop),
        },
        "by_difficulty": by_difficulty(records, correct, k),
        "per_prompt": {r.id: c for r, c in zip(records, correct, strict=True)},
    }


def class_shares(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    records: Sequence[Record],
    k: int,
) -> dict[str, float]:
    """avg@k and the shares of ``records`` at acc = 0, 0 < acc < 1 and acc = 1 over ``k``
    samples at T = 1 (top-p 1) from ``model`` in the in-process ``hf`` engine, the response
    budget from the task's traces (:func:`trace_budget`), each sample seeded by its record
    (``seed="sft-class-stop"``, split ``"validation"``). The validator of SFT's class stop
    (``anchor_rl.models.sft_stop.ClassStop``); the model is left in the mode it was in."""
    engine = make_engine("hf", model, tokenizer)
    budget = trace_budget(tokenizer, task, records)
    params = SamplingParams(temperature=1.0, max_new_tokens=budget, stop=task.stop)
    result = evaluate(engine, task, "validation", k, params, seed="sft-class-stop", records=records)
    return {name: result[name] for name in (f"avg@{k}", "acc=0", "0<acc<1", "acc=1")}
