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


@app.callback()
def _root() -> None:
    """RL from verifiable rewards with cheap, accurate advantage baselines."""


# Registration: one line per command, grouped by package.
from anchor_rl.algos import commands as _algos_commands  # noqa: E402

app.command("algos-check")(_algos_commands.algos_check)

from anchor_rl.models import commands as _models_commands  # noqa: E402

app.command("sft")(_models_commands.sft)

from anchor_rl.rollout import commands as _rollout_commands  # noqa: E402

app.command("eval")(_rollout_commands.eval_command)

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


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
