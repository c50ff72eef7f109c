"""The ``anchor_rl`` node of a verl config: which method the registered trainer runs, its knobs,
and the combinations of verl settings it refuses.

The knobs keep anchor-rl's names and validation: V0.5's are checked by
:class:`~anchor_rl.methods.v05_config.V05Config`, VAPO's by
:class:`~anchor_rl.methods.critic_config.CriticConfig` (docs/v05.md, docs/vapo.md). The rest
of a method's settings are verl's own (``actor_rollout_ref.rollout.n``, the clip range,
``trainer.critic_warmup`` for value pretraining, ...): the example config group
(examples/verl/config/anchor_rl_method/) sets them per method.

No verl import here: the config validates on a plain mapping.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from anchor_rl.integrations.verl import ESTIMATORS, TRAINER
from anchor_rl.methods.critic_config import CriticConfig
from anchor_rl.methods.knobs import changed, no_effect
from anchor_rl.methods.v05_config import V05Config, check_reward_range
from anchor_rl.section import Section

__all__ = [
    "MethodConfig",
    "PVPOSection",
    "V05Section",
    "VAPOSection",
    "check_verl_config",
    "select",
    "unread_knobs",
]

Method = Literal["pvpo", "v05", "vapo"]


REFRESH_FIELDS = ("refresh_every", "refresh_mode")
"""anchor-rl's PVPO refresh knobs, which the verl trainer refuses (:class:`PVPOSection`)."""


class PVPOSection(Section):
    """PVPO's static anchors (also the base of V0.5's ``anchor`` prior), group sampling, teacher."""

    m: int = Field(8, gt=0)
    """M: reference rollouts per training prompt, sampled through verl's rollout before the
    first step (paper: 5 for QA, 16 for math)."""
    presample_batch: int = Field(16, gt=0)
    """Prompts per presampling submission (M rollouts each)."""
    anchor_key: str | None = None
    """Digest of anchors an earlier run of this trainer left in the store (they are keyed by
    prompt content; `anchor-rl presample` keys by task record id and cannot serve here); the
    trainer then samples nothing. None: presample in the trainer, under a
    key made of the reference, tokenizer, sampling settings and training files."""
    reference: str | None = None
    """The reference's identity in the presample key. None: a hash of the files of
    `actor_rollout_ref.model.path` (a local directory), so another checkpoint never reuses
    these anchors."""
    group_sampling: bool = True
    """Drop the prompts the reference always solves; give the ones it never solves a teacher
    trajectory (or drop them, see `keep_unsolved`). PVPO only."""
    teacher: str | None = None
    """`field:PATH`: the dataset row's reference solution at PATH (e.g.
    `field:extra_info.answer`), tokenized by the policy tokenizer and written with
    probability 1 (log pi_gt = 0), injected in place of the last rollout of its prompt and
    scored by verl's reward like any rollout. None: no teacher."""
    keep_unsolved: bool = False
    """Group sampling: keep the accuracy-0 prompts without a teacher trajectory."""

    @model_validator(mode="before")
    @classmethod
    def _no_refresh(cls, data: Any) -> Any:
        """PVPO's anchor refresh is not built in the verl trainer: a clear error, not pydantic's
        "extra inputs are not permitted"."""
        if isinstance(data, Mapping) and (names := [k for k in REFRESH_FIELDS if k in data]):
            raise ValueError(
                f"pvpo.{', pvpo.'.join(names)}: the verl trainer does not refresh anchors (not "
                "built: a policy refresh would sample verl's rollout servers again at step K, a "
                "reference refresh would need the initial weights loaded into them); anchor-rl "
                "train and the TRL plug-in refresh. Drop them"
            )
        return data

    @field_validator("teacher")
    @classmethod
    def _teacher(cls, value: str | None) -> str | None:
        if value is None or value.lower() == "none":
            return None
        if not value.startswith("field:") or not value[len("field:") :]:
            raise ValueError(
                f"got {value!r}: the verl trainer's teacher is `field:PATH` (a dataset field "
                "holding the reference solution, e.g. field:extra_info.answer) or none; "
                "anchor-rl's oracle, hf: and http: teachers need its own task objects"
            )
        return value


class V05Section(Section):
    """V0.5's prior, fusion and rollout budget (anchor-rl's `v05` section, docs/v05.md)."""

    prior: str = "anchor+history"
    """`anchor`, `history` or `anchor+history` (`knn` needs the policy's hidden states, which
    live on verl's workers: refused)."""
    sigma2: Literal["worst", "prior"] = "worst"
    """Per-rollout reward variance of the fusion: `worst` or `prior`."""
    k_max: int = Field(16, gt=0)
    """Most rollouts per prompt, top-ups included (paper: 16); `rollout.n` above it is
    refused with either budget."""
    cost: float | None = Field(None, ge=0)
    """Budget: add a rollout while it lowers the estimated baseline MSE by more than this.
    None: the paper's 0.0039 for +-1 rewards scaled to `reward_range`."""
    top_up_rounds: int = Field(2, ge=0)
    """Adaptive budget: most top-up rounds per step, one rollout submission each."""
    reward_range: tuple[float, float] = (0.0, 1.0)
    """(lo, hi) of verl's reward (before any KL in the reward); a reward outside it is an error."""
    history_strength: float = Field(4.0, gt=0)
    """`history` prior: weight of the base prior's prediction, in rollouts."""
    history_gamma: float = Field(0.95, gt=0, le=1)
    """`history` prior: per-step forgetting of past evidence."""
    budget: Literal["fixed", "adaptive"] = "adaptive"
    """`fixed`: rollout.n per prompt. `adaptive`: top-ups where the rollouts reject the prior.
    Either way rollout.n must not exceed `k_max`."""

    @field_validator("reward_range")
    @classmethod
    def _reward_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        return check_reward_range(value)

    @field_validator("prior")
    @classmethod
    def _prior(cls, value: str) -> str:
        if value.split("+")[0] == "knn":
            raise ValueError(
                "the knn prior embeds prompts with the policy's hidden states, which live on "
                "verl's workers, out of the trainer's reach: use anchor, history or anchor+history"
            )
        return value

    def v05_config(self) -> V05Config:
        """anchor-rl's :class:`V05Config` of these knobs (its validation applies)."""
        return V05Config(**self.model_dump(exclude={"budget"}))


class VAPOSection(Section):
    """VAPO's decoupled and length-adaptive GAE and positive-example NLL (docs/vapo.md)."""

    lam: float | Literal["policy"] = 1.0
    """Lambda of the critic's value targets (VAPO: 1.0, Monte-Carlo returns); `policy`: the
    policy's lambda (no decoupling)."""
    policy_lam: float | Literal["adaptive"] = "adaptive"
    """Lambda of the policy's advantages: a number, or `adaptive` (1 - 1/(lam_alpha * l) per
    response of l tokens)."""
    lam_alpha: float = Field(0.05, gt=0)
    """alpha of the length-adaptive lambda (VAPO: 0.05)."""
    lam_min: float = Field(0.0, ge=0, lt=1)
    """Lower clamp of the length-adaptive lambda."""
    whiten: bool = True
    """Whiten the policy's advantages over the batch's response tokens (as verl's GAE does)."""
    nll_coef: float = Field(0.1, ge=0)
    """Weight of the NLL loss on correct responses (VAPO: 0.1); 0 leaves verl's actor loss as is."""

    def critic_config(self) -> CriticConfig:
        """anchor-rl's :class:`CriticConfig` of these knobs (its validation applies)."""
        return CriticConfig(**self.model_dump(exclude={"nll_coef"}))


class MethodConfig(Section):
    """The ``anchor_rl`` node: the method the ``anchor_rl`` trainer runs and its knobs."""

    method: Method
    """`pvpo`, `v05` or `vapo`."""
    store: str | None = None
    """Anchor store (SQLite file). None: $ANCHOR_RL_CACHE/anchors.db."""
    correct_threshold: float = 1.0
    """A response is correct when its outcome reward (the sum of verl's token-level scores)
    is at least this: the reference accuracy of PVPO's group sampling, VAPO's NLL examples."""
    pvpo: PVPOSection = PVPOSection()
    v05: V05Section = V05Section()
    vapo: VAPOSection = VAPOSection()

    @classmethod
    def from_verl(cls, cfg: Any) -> MethodConfig:
        """Read and validate ``cfg.anchor_rl`` (a DictConfig or a mapping); ValueError naming
        the node when it is missing."""
        node = select(cfg, "anchor_rl")
        if node is None:
            raise ValueError(
                f"trainer.v1.trainer_mode={TRAINER} needs an `anchor_rl` config node (at least "
                "anchor_rl.method=pvpo|v05|vapo); examples/verl/config has one per method"
            )
        method = cls.model_validate(_plain(node))
        method.v05.v05_config()
        method.vapo.critic_config()
        return method

    @property
    def uses_anchors(self) -> bool:
        """Whether the method reads the reference's presampled anchors."""
        return self.method == "pvpo" or (
            self.method == "v05" and self.v05.prior.split("+")[0] == "anchor"
        )

    @property
    def group_sampling(self) -> bool:
        """Whether PVPO's group sampling filters the training prompts."""
        return self.method == "pvpo" and self.pvpo.group_sampling


def _plain(node: Any) -> Any:
    """A DictConfig (or ListConfig) as plain dicts and lists; anything else unchanged."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf comes with verl
        return node
    if isinstance(node, DictConfig | ListConfig):
        return OmegaConf.to_container(node, resolve=True)
    return node


def select(cfg: Any, path: str, default: Any = None) -> Any:
    """``cfg[a][b]...`` for ``path = "a.b..."`` on a DictConfig or nested mappings; ``default``
    where a level is missing or None."""
    node = cfg
    for part in path.split("."):
        if node is None:
            return default
        if isinstance(node, Mapping) or hasattr(node, "get"):
            node = node.get(part)
        else:
            return default
    return default if node is None else node


_ANCHOR_FIELDS = ("m", "presample_batch", "anchor_key", "reference")
"""The ``pvpo`` knobs an anchor-based V0.5 prior reads (presampling of its anchors)."""


_TOP_UP_FIELDS = ("cost", "top_up_rounds")
"""V0.5's knobs that only the adaptive budget reads."""
_LAMBDA_FIELDS = ("lam_alpha", "lam_min")
"""VAPO's knobs that only the length-adaptive policy lambda reads."""


def unread_knobs(method: MethodConfig) -> list[str]:
    """The knobs of ``method`` set away from their defaults in a section the chosen method
    does not read (``pvpo.teacher`` with ``method=v05``, ``v05.*`` with ``method=pvpo``, ...),
    as ``anchor_rl.SECTION.FIELD``. A section at its defaults, as the example config writes
    every knob, is fine."""
    name = method.method
    read: dict[str, tuple[str, ...]] = {
        "pvpo": tuple(PVPOSection.model_fields) if name == "pvpo" else (),
        "v05": tuple(V05Section.model_fields) if name == "v05" else (),
        "vapo": tuple(VAPOSection.model_fields) if name == "vapo" else (),
    }
    if name == "v05" and method.uses_anchors:
        read["pvpo"] = _ANCHOR_FIELDS
    unread = []
    for section, fields in read.items():
        value = getattr(method, section)
        default = type(value)()
        unread += [
            f"anchor_rl.{section}.{f}"
            for f in type(value).model_fields
            if f not in fields and getattr(value, f) != getattr(default, f)
        ]
    return unread


def check_verl_config(cfg: Any, method: MethodConfig) -> None:
    """ValueError, one line naming the verl setting and the fix, for a combination that cannot
    mean what it says with ``method`` (see docs/integrations.md, section "verl", "Refused
    settings")."""
    name = method.method
    if unread := unread_knobs(method):
        reads = {
            "pvpo": "anchor_rl.pvpo.*",
            "v05": "anchor_rl.v05.* and, with an anchor prior, anchor_rl.pvpo."
            + ", anchor_rl.pvpo.".join(_ANCHOR_FIELDS),
            "vapo": "anchor_rl.vapo.*",
        }[name]
        raise ValueError(
            f"{', '.join(unread)} set with anchor_rl.method={name}, which does not read them "
            f"(it reads {reads}): drop them or set them to their defaults"
        )
    # knobs of the chosen method's own section that its other settings switch off (anchor-rl's
    # trainer refuses the same, trainer.config.combination_errors)
    v05, vapo = method.v05, method.vapo
    if name == "v05" and v05.budget != "adaptive" and (names := changed(v05, _TOP_UP_FIELDS)):
        why = "they size top-ups: set anchor_rl.v05.budget=adaptive"
        raise ValueError(no_effect("anchor_rl.v05", names, why))
    if (
        name == "vapo"
        and vapo.policy_lam != "adaptive"
        and (names := changed(vapo, _LAMBDA_FIELDS))
    ):
        why = "they shape the length-adaptive lambda: set anchor_rl.vapo.policy_lam=adaptive"
        raise ValueError(no_effect("anchor_rl.vapo", names, why))
    estimator = select(cfg, "algorithm.adv_estimator")
    if estimator != ESTIMATORS[name]:
        raise ValueError(
            f"anchor_rl.method={name} computes its advantages as algorithm.adv_estimator="
            f"{ESTIMATORS[name]}, got {estimator!r}: set algorithm.adv_estimator={ESTIMATORS[name]}"
        )
    if select(cfg, "algorithm.filter_groups.enable", False) and name in ("pvpo", "v05"):
        raise ValueError(
            "algorithm.filter_groups (DAPO dynamic sampling) drops groups whose responses all "
            f"score alike, which still carry gradient against the per-prompt baseline of {name}: "
            "set algorithm.filter_groups.enable=false"
        )
    n = int(select(cfg, "actor_rollout_ref.rollout.n", 1))
    if name == "pvpo" and method.pvpo.teacher is not None and n < 2:
        raise ValueError(
            "a PVPO teacher trajectory replaces one of a prompt's actor_rollout_ref.rollout.n "
            f"rollouts, got n={n}: set rollout.n >= 2 or anchor_rl.pvpo.teacher=none"
        )
    if name == "pvpo" and method.pvpo.teacher is not None and not method.pvpo.group_sampling:
        raise ValueError(
            "anchor_rl.pvpo.teacher serves group sampling's accuracy-0 prompts: set "
            "anchor_rl.pvpo.group_sampling=true or anchor_rl.pvpo.teacher=none"
        )
    # k_max is V0.5's cap on rollouts per prompt, top-ups included, whatever the budget:
    # rollout.n is k_init, the rollouts every prompt starts with, so n > k_max breaks the cap
    # before any top-up. anchor-rl's own trainer (TrainConfig) and the TRL integration refuse
    # it for both budgets; a fixed budget (no top-ups) does not make the cap mean less.
    if name == "v05" and n > method.v05.k_max:
        k_max = method.v05.k_max
        raise ValueError(
            f"actor_rollout_ref.rollout.n={n} is above anchor_rl.v05.k_max={k_max}, V0.5's "
            f"cap on rollouts per prompt (budget: {method.v05.budget}; rollout.n is k_init, "
            f"the rollouts every prompt starts with): set actor_rollout_ref.rollout.n <= "
            f"{k_max} or raise anchor_rl.v05.k_max to at least {n}"
        )
    if name == "vapo":
        if select(cfg, "critic.enable") is False:
            raise ValueError("anchor_rl.method=vapo needs verl's critic: set critic.enable=true")
        lam = select(cfg, "algorithm.lam", 1.0)
        if float(lam) != 1.0:
            raise ValueError(
                f"algorithm.lam={lam} has no effect with anchor_rl.method=vapo: set "
                "anchor_rl.vapo.policy_lam (the policy's) and anchor_rl.vapo.lam (the critic's)"
            )
        if select(cfg, "algorithm.use_pf_ppo", False):
            raise ValueError("algorithm.use_pf_ppo is not built for anchor_rl.method=vapo")
