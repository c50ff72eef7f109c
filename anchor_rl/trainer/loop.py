"""The training loop. It only wires the stages together; each lives in its own module.

One step::

    1 rollout    collect.generate        n responses for each of P prompts
    2 rewards    collect.score           task reward (+ soft overlong punishment)
    3 filter     collect.collect         dynamic sampling: drop all-equal groups, resample
                 v05.v05_stage           V0.5: prior, top-up rollouts where the rollouts
                                         reject it, the fused baseline; the prior learns
                 pvpo.PVPO.step          PVPO: anchor refresh every K steps, teacher rows
                                         replace rollouts (group sampling ran at run start)
    4 log-probs  update.score_logprobs   old (sampling) policy, reference when KL is on
    5 advantage  advantage.compute_advantages   the baseline source, by name
                 critic.critic_step     PPO/VAPO: critic values -> GAE -> critic update
    6 update     update.ppo_update       epochs x mini-batches x micro-batches, AdamW
    7 metrics, held-out evaluation every eval.every steps, checkpoint every checkpoint.every
      (before a step, when v05.probe_every asks: v05_probe.run_probe, outside the step's clock)

Log-probs come before the advantage because a KL penalty in the reward (REINFORCE++,
RLOO) needs the reference log-probs there.
"""

from __future__ import annotations

import time

from anchor_rl.algos.losses import kl
from anchor_rl.trainer.advantage import advantage_metrics, compute_advantages
from anchor_rl.trainer.collect import collect
from anchor_rl.trainer.config import TrainConfig
from anchor_rl.trainer.critic import critic_step
from anchor_rl.trainer.logging import ProgressBar, open_sinks
from anchor_rl.trainer.run import Run, counters, evaluate_policy, write_summary
from anchor_rl.trainer.timing import Timer
from anchor_rl.trainer.update import (
    behaviour_logprobs,
    loss_mask,
    ppo_update,
    score_logprobs,
    token_mean,
)
from anchor_rl.trainer.v05 import v05_stage
from anchor_rl.trainer.v05_probe import run_probe


def train_step(run: Run) -> dict[str, float]:
    """One step: rollout -> rewards -> filter -> log-probs -> advantage -> update."""
    cfg, timer = run.cfg, Timer()
    # 1-3: rollout -> rewards -> filter (several rounds under dynamic sampling)
    scored, metrics = collect(run.engine, run.sampler, run.task, cfg, run.generator, timer)
    # V0.5: the prior, top-up rollouts (counted in rollouts/step), the fused baseline b[B]
    scored, v05_baseline, metrics = v05_stage(run, scored, metrics, timer)
    run.state.rollouts += int(metrics["rollouts/step"])
    run.state.tokens += int(metrics["tokens/step"])
    if run.pvpo is not None:  # PVPO: anchor refresh when due; teacher trajectories replace rollouts
        scored, pvpo_metrics = run.pvpo.step(scored, run.state, run.policy)
        metrics |= pvpo_metrics
    if len(scored):  # dynamic sampling can end a step with no group kept: nothing to learn from
        batch, mask = scored.batch, loss_mask(scored.batch, cfg)
        with timer("update"):
            # 4: log-probs under the sampling policy (recomputed; off-policy rows such as PVPO's
            # teacher trajectories keep the log-probs they came with) and the reference
            old_logp, entropy = score_logprobs(run.policy, batch, cfg, with_entropy=True)
            old_logp = behaviour_logprobs(old_logp, batch, scored.off_policy)
            ref_logp = None if run.ref is None else score_logprobs(run.ref, batch, cfg)[0]
            # 5: baseline and advantage; with a critic (PPO, VAPO): GAE, then the critic's update
            if run.critic is None:
                anchor = v05_baseline  # the prompt's baseline: V0.5's fused prior, or PVPO's V_sta
                if anchor is None and run.pvpo is not None:
                    anchor = run.pvpo.batch_anchors(scored)
                adv = compute_advantages(
                    cfg, scored.rewards, batch.group, mask, old_logp, ref_logp, anchor
                )
            else:
                adv, critic_metrics = critic_step(
                    run.critic, batch, scored.rewards, mask, old_logp, ref_logp, cfg, run.generator
                )
                metrics |= critic_metrics
            # 6: policy update
            metrics |= ppo_update(
                run.policy, run.optimizer, run.scheduler, batch, mask,
                old_logp, ref_logp, adv, scored.correct, cfg, run.generator,
            )  # fmt: skip
        metrics |= advantage_metrics(adv, mask)
        metrics["policy/entropy"] = token_mean(entropy, batch.loss_mask)
        if ref_logp is not None:
            metrics["kl/ref"] = token_mean(kl(old_logp, ref_logp, cfg.kl.kind), batch.loss_mask)
    metrics |= counters(run.state)
    metrics |= {f"time/{name}": timer.seconds[name] for name in ("generate", "score", "update")}
    return metrics


def train(run: Run) -> Run:
    """Run the loop from ``run.state.step`` to ``cfg.steps`` (a new run, or a resumed one:
    see ``run.start_run`` and ``run.resume_run``).

    Writes metrics, TensorBoard events, checkpoints and ``summary.json`` to the run directory.
    """
    cfg, state = run.cfg, run.state
    resumed_at = state.step or None  # a resumed run always restarts after a saved step >= 1
    sinks = open_sinks(cfg.log, run.run_dir, cfg.model_dump(mode="json"), resumed_at)
    metrics: dict[str, float] = {}
    try:
        with ProgressBar(cfg.steps, state.step, cfg.log.progress) as bar:
            if state.step == 0 and cfg.eval.every:
                started = time.perf_counter()
                metrics = {**evaluate_policy(run, 0), **counters(state)}
                state.elapsed += time.perf_counter() - started
                _log(sinks, bar, 0, metrics | {"time/elapsed": state.elapsed})
            while state.step < cfg.steps and not _out_of_time(cfg, state.elapsed):
                probe = run_probe(run, state.step + 1)  # V0.5 baseline-MSE probe, when due; untimed
                started = time.perf_counter()
                metrics = train_step(run) | probe
                state.step += 1
                last = state.step == cfg.steps or _out_of_time(
                    cfg, state.elapsed + time.perf_counter() - started
                )
                if cfg.eval.every and (state.step % cfg.eval.every == 0 or last):
                    metrics |= evaluate_policy(run, state.step)
                metrics["time/step"] = time.perf_counter() - started
                state.elapsed += metrics["time/step"]
                _log(sinks, bar, state.step, metrics | {"time/elapsed": state.elapsed})
                if (cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0) or last:
                    run.save()
    finally:
        for sink in sinks:
            sink.close()
    write_summary(run, metrics)
    return run


def _out_of_time(cfg: TrainConfig, elapsed: float) -> bool:
    return cfg.time_limit is not None and elapsed >= cfg.time_limit


def _log(sinks, bar: ProgressBar, step: int, metrics: dict[str, float]) -> None:
    for sink in sinks:
        sink.log(step, metrics)
    bar.update(step, metrics)
