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
from anchor_rl.methods.critic_config import CriticConfig, Lambda
from anchor_rl.methods.knobs import changed, in_host_terms
from anchor_rl.methods.pvpo_config import NATIVE_ONLY, PVPOConfig
from anchor_rl.methods.v05_config import V05Config, V05Knobs
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
        if isinstance(data, Mapping) and (names := [k for k in NATIVE_ONLY if k in data]):
            raise ValueError(
                f"pvpo.{', pvpo.'.join(names)}: built in anchor-rl train only, not in the verl "
                "trainer (docs/pvpo.md); drop them"
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


class V05Section(V05Knobs):
    """V0.5's prior, fusion and rollout budget: anchor-rl's V0.5 knobs (docs/v05.md; the knn
    prior and its knobs are not offered) and `budget`. `reward_range` bounds verl's reward
    before any KL in the reward; `rollout.n` above `k_max` is refused with either budget."""

    budget: Literal["fixed", "adaptive"] = "adaptive"
    """`fixed`: rollout.n per prompt. `adaptive`: top-ups where the rollouts reject the prior.
    Either way rollout.n must not exceed `k_max`."""

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


_GAE = CriticConfig.model_fields
"""The GAE knobs VAPO shares with anchor-rl's ``critic`` section, declared there."""


class VAPOSection(Section):
    """VAPO's decoupled and length-adaptive GAE (the knobs of anchor-rl's `critic` section, the
    adaptive policy lambda by default) and positive-example NLL (docs/vapo.md)."""

    lam: Lambda | Literal["policy"] = _GAE["lam"]
    policy_lam: Lambda | Literal["adaptive"] = "adaptive"
    """Lambda of the policy's advantages: a number, or `adaptive` (1 - 1/(lam_alpha * l) per
    response of l tokens)."""
    lam_alpha: float = _GAE["lam_alpha"]
    lam_min: float = _GAE["lam_min"]
    whiten: bool = _GAE["whiten"]
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


def unread_knobs(method: MethodConfig) -> list[str]:
    """The knobs of ``method`` set away from their defaults in a section the chosen method
    does not read (``pvpo.teacher`` with ``method=v05``, ``v05.*`` with ``method=pvpo``, ...),
    as ``anchor_rl.SECTION.FIELD``. A section at its defaults, as the example config writes
    every knob, is fine."""
    name, unread = method.method, []
    for section in ("pvpo", "v05", "vapo"):
        if section != name:  # the method's own section: every knob is read
            read = _ANCHOR_FIELDS if section == "pvpo" and method.uses_anchors else ()
            unread += [
                f"anchor_rl.{section}.{f}"
                for f in changed(getattr(method, section))
                if f not in read
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
    # anchor-rl's own rules of the method's section (knobs its other settings switch off),
    # named as in the node; after the k_max rule above, which says more for verl
    errors, names = [], {}
    if name == "v05":  # no anchor refresh here (PVPOSection): the default pvpo section
        v05 = method.v05
        errors = v05.v05_config().errors(PVPOConfig(), n=n, budget=v05.budget, overlong_cache=0)
        names = {'rollout.budget="adaptive"': "v05.budget=adaptive", "v05.": "anchor_rl.v05."}
    elif name == "vapo":
        errors, names = method.vapo.critic_config().errors(), {"critic.": "anchor_rl.vapo."}
    if text := in_host_terms(errors, names):
        raise ValueError(text)
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
