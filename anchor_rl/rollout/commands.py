"""``anchor-rl eval``: sample k responses per prompt and report avg@k, pass@k and the
per-prompt accuracy histogram.

torch and transformers are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

import typer

from anchor_rl.models.commands import default_threads, parse_task_kwargs


def eval_command(
    model: Annotated[Path, typer.Option(help="Model directory (any Hugging Face causal LM).")],
    task: Annotated[str, typer.Option(help="Task name (see anchor_rl.tasks.get_task).")],
    k: Annotated[int, typer.Option(help="Samples per prompt.", min=1)] = 8,
    split: Annotated[
        Literal["train", "test"], typer.Option(help="Which records to evaluate.")
    ] = "test",
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: greedy).", min=0.0)
    ] = 1.0,
    top_p: Annotated[float, typer.Option(help="Nucleus sampling mass.")] = 1.0,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            help="Bound on each response, tool output included. "
            "Default: 1.5 x the longest reference trace, rounded up to 32 tokens."
        ),
    ] = None,
    max_turns: Annotated[int, typer.Option(help="Most tool calls per response.")] = 4,
    limit: Annotated[int | None, typer.Option(help="Evaluate only the first N records.")] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    task_kwargs: Annotated[
        str | None, typer.Option(help="Task constructor kwargs as a JSON object.")
    ] = None,
    device: Annotated[str, typer.Option(help="Torch device.")] = "cpu",
    out: Annotated[
        Path | None,
        typer.Option(help="JSON output. Default: <model>/eval-<task>-<split>-k<k>.json."),
    ] = None,
) -> None:
    """Evaluate a model on a task; prints the metrics and saves them (with per-prompt counts) as JSON."""
    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from anchor_rl.models.loading import load_policy
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.evaluate import evaluate, trace_budget
    from anchor_rl.rollout.types import SamplingParams
    from anchor_rl.tasks import get_task

    transformers.utils.logging.disable_progress_bar()
    torch.set_num_threads(default_threads())
    task_obj = get_task(task, **parse_task_kwargs(task_kwargs))
    policy, tokenizer = load_policy(model, device=device)
    if max_new_tokens is None:
        try:
            max_new_tokens = trace_budget(tokenizer, task_obj, task_obj.records(split)[:limit])
        except NotImplementedError as exc:
            raise typer.BadParameter(
                f"{exc}; pass it explicitly", param_hint="--max-new-tokens"
            ) from exc
    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        max_new_tokens=max_new_tokens,
        max_turns=max_turns,
        stop=task_obj.stop,
    )
    engine = make_engine("hf", policy, tokenizer)
    result = evaluate(engine, task_obj, split, k, params, limit, seed, progress=True)
    result["model"] = str(model)
    table = Table(title=f"{task} / {split}: {result['prompts']} prompts x {k} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result.items():
        if isinstance(value, float):
            table.add_row(name, f"{value:.4f}")
    Console().print(table)
    path = out or Path(model) / f"eval-{task}-{split}-k{k}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    typer.echo(path)
