"""The ``anchor-rl`` command.

Each sub-command lives in its package's ``commands.py`` next to the code it drives and
is registered here. Those modules import torch and transformers lazily inside the
command bodies, so ``anchor-rl --help`` stays fast.

An error ends the command on one screen: ``error: <cause and fix>`` on stderr, exit code 2
for errors a user can fix (``anchor_rl.errors.AnchorRLError``, a bad config, a missing
extra) and 1 for anything else, which also says how to see the traceback: ``--debug``
anywhere on the command line, or ``ANCHOR_RL_DEBUG=1``.
"""

from __future__ import annotations

import os
import sys

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException


class _Commands(TyperGroup):
    """The command group: an error a command raises ends on one screen (``report_error``),
    unless ``--debug`` asks for the traceback."""

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort, TyperException):
            raise  # an exit code, Ctrl-C, a usage error: typer shows them
        except Exception as exc:
            if ctx.params.get("debug") or os.environ.get("ANCHOR_RL_DEBUG", "") not in ("", "0"):
                raise
            raise typer.Exit(report_error(exc)) from None


app = typer.Typer(
    cls=_Commands,
    name="anchor-rl",
    help="RL from verifiable rewards with cheap, accurate advantage baselines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)


@app.callback()
def _root(
    debug: bool = typer.Option(
        False, "--debug", help="Show the traceback of an error (also ANCHOR_RL_DEBUG=1)."
    ),
) -> None:
    """RL from verifiable rewards with cheap, accurate advantage baselines."""


# Registration: one line per command, grouped by package.
from anchor_rl.algos import commands as _algos_commands  # noqa: E402

app.command("algos-check")(_algos_commands.algos_check)

from anchor_rl.models import commands as _models_commands  # noqa: E402

app.command("sft")(_models_commands.sft)

from anchor_rl.rollout import commands as _rollout_commands  # noqa: E402

app.command("eval")(_rollout_commands.eval_command)

from anchor_rl.serve import commands as _serve_commands  # noqa: E402

app.command("serve")(_serve_commands.serve_command)

from anchor_rl.trainer import commands as _trainer_commands  # noqa: E402

app.command("train")(_trainer_commands.train)

from anchor_rl.bench import commands as _bench_commands  # noqa: E402

app.command("bench")(_bench_commands.bench)

from anchor_rl.bench import report as _bench_report  # noqa: E402

app.command("report")(_bench_report.report_command)

from anchor_rl.bench import quickstart as _bench_quickstart  # noqa: E402

app.command("quickstart")(_bench_quickstart.quickstart)

from anchor_rl.anchors import commands as _anchors_commands  # noqa: E402

app.command("presample")(_anchors_commands.presample_command)
app.add_typer(_anchors_commands.anchors_app, name="anchors")


def main(argv: list[str] | None = None) -> None:
    """The console entry point. ``--debug`` may stand anywhere on the command line."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--debug" in args:
        args = ["--debug", *(a for a in args if a != "--debug")]
    app(args=args, prog_name="anchor-rl")


def report_error(exc: BaseException) -> int:
    """Print ``exc`` for the user on stderr; returns the exit code (2: a cause the user can
    fix, 1: an unexpected error)."""
    from anchor_rl.errors import AnchorRLError

    expected = isinstance(
        exc, AnchorRLError | ImportError | FileNotFoundError | FileExistsError | NotImplementedError
    )
    text = str(exc) if expected else f"{type(exc).__name__}: {exc}"
    typer.secho(f"error: {text}", fg=typer.colors.RED, err=True)
    if not expected:
        typer.echo(
            "(an unexpected error: --debug or ANCHOR_RL_DEBUG=1 shows the traceback; "
            "please report it with that)",
            err=True,
        )
    return 2 if expected else 1


if __name__ == "__main__":  # pragma: no cover
    main()
