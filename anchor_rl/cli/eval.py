"""``anchor-rl eval``: sample k responses per prompt and report avg@k, pass@k and the
per-prompt accuracy histogram.

torch and transformers are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

import typer

from anchor_rl.cli.options import (
    AdapterOpt,
    DeviceOpt,
    TaskKwargsOpt,
    ThreadsOption,
    TokenizerOpt,
    open_engine,
    parse_task_kwargs,
    sampling_option,
    use_threads,
)


def eval_command(
    model: Annotated[
        str,
        typer.Option(
            help="A model directory (any Hugging Face causal LM), sft:SIZE, random:SIZE, or "
            "http:URL[#MODEL] (a served model, e.g. `anchor-rl serve`)."
        ),
    ],
    task: Annotated[str, typer.Option(help="Task name (see anchor_rl.tasks.get_task).")],
    k: Annotated[int, typer.Option(help="Samples per prompt.", min=1)] = 8,
    split: Annotated[
        Literal["train", "test"], typer.Option(help="Which records to evaluate.")
    ] = "test",
    temperature: Annotated[
        float, typer.Option(help="Sampling temperature (0: greedy).", min=0.0)
    ] = 1.0,
    top_p: Annotated[
        float, typer.Option(help="Nucleus sampling mass, in (0, 1].", min=0.0, max=1.0)
    ] = 1.0,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Bound on each response, tool output included. "
            "Default: 1.5 x the longest reference trace, rounded up to 32 tokens.",
        ),
    ] = None,
    max_turns: Annotated[int, typer.Option(help="Most tool calls per response.", min=0)] = 4,
    limit: Annotated[
        int | None, typer.Option(help="Evaluate only the first N records.", min=1)
    ] = None,
    seed: Annotated[int, typer.Option(help="Sampling seed.")] = 0,
    task_kwargs: TaskKwargsOpt = None,
    device: DeviceOpt = "cpu",
    tokenizer: TokenizerOpt = None,
    adapter: AdapterOpt = None,
    out: Annotated[
        Path | None,
        typer.Option(
            help="JSON output. Default: <model>/eval-<task>-<split>-k<k>.json for a model "
            "directory, ./eval-<model>-<task>-<split>-k<k>.json otherwise."
        ),
    ] = None,
    threads: ThreadsOption = "auto",
) -> None:
    """Evaluate a model on a task; prints the metrics and saves them (with per-prompt counts) as JSON."""
    import transformers
    from rich.console import Console
    from rich.table import Table

    from anchor_rl.errors import AnchorRLError
    from anchor_rl.models.loading import check_device
    from anchor_rl.rollout.evaluate import evaluate, trace_budget
    from anchor_rl.tasks import get_task
    from anchor_rl.threads import choice_for

    if out is not None and out.is_dir():  # found now, not after the evaluation
        example = out / f"eval-{task}-{split}-k{k}.json"
        raise typer.BadParameter(
            f"{out} is a directory; give a file to write, e.g. {example}", param_hint="--out"
        )
    check_device(device)
    transformers.utils.logging.disable_progress_bar()
    use_threads(threads)
    kwargs = parse_task_kwargs(task_kwargs)
    try:
        task_obj = get_task(task, **kwargs)
    except AnchorRLError:  # a dataset's own error names the file and row: reported as is
        raise
    except (ValueError, TypeError) as exc:  # the task's arguments
        raise typer.BadParameter(str(exc), param_hint="--task") from exc
    engine, policy, tok = open_engine(model, task, kwargs, seed, device, tokenizer, adapter)
    if policy is not None and (chosen := choice_for(policy)) is not None:
        typer.echo(chosen.line(("generate",)))
    if max_new_tokens is None:
        try:
            max_new_tokens = trace_budget(tok, task_obj, task_obj.records(split)[:limit])
        except NotImplementedError as exc:
            raise typer.BadParameter(
                f"{exc}; pass it explicitly", param_hint="--max-new-tokens"
            ) from exc
    params = sampling_option(
        temperature=temperature, top_p=top_p, max_new_tokens=max_new_tokens, max_turns=max_turns,
        stop=task_obj.stop,
    )  # fmt: skip
    result = evaluate(engine, task_obj, split, k, params, limit, seed, progress=True)
    result["model"] = model
    if model.startswith("http:"):  # served: say which weights
        result["server"] = {"model": engine.model, "fingerprint": engine.info().fingerprint}
    table = Table(title=f"{task} / {split}: {result['prompts']} prompts x {k} samples")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in result.items():
        if isinstance(value, float):
            table.add_row(name, f"{value:.4f}")
    Console().print(table)
    if out is not None:
        path = out
    elif adapter is not None or (Path(model) / "config.json").is_file():  # a model directory
        path = Path(adapter or model) / f"eval-{task}-{split}-k{k}.json"
    else:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-")
        path = Path(f"eval-{slug}-{task}-{split}-k{k}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    typer.echo(path)
