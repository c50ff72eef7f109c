"""The ``anchor-rl`` command.

Each group of sub-commands is a module of this package (``train``, ``eval``, ``sft``,
``serve``, ``anchors``, ``bench``, ``algos``), registered here. Those modules import torch and
transformers lazily inside the command bodies, so ``anchor-rl --help`` stays fast.

An error ends the command on one screen: ``error: <cause and fix>`` on stderr, exit code 2
for errors a user can fix (``anchor_rl.errors.AnchorRLError``, a bad config, a missing
extra) and 1 for anything else, which also says how to see the traceback: ``--debug``
anywhere on the command line, or ``ANCHOR_RL_DEBUG=1``.
"""

from __future__ import annotations

import inspect
import os
import sys

import typer
from typer.core import TyperGroup
from typer.exceptions import TyperException

from anchor_rl.interrupt import Interrupted


class _Commands(TyperGroup):
    """The command group: an error a command raises ends on one screen (``report_error``),
    unless ``--debug`` asks for the traceback; every command's help is unwrapped
    (:func:`unwrap_help`)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        todo: list = [self]
        while todo:
            command = todo.pop()
            command.help = unwrap_help(command.help)
            todo.extend(getattr(command, "commands", {}).values())

    def invoke(self, ctx: typer.Context):  # type: ignore[override]
        try:
            return super().invoke(ctx)
        except Interrupted as exc:  # SIGTERM or Ctrl-C: what the job kept, how to continue it
            typer.echo(str(exc), err=True)
            raise typer.Exit(exc.exit_code) from None
        except (typer.Exit, typer.Abort, TyperException):
            raise  # an exit code, Ctrl-C, a usage error: typer shows them
        except Exception as exc:
            if ctx.params.get("debug") or os.environ.get("ANCHOR_RL_DEBUG", "") not in ("", "0"):
                raise
            raise typer.Exit(report_error(exc)) from None


def unwrap_help(text: str | None) -> str | None:
    """A docstring's help with each paragraph on one line.

    Rich's help keeps a docstring's single line breaks (in the command list and below the
    first paragraph), so at any other terminal width they fall mid-sentence; joined, rich
    wraps each paragraph to the terminal. Paragraphs stay apart, one that starts with
    ``\\b`` (click's mark for text to keep as written) is kept as it is, and what follows
    ``\\f`` (click's mark for text the help leaves out) is dropped.
    """
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).partition("\f")[0].rstrip().split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split()) for p in paragraphs)


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


# Registration: one line per command.
from anchor_rl.cli import algos, anchors, bench, serve, sft, train  # noqa: E402
from anchor_rl.cli import eval as evaluate  # noqa: E402

app.command("algos-check")(algos.algos_check)
app.command("sft")(sft.sft)
app.command("eval")(evaluate.eval_command)
app.command("serve")(serve.serve_command)
app.command("train")(train.train)
app.command("bench")(bench.bench)
app.command("report")(bench.report_command)
app.command("quickstart")(bench.quickstart)
app.command("presample")(anchors.presample_command)
app.add_typer(anchors.anchors_app, name="anchors")


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
