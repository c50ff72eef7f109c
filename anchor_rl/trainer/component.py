"""The method seam: what a method (PVPO, V0.5, the critic, the next one) adds to the loop.

A run holds an ordered set of components (:func:`anchor_rl.trainer.run.build_components`
decides which, from the config). The loop calls every component at fixed points of a
step and names none of them (docs/training.md, "Adding a method")::

    set-up          __init__ / a build function    presampling, filters, pretraining
                    training_records(records)      the prompts the run trains on
    before a step   before_step(index)             work outside the step's clock (probes)
    stage 3         on_rollouts(step)              add or replace rows (top-ups, teacher
                                                   rows), refresh state, add metrics
    stage 5         advantage_inputs(step)         estimator inputs it supplies (anchor[B],
                                                   baseline[B], values[B, T], lam[B])
                    on_advantages(step)            after the estimator: transform
                                                   step.advantages, run its own update
    checkpoints     state_dict() / load_state_dict(state)   plain data and tensors
    every step      counters()                     cumulative counts (rollouts/*)

Shapes: B responses, T response tokens. A component keeps references to what it needs
from the :class:`Setup` it was built with (engine, policy, task, config).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from anchor_rl.models.loading import disable_dropout
from anchor_rl.models.lora import lora_base
from anchor_rl.rollout.spec import load_reference
from anchor_rl.trainer.registry import COMPONENTS, register_component

__all__ = ["COMPONENTS", "Component", "Setup", "Step", "register_component"]

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from anchor_rl.rollout.engine import Engine
    from anchor_rl.tasks.base import Record, Task
    from anchor_rl.trainer.collect import Scored
    from anchor_rl.trainer.config import TrainConfig
    from anchor_rl.trainer.data import PromptSampler
    from anchor_rl.trainer.timing import Timer


@dataclass
class Setup:
    """What components are built from: the run's config, task, prompts, models and engine.

    records: the training prompts (the task's train split, first ``train_prompts``).
    resuming: the run is being restored from a checkpoint (set-up work that a new run
        records, such as writing its presampling report, is skipped; state comes from
        ``load_state_dict``).
    generator: the run's random stream (mini-batch shuffles; rollouts are seeded per request).
    reference: the frozen initial policy (``ref_model`` or ``model`` loaded again; for a LoRA
        policy its base model, adapters out, sharing the policy's tensors), loaded on first
        use by :meth:`get_reference` unless the run loaded it for its KL term.
    """

    cfg: TrainConfig
    run_dir: Path
    task: Task
    records: list[Record]
    policy: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    engine: Engine
    generator: torch.Generator
    resuming: bool = False
    reference: PreTrainedModel | None = None
    components: dict[str, Component] = field(default_factory=dict)
    """The method components built so far, by name (``run.build_components`` fills it): a
    component added by ``components`` finds those built before it here."""

    def get_reference(self) -> PreTrainedModel:
        """The frozen reference policy, loaded once (shared with the KL term)."""
        if self.reference is None and self.cfg.lora.enabled and self.cfg.ref_model is None:
            self.reference = lora_base(self.policy)  # the base model's tensors, shared
        if self.reference is None:
            cfg = self.cfg
            self.reference = load_reference(
                cfg.ref_model or cfg.model, self.tokenizer, cfg.task, cfg.task_args, cfg.seed,
                cfg.device, cfg.log.progress,
            )  # fmt: skip
            if cfg.disable_dropout:
                disable_dropout(self.reference)
        return self.reference


@dataclass
class Step:
    """One training step as it moves through the stages; components read and extend it.

    index: the step being run (1-based: ``TrainState.step + 1``).
    scored: the step's scored responses (components may replace it in ``on_rollouts``).
    metrics: the step's metrics so far (components add theirs).
    mask: FloatTensor[B, T], the tokens that enter the loss (set before stage 5).
    logp: FloatTensor[B, T], the sampling policy's own log-probs (KL terms, entropy).
    old_logp: FloatTensor[B, T], the behaviour log-probs the ratio is taken against: ``logp``,
        except on off-policy rows (a teacher's log pi_gt).
    ref_logp: FloatTensor[B, T] under the reference, or None without one.
    inputs: the estimator's inputs (:data:`anchor_rl.algos.advantages.INPUTS`) gathered
        from the loop and the components.
    advantages: FloatTensor[B, T] once the estimator has run (0 where ``mask`` is 0).
    """

    index: int
    scored: Scored
    metrics: dict[str, float]
    timer: Timer
    mask: Tensor | None = None
    logp: Tensor | None = None
    old_logp: Tensor | None = None
    ref_logp: Tensor | None = None
    inputs: dict[str, Any] = field(default_factory=dict)
    advantages: Tensor | None = None


class Component:
    """Base class of method components: every hook does nothing until overridden.

    ``name`` names the component's checkpoint file (``NAME.pt``) and is the key under
    which the run holds it (``run.components[name]``).
    """

    name: str = "component"
    needs_logp: bool = False
    """Whether a hook before the update reads ``step.logp`` / ``step.old_logp`` (then the
    loop computes them in a separate pass; see ``optim.rescore``)."""

    def training_records(self, records: list[Record]) -> list[Record]:
        """The prompts the run trains on, given the ones it would train on without this
        component (PVPO's group sampling drops some)."""
        return records

    def prompt_stream(self, seed: int, consumed: int) -> PromptSampler | None:
        """The run's prompt stream at cursor ``consumed``, when this component draws the
        prompts itself (PVPO's lazy presampling); None: the loop's ``PromptSampler``."""
        return None

    def before_step(self, index: int) -> dict[str, float]:
        """Work before step ``index`` outside its clock (a probe); returns metrics."""
        return {}

    def on_rollouts(self, step: Step) -> None:
        """After rewards and the filter: may replace ``step.scored`` and add metrics."""

    def advantage_inputs(self, step: Step) -> dict[str, Any]:
        """Estimator inputs this component supplies for ``step.scored`` (e.g. ``anchor[B]``)."""
        return {}

    def on_advantages(self, step: Step) -> None:
        """After the estimator: may replace ``step.advantages``, update itself, add metrics."""

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs, as plain data and tensors (saved with ``torch.save``,
        read back with ``weights_only=True``: no pickled classes)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def close(self) -> None:
        """Release what the component started for itself (an engine of its own); the run
        calls it once when it ends (:meth:`~anchor_rl.trainer.run.Run.close`)."""

    def counters(self) -> dict[str, float]:
        """Cumulative counters logged every step; ``rollouts/*`` entries add to
        ``rollouts/total``."""
        return {}
