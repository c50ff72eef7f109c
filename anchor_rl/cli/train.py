"""``anchor-rl train``: train a policy from a preset with ``key=value`` overrides, or resume.

torch and transformers are imported inside the command, so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated

import typer

from anchor_rl.errors import ConfigError
from anchor_rl.trainer.config import describe, load_config
from anchor_rl.trainer.presets import parse_override

SETUP_STOPPED = (
    "stopped by {signal} while the run was set up, before its first step: no checkpoint is "
    "needed before step 1 (nothing to keep); the same command starts it again"
)


@contextmanager
def _set_up() -> Iterator[None]:
    """SIGTERM or Ctrl-C while the run is set up (the model loaded, Ray workers started,
    anchors presampled) stops it at once (``anchor_rl.interrupt``, ``at_once``: the command
    group prints :data:`SETUP_STOPPED` and exits 143 or 130), after shutting down the Ray
    this process started or joined; also when ``ray.init`` installed its own SIGTERM handler
    meanwhile (``cluster.connect`` reclaims the signal)."""
    from anchor_rl.interrupt import stop_signals

    try:
        with stop_signals(at_once=SETUP_STOPPED):
            yield
    except KeyboardInterrupt:  # Interrupted, or Ctrl-C off the main thread
        _shutdown_ray()
        raise


def _shutdown_ray() -> None:
    """Stop the workers and the local Ray of an abandoned set-up (none if Ray never loaded)."""
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


@contextmanager
def _stop_exits() -> Iterator[None]:
    """Ctrl-C that reaches the command outside the stop blocks ends with what to do and exit
    code 130; a stop during set-up, training or SFT (``anchor_rl.interrupt``) says what it
    kept (the command group prints it, with its exit code)."""
    from anchor_rl.interrupt import Interrupted

    try:
        yield
    except Interrupted:
        raise
    except KeyboardInterrupt:
        typer.echo(SETUP_STOPPED.format(signal="SIGINT"), err=True)
        raise typer.Exit(130) from None


def train(
    overrides: Annotated[
        list[str] | None,
        typer.Argument(
            help="Config overrides, key=value with dotted keys (rollout.n=16 kl.coef=0)."
        ),
    ] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            "--preset", "-p", help="A built-in preset name or a path to a preset TOML file."
        ),
    ] = None,
    resume: Annotated[
        Path | None,
        typer.Option(
            "--resume", help="Continue the run in this directory from its last checkpoint."
        ),
    ] = None,
    from_checkpoint: Annotated[
        str | None,
        typer.Option(
            "--from", help="With --resume: the checkpoint to continue from (e.g. step_000040)."
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Run directory (default: runs/<preset>-<time>)."),
    ] = None,
    show_config: Annotated[
        bool, typer.Option("--show-config", help="Print the resolved config and exit.")
    ] = False,
    list_fields: Annotated[
        bool,
        typer.Option(
            "--list-fields",
            help="Print every config field, default and meaning as a markdown table and exit.",
        ),
    ] = False,
) -> None:
    """Train with RL from verifiable rewards.

    Presets: grpo, drgrpo, dapo, rloo, reinforce_pp, reinforce_pp_baseline, ppo, vapo, pvpo,
    v05, astarpo; bounds: perfect, v05_perfect. Settings apply as defaults < preset < overrides; invalid keys or values fail before
    any work.

    SIGTERM or Ctrl-C finishes the step in progress, writes its checkpoint, prints the
    command that resumes the run and exits with 143 (SIGTERM) or 130 (SIGINT); a second
    signal stops at once, keeping the last checkpoint written.
    """
    if list_fields:
        typer.echo("| key | default | meaning |\n| --- | --- | --- |")
        for key, default, doc in describe():
            typer.echo(f"| `{key}` | `{default}` | {doc} |")
        return
    overrides = overrides or []
    if from_checkpoint is not None and resume is None:
        raise ConfigError("--from picks the checkpoint of a resumed run: add --resume RUN_DIR")
    if resume is not None:
        if preset is not None or out is not None:
            raise ConfigError(
                "--resume takes the run's own preset and directory; drop --preset/--out"
            )
        resume_overrides = dict(parse_override(o) for o in overrides)
        from anchor_rl.trainer.loop import train as run_loop
        from anchor_rl.trainer.run import load_task, resume_point, resume_run, resumed_config

        if show_config:  # what the resumed run would train with, checked as resume checks it
            cfg = resumed_config(resume, resume_overrides)
            # the checkpoint checked as resume checks it; not the device (shown elsewhere)
            resume_point(resume, cfg, from_checkpoint)
            load_task(cfg)
            typer.echo(cfg.model_dump_json(indent=2))
            return

        with _stop_exits():
            with _set_up():
                resumed = resume_run(resume, resume_overrides, from_checkpoint)
            run = run_loop(resumed)
    else:
        cfg = load_config(preset, overrides)
        from anchor_rl.trainer.loop import train as run_loop
        from anchor_rl.trainer.run import load_task, start_run

        if show_config:  # the task and its arguments checked too, as a run would
            load_task(cfg)
            typer.echo(cfg.model_dump_json(indent=2))
            return

        run_dir = out or Path("runs") / f"{cfg.preset or 'custom'}-{time.strftime('%Y%m%d-%H%M%S')}"
        with _stop_exits():
            with _set_up():
                started = start_run(cfg, run_dir)
            run = run_loop(started)
    typer.echo(f"run finished: {run.run_dir} (metrics.jsonl, tb/, checkpoints/, summary.json)")
