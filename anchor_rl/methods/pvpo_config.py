"""The ``pvpo`` section of the training config (PVPO, arXiv 2508.21104).

Kept apart from :mod:`anchor_rl.trainer.pvpo` (the stages) so the config, and with it
``anchor-rl --help``, imports neither torch nor transformers.

The section is read when ``advantage.estimator = "pvpo"`` (the static anchor) or
``filter.kind = "group"`` (group sampling); both need the presampled anchors.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from anchor_rl.section import Section

TEACHER_KINDS = ("oracle", "oracle:reference", "hf:MODEL", "http:URL", "none")


class PVPOConfig(Section):
    """PVPO: static anchors from reference rollouts, group sampling, teacher trajectories, refresh."""

    m: int = Field(8, gt=0)
    """M: reference rollouts per training prompt, sampled once before training with the
    training rollout settings (paper: 5 for QA, 16 for math). Their mean reward is the
    prompt's static anchor V_sta; their accuracy drives group sampling."""
    prompts: int | Literal["auto", "all"] = "auto"
    """Which training prompts are presampled and trained on. `auto`: walk a seeded
    permutation of the training prompts (seed: the anchor seed), presampling as it goes,
    until group sampling would keep `steps x rollout.prompts_per_step` of them (each drawn
    once) or the prompts run out; N: until it would keep N; `all`: every training prompt
    (`train_prompts` limits them). Presampling costs M rollouts per prompt walked, kept or
    not, so `all` on a large split costs far more than the run's own rollouts."""
    store: str | None = None
    """Anchor store (SQLite file). None: $ANCHOR_RL_CACHE/anchors.db, shared by all runs; rows
    are keyed by the reference's weights, tokenizer, sampling settings and task, so a run
    with the same reference reuses them and never mixes in another reference's."""
    presample_batch: int = Field(16, gt=0)
    """Prompts per presampling (and refresh) engine call, M responses each."""
    presample_seed: int | None = None
    """Seed of the anchor draw (presampling and refreshes); part of the store key. None: the
    run's `seed`, so every seed of a sweep presamples its own anchors and the spread over
    seeds includes the anchors' noise. Set a number to share one draw across seeds."""
    teacher: str | None = "oracle"
    """Group sampling: who writes a correct trajectory for the prompts the reference never
    solves. `oracle`: the task's reference solution, written with probability 1 (log pi_gt =
    0, the ratio is pi_theta); `oracle:reference`: the same trace scored by the reference at
    the rollout temperature; `hf:MODEL`: a (larger) local model sharing the policy's
    tokenizer, a directory or a spec such as `hf:teacher:small` (the task's built-in teacher:
    the `small` size SFT-trained on every training record, no curriculum), with the log-probs
    it sampled with; `http:URL`: an OpenAI-compatible /completions endpoint (vLLM, SGLang) serving
    `pvpo.teacher_model`; None (`pvpo.teacher=none`): no teacher."""
    teacher_model: str | None = None
    """Served model name of an `http:` teacher."""
    teacher_tries: int = Field(8, gt=0)
    """Most samples an `hf:` or `http:` teacher draws per prompt."""
    keep_unsolved: bool = False
    """Group sampling: keep the accuracy-0 prompts the teacher cannot solve (trained without a
    trajectory) instead of dropping them."""
    refresh_every: int = Field(0, ge=0)
    """K: re-estimate the anchors of the training prompts every K steps (paper: 500 of 1,000
    steps); 0 never."""
    refresh_mode: Literal["reference", "policy"] = "reference"
    """What a refresh samples: `reference` the original reference again, `policy` a snapshot of
    the current policy (the paper does not say which)."""

    @field_validator("prompts")
    @classmethod
    def _positive_prompts(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 1:
            raise ValueError(f"pvpo.prompts must be >= 1, `auto` or `all`, got {value}")
        return value

    @field_validator("teacher")
    @classmethod
    def _teacher_spec(cls, value: str | None) -> str | None:
        if value is None:
            return value
        kind, _, target = value.partition(":")
        if value in ("oracle", "oracle:reference") or (kind in ("hf", "http") and target):
            return value
        raise ValueError(f"unknown teacher {value!r}; use one of {', '.join(TEACHER_KINDS)}")

    @model_validator(mode="after")
    def _http_needs_model(self) -> PVPOConfig:
        if self.teacher and self.teacher.startswith("http:") and not self.teacher_model:
            raise ValueError(
                f"pvpo.teacher={self.teacher!r} needs pvpo.teacher_model (the served model name)"
            )
        return self
