"""The combinations of settings a training config refuses: each message names the field and
the fix. docs/training.md ("Refused combinations") lists every rule.

The rules take the ``TrainConfig`` being validated (typed ``Any``: the config module
imports this one)."""

from __future__ import annotations

import inspect
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter, ValidationError

from anchor_rl.methods.knobs import changed, no_effect
from anchor_rl.methods.peers_config import ASTARPO_PVPO_KNOBS, astarpo_loss_errors, uses_perfect
from anchor_rl.methods.v05_config import ANCHOR_KNOBS
from anchor_rl.models.lora import lora_errors
from anchor_rl.trainer.plugins import engines

METHOD_SECTIONS = ("pvpo", "v05", "critic", "astarpo", "perfect")
"""The sections that belong to a method: each is validated by its own ``errors`` when the
run uses the method, and its knobs are refused by :func:`unused_method_errors` when not."""


def unused_method_errors(cfg: Any) -> list[str]:
    """The knobs of a method the run does not use, set away from their defaults: one message
    per section, naming the knobs, the method that reads them and how to turn it on.

    V0.5's anchor prior reads part of the ``pvpo`` section (``v05_config.ANCHOR_KNOBS``, and
    ``refresh_every``, which V0.5 refuses itself); a run with that prior but without PVPO
    refuses the rest.
    """
    errors = []
    methods, est = cfg.methods, cfg.advantage.estimator
    for name in METHOD_SECTIONS:
        section = getattr(cfg, name)
        if name in methods or (name == "perfect" and uses_perfect(cfg)):
            continue
        if name == "pvpo" and "astarpo" in methods:  # A*-PO's reference samples
            if names := [n for n in changed(section) if n not in ASTARPO_PVPO_KNOBS]:
                errors.append(no_effect(name, names, "A*-PO reads only the presampling knobs"))
            continue
        partial = name == "pvpo" and "v05" in methods and cfg.v05.prior.startswith("anchor")
        read = (*ANCHOR_KNOBS, "refresh_every") if partial else ()
        if not (names := [n for n in changed(section) if n not in read]):
            continue
        it = "it" if len(names) == 1 else "them"
        if partial:
            listed = ", ".join(f"pvpo.{k}" for k in ANCHOR_KNOBS[:-1])
            why = f"V0.5's anchor prior uses only {listed} and pvpo.{ANCHOR_KNOBS[-1]}"
        else:
            why = section.unused.format(est=est)
        fix = f"{section.method} reads {it}: drop {it} or set {section.enable}"
        if name == "pvpo" and not partial and (shared := [n for n in names if n in ANCHOR_KNOBS]):
            keys = ", ".join(f"pvpo.{n}" for n in shared)
            fix += f" (V0.5's anchor prior reads {keys} too: advantage.estimator=v05)"
        errors.append(no_effect(name, names, f"{why}; {fix}"))
    return errors


def combination_errors(cfg: Any) -> list[str]:
    """Settings that cannot mean what the user thinks (empty: none); each message names the
    field and the fix. docs/training.md ("Refused combinations") lists every rule.

    A setting the run ignores is refused when it differs from its default (a preset that
    writes a default value out is not an error); the method components a run builds are
    ``cfg.methods``, and each method's own section checks the settings only it reads.
    """
    from anchor_rl.algos.registry import get_estimator

    errors = unused_method_errors(cfg)
    est = cfg.advantage.estimator
    reads = set(get_estimator(est).inputs)
    methods = cfg.methods
    critic, pvpo, v05 = "critic" in methods, "pvpo" in methods, "v05" in methods
    v05_anchor = v05 and cfg.v05.prior.split("+")[0] == "anchor"

    # --- estimator and filter ------------------------------------------------------------
    if cfg.rollout.n == 1 and "index" in reads:
        errors.append(
            f"rollout.n=1 with advantage.estimator={est}: a group of one response is "
            "its own baseline, so every advantage is 0; set rollout.n >= 2"
        )
    if cfg.filter.kind == "dynamic" and reads & {"anchor", "baseline", "policy_value"}:
        errors.append(
            f"filter.kind=dynamic with advantage.estimator={est}: dynamic sampling "
            "drops groups whose responses all score alike, which carry gradient against "
            "a per-prompt baseline (r - V is not 0); use filter.kind=group or none"
        )
    if cfg.filter.kind != "dynamic" and (names := changed(cfg.filter, ("max_rounds", "metric"))):
        errors.append(
            no_effect(
                "filter",
                names,
                f"only dynamic sampling reads {'it' if len(names) == 1 else 'them'}; "
                f"set filter.kind=dynamic or drop {'it' if len(names) == 1 else 'them'}",
            )
        )
    if "gamma" not in reads and changed(cfg.advantage, ("gamma",)):
        errors.append(
            no_effect(
                "advantage",
                ["gamma"],
                f"advantage.estimator={est} has no token returns to discount",
            )
        )
    if cfg.optim.shared_prefix == "on" and cfg.optim.padding_free == "off":
        errors.append(
            "optim.shared_prefix=on with optim.padding_free=off: the shared-prefix forward is "
            "padding-free; set optim.padding_free=auto or optim.shared_prefix=off"
        )
    uses_ref = cfg.needs_ref or pvpo or v05_anchor or "astarpo" in methods
    if cfg.ref_model is not None and not uses_ref:
        errors.append(
            "ref_model has no effect: nothing reads a reference (kl.coef=0, "
            "kl.track=false, no anchors); drop it or set kl.coef or kl.track=true"
        )

    # --- the adaptive budget and V0.5 ------------------------------------------------------
    if cfg.rollout.budget == "adaptive" and not v05:
        errors.append(
            'rollout.budget="adaptive" sizes the budget from a V0.5 prior: it needs '
            f'advantage.estimator="v05" (got {est!r})'
        )
    if v05:
        errors += cfg.v05.errors(
            cfg.pvpo, n=cfg.rollout.n, budget=cfg.rollout.budget,
            overlong_cache=cfg.reward.overlong_cache,
        )  # fmt: skip

    # --- A*-PO ------------------------------------------------------------------------------
    if "astarpo" in methods:
        errors += cfg.astarpo.errors(cfg)
    errors += astarpo_loss_errors(cfg)

    # --- PVPO ----------------------------------------------------------------------------
    if pvpo:
        group = cfg.filter.kind == "group"
        errors += cfg.pvpo.errors(group=group, n=cfg.rollout.n, top_p=cfg.rollout.top_p)
        if "anchor" in reads and cfg.reward.overlong_cache > 0:
            errors.append(
                f"reward.overlong_cache={cfg.reward.overlong_cache} with advantage.estimator="
                f"{est}: the static anchor is the reference's mean task reward, without the "
                "overlong punishment the training reward gets, so every advantage r - V_sta "
                "would carry the mean punishment; drop reward.overlong_cache"
            )

    if cfg.cluster.rollout_workers and cfg.rollout.engine not in ("hf", "ray"):
        errors.append(
            f"cluster.rollout_workers runs the built-in engine in Ray actors, not "
            f"rollout.engine={cfg.rollout.engine}: drop one of them"
        )
    if not cfg.cluster.rollout_workers and (
        names := changed(cfg.cluster, ("address", "weight_sync"))
    ):
        errors.append(no_effect("cluster", names, "cluster.rollout_workers=0 uses no Ray"))
    name, options = cfg.engine
    signature = inspect.signature(engines().lookup(name))
    try:
        signature.bind(None, None, **options)
    except TypeError as exc:
        takes = ", ".join(list(signature.parameters)[2:]) or "no options"
        errors.append(f"rollout.engine_args: {exc} (the {name!r} engine takes {takes})")
    else:
        errors += _engine_option_errors(name, engines().lookup(name), options)
    if unlisted := sorted(set(cfg.component_args) - set(cfg.components)):
        errors.append(f"component_args names {unlisted}, which components does not list")

    if cfg.cluster.rollout_workers and {"workers", "address", "weight_sync"} & set(
        cfg.rollout.engine_args
    ):
        errors.append(
            "rollout.engine_args.workers / .address / .weight_sync with cluster.rollout_workers: "
            "the cluster section sets them (cluster.rollout_workers, cluster.address, "
            "cluster.weight_sync); set them there, or "
            "name the engine directly (rollout.engine=ray) without cluster.rollout_workers"
        )
    if cfg.cluster.async_steps:
        if cfg.engine[0] != "ray":
            errors.append(
                "cluster.async_steps needs cluster.rollout_workers > 0 (or rollout.engine=ray): "
                "rollouts sampled in this process cannot overlap its update"
            )
        if cfg.rollout.top_p < 1:
            errors.append(
                "cluster.async_steps needs rollout.top_p = 1: the engine's log-probs are of the "
                "nucleus-renormalised distribution, which the update's ratio cannot divide by"
            )
        if cfg.cluster.async_correction != "tis" and changed(cfg.cluster, ("tis_cap",)):
            errors.append(no_effect("cluster", ["tis_cap"], "set cluster.async_correction=tis"))
    elif names := changed(cfg.cluster, ("async_correction", "tis_cap")):
        errors.append(no_effect("cluster", names, "they correct asynchronous rollouts"))

    if cfg.cluster.learner_sharding == "fsdp":
        if cfg.cluster.learners < 2:
            errors.append(
                no_effect("cluster", ["learner_sharding"], "it shards over cluster.learners > 1")
            )
        if critic and cfg.critic.mode == "shared":
            errors.append(
                "cluster.learner_sharding=fsdp shards a separate critic only: a shared critic's "
                "value head runs on the policy's body outside the module FSDP gathers through; "
                "set critic.mode=separate or cluster.learner_sharding=replicate"
            )
        if cfg.optim.padding_free == "on":
            errors.append(
                "cluster.learner_sharding=fsdp scores the update padded (the packed forward "
                "bypasses the root module FSDP gathers through): set optim.padding_free=auto or off"
            )
        if cfg.optim.shared_prefix == "on":
            errors.append(
                "cluster.learner_sharding=fsdp scores the update padded (the shared-prefix "
                "forward runs the layers' parts, which FSDP does not gather): set "
                "optim.shared_prefix=auto or off"
            )
    if cfg.rollout.release_memory and cfg.engine[0] != "hf":
        errors.append(
            f"rollout.release_memory frees the in-process hf engine's memory; the "
            f"{cfg.engine[0]!r} engine samples in other processes, which hold their own: drop "
            "rollout.release_memory"
        )
    if cfg.cluster.learners > 1:  # gloo on the CPU, NCCL with one GPU per rank on CUDA
        kind, _, index = cfg.device.partition(":")
        if kind not in ("cpu", "cuda"):
            errors.append(
                f"cluster.learners > 1 runs on cpu (gloo) or cuda (NCCL), not device={cfg.device}"
            )
        elif kind == "cuda" and index not in ("", "0"):
            errors.append(
                f"cluster.learners > 1 with device={cfg.device}: the ranks take GPUs 0..N-1, one "
                "each; choose the GPUs with CUDA_VISIBLE_DEVICES and set device=cuda"
            )

    # --- the critic ------------------------------------------------------------------------
    if critic:
        errors += cfg.critic.errors()
    return errors + lora_errors(cfg)


def _engine_option_errors(name: str, factory: Any, options: Mapping[str, Any]) -> list[str]:
    """``rollout.engine_args.KEY=value: why`` for each option whose value the engine's factory
    annotation rejects (``decode``'s modes, ``max_batch`` >= 1...), so that it fails with the
    config rather than after the model is loaded. Options the run sets itself (the cluster
    section's ``workers``, ``address``) are named as such by the check that follows."""
    try:
        target = factory.__init__ if inspect.isclass(factory) else factory
        hints = typing.get_type_hints(target, include_extras=True)
    except (NameError, TypeError):  # annotations this process cannot resolve: the engine checks
        return []
    errors = []
    for key, value in options.items():
        if key not in hints:
            continue
        try:
            TypeAdapter(hints[key]).validate_python(value, strict=True)  # passed unconverted
        except ValidationError as exc:
            why = "; ".join(e["msg"] for e in exc.errors())
            errors.append(f"rollout.engine_args.{key}={value!r}: {why} (the {name!r} engine)")
    return errors
