"""The ``anchor-rl`` command.

Each sub-command lives in its package's ``commands.py`` next to the code it drives and
is registered here. Those modules import torch and transformers lazily inside the
command bodies, so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(
    name="anchor-rl",
    help="RL from verifiable rewards with cheap, accurate advantage baselines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
)

# Registration: one line per command, grouped by package.
from anchor_rl.algos import commands as _algos_commands  # noqa: E402

app.command("algos-check")(_algos_commands.algos_check)


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
