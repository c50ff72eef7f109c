"""The ``pvpo`` section of the training config (PVPO, arXiv 2508.21104).

Kept apart from :mod:`anchor_rl.trainer.pvpo` (the stages) so the config, and with it
``anchor-rl --help``, imports neither torch nor transformers.

The section is read when ``advantage.estimator = "pvpo"`` (the static anchor) or
``filter.kind = "group"`` (group sampling); both need the presampled anchors.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from anchor_rl.methods.knobs import changed, no_effect
from anchor_rl.section import Section

TEACHER_KINDS = ("oracle", "oracle:reference", "hf:MODEL", "http:URL", "none")
REUSE_KNOBS = ("reuse_correction", "reuse_tis_cap")
NATIVE_ONLY = (
    "presample", "reuse_presample", "reuse_correction", "reuse_tis_cap", "anchor_update",
    "m_min", "round_size", "se_max",
)  # fmt: skip
"""The knobs only ``anchor-rl train`` builds (:meth:`PVPOConfig.native_only`)."""


class PVPOConfig(Section):
    """PVPO: static anchors from reference rollouts, group sampling, teacher trajectories, refresh."""

    method: ClassVar[str] = "PVPO"
    enable: ClassVar[str] = "advantage.estimator=pvpo or filter.kind=group"
    unused: ClassVar[str] = "the run presamples no anchors"

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
    """Seed of the anchor draw (presampling, refreshes, the walk order); part of the store
    key. None: 0, in every host and `anchor-rl presample`, so one draw serves every run of a
    study whatever its seed. Set it per run (e.g. to the run's seed) for a seed spread that
    includes the anchors' noise."""
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
    presample: Literal["upfront", "lazy"] = "upfront"
    """When the anchors are sampled. `upfront`: before the first step, for the whole walk
    (`pvpo.prompts`). `lazy`: a prompt's anchors when the run first draws it, in one engine
    call per step for the step's new prompts, before the step's own rollouts; group sampling
    decides then, and a prompt it drops is replaced by the next prompt of the walk. Rows go
    to the store as they are sampled, so a resumed run re-reads them. Native trainer only."""
    reuse_presample: bool = False
    """With `pvpo.presample=lazy`: a prompt's first group is the first `rollout.n` of its M
    presampled rollouts (kept in the store) instead of n fresh ones, trained off-policy
    against the reference's log-probs they were sampled with (`pvpo.reuse_correction`), each
    row against a leave-one-out anchor (the mean of the prompt's other M - 1 presampled
    rewards). Saves n policy rollouts per first draw. Native trainer only."""
    reuse_correction: Literal["tis", "none"] = "tis"
    """The importance correction of reused rows, as the asynchronous path's
    (`cluster.async_correction`): `tis` takes the ratio against the current policy and
    weights each token's advantage by min(pi_current / pi_reference, `pvpo.reuse_tis_cap`);
    `none` divides by the reference's log-probs (the PPO clip bounds the ratio)."""
    reuse_tis_cap: float = Field(2.0, gt=0)
    """The truncation of `pvpo.reuse_correction = tis`'s weights."""
    m_min: int | None = Field(None, gt=0)
    """Sequential presampling: each prompt gets `m_min` reference rollouts first, then
    `pvpo.round_size` more per round until it is settled or has M: settled once all its
    rollouts agree (class always or never solved, as far as m_min tells) or, solved
    sometimes (class certain), once its anchor's standard error is at most `pvpo.se_max`.
    None: M at once. Every draw is stored, so a later run asking for more tops up."""
    round_size: int = Field(2, gt=0)
    """Rollouts per prompt per round of sequential presampling (`pvpo.m_min`)."""
    se_max: float | None = Field(None, gt=0)
    """Sequential presampling's standard-error target for a sometimes-solved prompt's
    anchor. None: sqrt(0.25 / M), what M rollouts give a prompt solved half the time."""
    anchor_update: Literal["none", "pooled"] = "none"
    """`none`: a prompt's baseline is its stored anchor V_sta. `pooled`: the policy's rollouts
    of every draw of the prompt join its presampled ones in one running pool, and each row's
    baseline is the pool's mean without the row itself (leave-one-out); a teacher row, not
    in the pool, gets the whole pool's mean. Native trainer only."""

    @field_validator("reuse_correction", "anchor_update", mode="before")
    @classmethod
    def _none_is_a_correction(cls, value: object) -> object:
        return "none" if value is None else value  # `pvpo.X=none` parses as None

    @field_validator("m_min", mode="before")
    @classmethod
    def _none_is_unset(cls, value: object) -> object:
        return None if value == "none" else value  # TOML has no null: `m_min = "none"`

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

    def native_only(self, host: str) -> str | None:
        """The error another ``host`` (TRL, verl) raises when this section sets a knob only
        the native trainer builds (:data:`NATIVE_ONLY`); None when none is set."""
        names = changed(self, NATIVE_ONLY)
        if not names:
            return None
        return (
            f"pvpo.{', pvpo.'.join(names)}: built in anchor-rl train only, not in {host} "
            "(lazy presampling, reused presampled rollouts, pooled anchors and sequential "
            "presampling: docs/pvpo.md); drop them"
        )

    def errors(self, *, group: bool, n: int, top_p: float) -> list[str]:
        """The settings of a run with PVPO that cannot mean what the user thinks (empty: none).

        group: whether the run has group sampling (``filter.kind = "group"``); n: the group
        size (``rollout.n``); top_p: the rollouts' nucleus (``rollout.top_p``).
        """
        errors = []
        http = self.teacher is not None and self.teacher.startswith("http:")
        sampled = self.teacher is not None and self.teacher.split(":")[0] in ("hf", "http")
        if self.teacher_model is not None and not http:
            why = "it names the model an http: teacher serves"
            errors.append(no_effect("pvpo", ["teacher_model"], why))
        if not sampled and changed(self, ("teacher_tries",)):
            why = f"pvpo.teacher={self.teacher} does not sample"
            errors.append(no_effect("pvpo", ["teacher_tries"], why))
        group_knobs = ("teacher", "teacher_model", "teacher_tries", "keep_unsolved")
        if not group and (names := changed(self, group_knobs)):
            why = "teachers and unsolved prompts belong to group sampling: set filter.kind=group"
            errors.append(no_effect("pvpo", names, why))
        if not self.refresh_every and changed(self, ("refresh_mode",)):
            why = "pvpo.refresh_every=0 never refreshes"
            errors.append(no_effect("pvpo", ["refresh_mode"], why))
        if self.presample == "lazy" and self.refresh_every:
            upfront = "pvpo.presample=upfront" + (
                " pvpo.reuse_presample=false" if self.reuse_presample else ""
            )
            errors.append(
                "pvpo.presample=lazy with pvpo.refresh_every: a refresh re-estimates the anchors "
                "of the prompts drawn so far, and those drawn later would have none under the "
                "refresh key (not built); use --preset pvpo_paper (the paper's setting), or "
                f"{upfront}, or pvpo.refresh_every=0"
            )
        if self.reuse_presample and self.presample != "lazy":
            errors.append(
                "pvpo.reuse_presample needs pvpo.presample=lazy (the presampled rollouts are "
                "kept as each prompt is first drawn); set pvpo.reuse_presample=false too, or "
                "use --preset pvpo_paper (upfront, no reuse)"
            )
        if self.reuse_presample and not (n <= self.m and self.m >= 2):
            errors.append(
                f"pvpo.reuse_presample takes a prompt's first group of rollout.n={n} from its "
                f"pvpo.m={self.m} presampled rollouts, each row against the mean of the other "
                "M - 1: it needs rollout.n <= pvpo.m and pvpo.m >= 2"
            )
        if self.m_min is not None and self.m_min > self.m:
            errors.append(
                f"pvpo.m_min={self.m_min} is above pvpo.m={self.m}; set pvpo.m_min <= pvpo.m, "
                "or pvpo.m_min=none (M at once)"
            )
        if self.m_min is None and (names := changed(self, ("round_size", "se_max"))):
            errors.append(no_effect("pvpo", names, "pvpo.m_min is not set (M at once)"))
        if self.reuse_presample and self.m_min is not None and self.m_min < n:
            errors.append(
                f"pvpo.reuse_presample takes rollout.n={n} presampled rollouts per prompt: "
                f"pvpo.m_min={self.m_min} must be at least that (set pvpo.m_min={n}, or "
                "pvpo.reuse_presample=false)"
            )
        if not self.reuse_presample and (names := changed(self, REUSE_KNOBS)):
            errors.append(no_effect("pvpo", names, "pvpo.reuse_presample is off"))
        if group and self.teacher is not None and n < 2:
            errors.append(
                f"rollout.n=1 with pvpo.teacher={self.teacher}: a teacher trajectory replaces "
                "one of its group's n rollouts, here the policy's only one; set rollout.n >= 2 "
                "or pvpo.teacher=none"
            )
        if self.teacher == "oracle:reference" and top_p < 1:
            errors.append(
                "pvpo.teacher=oracle:reference scores the trace without a nucleus, so "
                "with rollout.top_p < 1 its pi_gt is not the distribution the reference "
                "samples from; use pvpo.teacher=oracle or rollout.top_p=1"
            )
        return errors
