"""The training loop. It only wires the stages together; each lives in its own module.

One step::

    1 rollout    collect.generate        n responses for each of P prompts
    2 rewards    collect.score           task reward (+ soft overlong punishment)
    3 filter     collect.collect         dynamic sampling: drop groups all right or all wrong, resample
                 component.on_rollouts   each method component in turn: V0.5's top-ups and
                                         fused baseline, PVPO's refresh and teacher rows
    4 log-probs  update.score_logprobs   old (sampling) policy, reference when KL is on (the
                                         first is skipped where the update's forward gives it:
                                         single_pass, optim.rescore)
    5 advantage  advantage.base_inputs + component.advantage_inputs  -> the estimator, by name
                 component.on_advantages the critic's returns, whitening and update
    6 update     update.ppo_update       epochs x mini-batches x micro-batches, AdamW
    7 metrics, held-out evaluation every eval.every steps, checkpoint every checkpoint.every
      and after the step a SIGTERM or SIGINT came in (anchor_rl.interrupt)
      (before a step: component.before_step, outside the step's clock, e.g. V0.5's probe)

The loop names no method: what a method adds lives in its component
(:mod:`anchor_rl.trainer.component`). Log-probs come before the advantage because a KL
penalty in the reward (REINFORCE++, RLOO) needs the reference log-probs there.
"""

from __future__ import annotations

import sys
import time

from anchor_rl.algos.losses import kl
from anchor_rl.batch import minibatches
from anchor_rl.cluster.asynchronous import truncated_is_weights
from anchor_rl.errors import ConfigError, NonFiniteError
from anchor_rl.interrupt import Interrupted, signal_name, stop_signals
from anchor_rl.models.lora import sampling_state
from anchor_rl.rollout.engine import release_memory
from anchor_rl.trainer.advantage import advantage_metrics, base_inputs, compute_advantages
from anchor_rl.trainer.budget import (
    budget_metrics,
    check_start,
    crossed,
    spent,
    stop_reason,
    token_counts,
)
from anchor_rl.trainer.checkpoint import list_checkpoints
from anchor_rl.trainer.collect import collect, prefetch_next
from anchor_rl.trainer.component import Step
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.logging import EVALS_FILE, JsonlSink, ProgressBar, open_sinks
from anchor_rl.trainer.run import Run, counters, evaluate_policy, write_summary
from anchor_rl.trainer.timing import STEP_STAGES, Timer
from anchor_rl.trainer.update import (
    behaviour_logprobs,
    loss_mask,
    ppo_update,
    score_logprobs,
    token_mean,
)


def train_step(run: Run) -> dict[str, float]:
    """One step: rollout -> rewards -> filter -> log-probs -> advantage -> update."""
    cfg, timer = run.cfg, Timer()
    components = run.components.values()
    # 1-3: rollout -> rewards -> filter (several rounds under dynamic sampling)
    scored, metrics = collect(run.engine, run.sampler, run.task, cfg, timer)
    step = Step(run.state.step + 1, scored, metrics, timer)
    for component in components:  # V0.5 top-ups and fusion, PVPO refresh and teacher rows
        component.on_rollouts(step)
    run.state.rollouts += int(step.metrics["rollouts/step"])
    run.state.tokens += int(step.metrics["tokens/step"])
    scored, metrics = step.scored, step.metrics
    stale = bool(cfg.cluster.async_steps)
    if stale:  # the next steps' rollouts, sampled while this step updates
        metrics["async/staleness"] = float(run.engine.take_staleness())
        ahead = min(cfg.cluster.async_steps, cfg.steps - step.index)
        if ahead > 0:
            prefetch_next(run.engine, run.sampler, run.task, cfg, ahead)
        run.state.discarded += run.engine.take_discarded()
    if len(scored):  # dynamic sampling can end a step with no group kept: nothing to learn from
        batch = scored.batch
        step.mask = mask = loss_mask(batch, cfg)
        single = single_pass(run, step) and not stale
        if cfg.rollout.release_memory:  # the sampler's copy and caches, until the sync below
            release_memory(run.engine)
        with timer("update"):
            # 4: log-probs of the policy that sampled (recomputed), the behaviour log-probs of
            # the ratio (the same, except off-policy rows such as PVPO's teacher trajectories,
            # which keep the log-probs they came with) and the reference's. The KL terms and
            # the entropy are the policy's own on every row. In a single pass the update's
            # own forward supplies the first two (optim.rescore).
            logp = entropy = old_logp = None
            if not single:
                logp, entropy = score_logprobs(run.policy, batch, cfg, with_entropy=True)
                step.logp = logp
                # asynchronous rollouts divide by the log-probs of the weights that sampled
                # them, on every row (anchor_rl.cluster.asynchronous); tis reweights instead
                behind = scored.off_policy | (stale and cfg.cluster.async_correction == "none")
                step.old_logp = old_logp = behaviour_logprobs(logp, batch, behind)
            ref_logp = None if run.ref is None else score_logprobs(run.ref, batch, cfg)[0]
            step.ref_logp = ref_logp
            # 5: the estimator on the loop's inputs and the components' (anchor, baseline,
            # values); then the components' own work on the advantages (the critic's update)
            step.inputs = base_inputs(cfg, scored.rewards, batch.group, mask, logp, ref_logp)
            for component in components:
                step.inputs |= component.advantage_inputs(step)
            step.advantages = compute_advantages(cfg, step.inputs)
            for component in components:
                component.on_advantages(step)
            adv = step.advantages
            if stale and cfg.cluster.async_correction == "tis":
                on_policy_rows = mask * ~scored.off_policy[:, None]  # teacher rows: weight 1
                weights, tis = truncated_is_weights(
                    logp, batch.logprobs, on_policy_rows, cfg.cluster.tis_cap
                )
                adv = step.advantages = adv * (weights + mask * scored.off_policy[:, None])
                metrics |= tis
            # 6: policy update, here or on the data-parallel learners (cluster.learners > 1)
            if cfg.cluster.learners > 1:
                oc = cfg.optim
                schedule = list(minibatches(len(batch), oc.epochs, oc.mini_batches, run.generator))
                metrics |= run.learner_group().update(
                    batch, mask, old_logp, ref_logp, adv, scored.correct, schedule
                )
            else:
                seen: dict = {}
                metrics |= ppo_update(
                    run.policy, run.optimizer, run.scheduler, batch, mask,
                    old_logp, ref_logp, adv, scored.correct, cfg, run.generator, seen=seen,
                )  # fmt: skip
                if single:
                    logp, entropy = seen["logp"], seen["entropy"]
        with timer("sync"):  # the next rollouts' weights (for Ray workers, via the object store)
            run.engine.sync_weights(sampling_state(run.policy))  # LoRA: merged, lazily
        assert logp is not None and entropy is not None
        metrics["update/single_pass"] = float(single)
        metrics |= token_counts(batch, not single, ref_logp is not None, cfg.optim.epochs)
        metrics |= advantage_metrics(adv, mask)
        metrics["policy/entropy"] = token_mean(entropy, batch.loss_mask)
        if ref_logp is not None:
            metrics["kl/ref"] = token_mean(kl(logp, ref_logp, cfg.kl.kind), batch.loss_mask)
    metrics |= counters(run)
    metrics |= {f"time/{name}": timer.seconds[name] for name in STEP_STAGES}
    return metrics


def single_pass(run: Run, step: Step) -> bool:
    """Whether this step's update may skip the separate re-scoring pass (``optim.rescore``):
    one optimiser step on the whole batch, dropout off, no KL in the reward, one learner,
    no off-policy rows, and no component reading the log-probs before the update."""
    cfg = run.cfg
    oc = cfg.optim
    return (
        oc.rescore == "auto"
        and oc.epochs == 1
        and oc.mini_batches == 1
        and cfg.disable_dropout
        and not (cfg.kl.in_reward and cfg.kl.coef > 0)
        and cfg.cluster.learners == 1
        and not bool(step.scored.off_policy.any())
        and not any(c.needs_logp for c in run.components.values())
    )


def train(run: Run) -> Run:
    """Run the loop from ``run.state.step`` to ``cfg.steps`` (a new run, or a resumed one:
    see ``run.start_run`` and ``run.resume_run``).

    Writes metrics, TensorBoard events, checkpoints, ``summary.json`` and ``run.log`` (one
    line per start, resume and stop) to the run directory.

    SIGTERM or SIGINT (:mod:`anchor_rl.interrupt`): the step in progress finishes (its
    evaluation too, when one is due), its checkpoint is written and
    :class:`~anchor_rl.interrupt.Interrupted` is raised with the checkpoint and the resume
    command; a second signal abandons the step (or the checkpoint being written, whose
    partial files are removed) at once and names the last checkpoint on disk. Either way
    ``--resume`` continues exactly as if the run had not stopped.
    """
    cfg, state = run.cfg, run.state
    resumed_at = state.step or None  # a resumed run always restarts after a saved step >= 1
    if resumed_at:
        _event(run, f"resuming {run.run_dir} from {_name(state.step)}: step {state.step + 1} "
               f"of {cfg.steps} is next")  # fmt: skip
    else:
        _event(run, f"starting {run.run_dir}: {cfg.steps} steps", echo=False)
    budget = cfg.budget  # budget.rollouts: stop at a total; evaluate at fractions of it
    evaluating = bool(cfg.eval.every or budget.fractions)
    total = counters(run)["rollouts/total"]
    try:
        check_start(budget, total, state.step)
    except ValueError as exc:
        run.close()
        raise ConfigError(str(exc)) from None
    sinks = open_sinks(cfg.log, run.run_dir, cfg.model_dump(mode="json"), resumed_at)
    evals = JsonlSink(run.run_dir, resumed_at, EVALS_FILE)  # per-prompt results
    metrics: dict[str, float] = {}
    saved = state.step if resumed_at else None  # the step whose checkpoint is on disk
    notice = "finishing the step in progress, then checkpointing; a second signal stops at once"
    try:
        with (
            stop_signals(notice) as stop,
            ProgressBar(cfg.steps, state.step, cfg.log.progress) as bar,
        ):
            if state.step == 0 and evaluating:
                started = time.perf_counter()
                scores, details = evaluate_policy(run, 0)
                evals.log(0, details)
                metrics = {**scores, **counters(run)}
                state.elapsed += time.perf_counter() - started
                _log(sinks, bar, 0, metrics | {"time/elapsed": state.elapsed})
            while (
                state.step < cfg.steps
                and not _out_of_time(cfg, state.elapsed)
                and not spent(budget, total)
                and not stop.requested
            ):
                before: dict[str, float] = {}  # outside the step's clock (V0.5's probe)
                for component in run.components.values():
                    before |= component.before_step(state.step + 1)
                started = time.perf_counter()
                try:
                    metrics = train_step(run) | before
                except NonFiniteError as exc:
                    raise NonFiniteError(_diverged(run, str(exc))) from None
                state.step += 1
                due = crossed(budget, total, metrics["rollouts/total"])
                total = metrics["rollouts/total"]
                metrics |= budget_metrics(budget, total, due)
                last = (
                    state.step == cfg.steps
                    or spent(budget, total)
                    or _out_of_time(cfg, state.elapsed + time.perf_counter() - started)
                )
                periodic = cfg.eval.every and state.step % cfg.eval.every == 0
                if periodic or (evaluating and last) or due:
                    scores, details = evaluate_policy(run, state.step)
                    evals.log(state.step, details)
                    metrics |= scores
                metrics["time/step"] = time.perf_counter() - started
                state.elapsed += metrics["time/step"]
                _log(sinks, bar, state.step, metrics | {"time/elapsed": state.elapsed})
                if (cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0) or last:
                    run.save()
                    saved = state.step
            if stop.requested:  # the step in progress finished; keep it
                if state.step and saved != state.step:
                    run.save()
                    saved = state.step
                raise stop.stop(_stopped(run, stop.signum, saved or 0))
    except Interrupted as exc:
        if not exc.message:  # a second signal: the step or the checkpoint was abandoned
            exc = Interrupted(exc.signum, _stopped(run, exc.signum, None))
        _event(run, exc.message.splitlines()[0], echo=False)
        raise exc from None
    finally:
        for sink in [*sinks, evals]:
            sink.close()
        run.close()
    reason = stop_reason(budget, total, state.step, cfg.steps, _out_of_time(cfg, state.elapsed))
    write_summary(run, metrics, reason)
    if budget.rollouts is not None and reason != "budget":
        _event(run, f"stopped by {reason} at step {state.step} with {total:.0f} of "
               f"budget.rollouts={budget.rollouts} rollouts spent")  # fmt: skip
    _event(run, f"finished at step {state.step} ({reason})", echo=False)
    return run


RUN_LOG = "run.log"
"""``RUN_DIR/run.log``: one time-stamped line per start, resume, stop and end of the run."""


def _event(run: Run, text: str, echo: bool = True) -> None:
    """Append ``text`` to the run's ``run.log``; with ``echo``, print it on stderr too."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with (run.run_dir / RUN_LOG).open("a") as log:
        log.write(f"{stamp} {text}\n")
    if echo:
        print(text, file=sys.stderr, flush=True)


def _name(step: int) -> str:
    return f"step_{step:06d}"


def _stopped(run: Run, signum: int | None, saved: int | None) -> str:
    """What a stopped run kept and the command that continues it (first line: what happened).

    ``saved``: the step whose checkpoint the stop wrote or found; None when the step or the
    checkpoint in progress was abandoned (a second signal): the newest checkpoint on disk."""
    found = [p.name for p in list_checkpoints(run.run_dir)]
    how = signal_name(signum) if signum else "a signal"
    if saved is None:
        head = (f"stopped by {how}: the step or checkpoint in progress was abandoned "
                "(no partial files are left)")  # fmt: skip
        kept = found[-1] if found else None
    else:
        head = f"stopped by {how} after step {run.state.step} of {run.cfg.steps}"
        kept = _name(saved) if saved else None
    command = f"anchor-rl train --resume {run.run_dir}"
    if kept is None:
        return f"{head}\nkept: no checkpoint; {command} starts the run again from step 0"
    if found and found[-1] != kept:  # a newer checkpoint of an earlier branch (--from)
        command += f" --from {kept}"
    where = run.run_dir / "checkpoints" / kept
    return f"{head}\nkept: checkpoint {kept} ({where})\nresume with: {command}"


def _diverged(run: Run, cause: str) -> str:
    """The message of a step whose loss or gradient turned NaN/Inf: where, what survives, what
    to try."""
    found = list_checkpoints(run.run_dir)
    kept = (
        f"the last good checkpoint is {found[-1]} (resume it with --resume {run.run_dir})"
        if found
        else "no checkpoint was written yet"
    )
    oc = run.cfg.optim
    return (
        f"step {run.state.step + 1}: {cause} is not finite; the step was not applied or saved, "
        f"{kept}. Try a lower optim.lr (now {oc.lr:g}), a lower optim.grad_clip (now "
        f"{oc.grad_clip:g}), loss.clip_c=3 for large negative advantages, or check the rewards "
        "for NaN"
    )


def _out_of_time(cfg: TrainConfig, elapsed: float) -> bool:
    return cfg.time_limit is not None and elapsed >= cfg.time_limit


def _log(sinks, bar: ProgressBar, step: int, metrics: dict[str, float]) -> None:
    for sink in sinks:
        sink.log(step, metrics)
    bar.update(step, metrics)
