"""``anchor-rl eval``: sample k responses per prompt and report avg@k, pass@k and the
per-prompt accuracy histogram.

torch and transformers are imported inside the command so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from anchor_rl.cli.options import (
    ThreadsOption,
    load_model,
    parse_task_kwargs,
    served,
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
    task_kwargs: Annotated[
        str | None, typer.Option(help="Task constructor kwargs as a JSON object.")
    ] = None,
    device: Annotated[str, typer.Option(help="Torch device.")] = "cpu",
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            help="Tokenizer directory for an http: model whose server does not serve its "
            "tokenizer (anchor-rl serve does)."
        ),
    ] = None,
    adapter: Annotated[
        Path | None,
        typer.Option(
            help="A LoRA adapter directory (PEFT format: a LoRA run's checkpoint policy/) "
            "applied to --model, its base model; merged into its weights."
        ),
    ] = None,
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
    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from anchor_rl.errors import AnchorRLError
    from anchor_rl.models.loading import check_device
    from anchor_rl.rollout.evaluate import evaluate, trace_budget
    from anchor_rl.rollout.types import SamplingParams
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
    engine, tok, where = _engine(model, task, kwargs, seed, device, tokenizer, adapter)
    local = getattr(engine, "model", None)  # the hf engine's model; a served one is a name
    if isinstance(local, torch.nn.Module) and (chosen := choice_for(local)) is not None:
        typer.echo(chosen.line(("generate",)))
    if max_new_tokens is None:
        try:
            max_new_tokens = trace_budget(tok, task_obj, task_obj.records(split)[:limit])
        except NotImplementedError as exc:
            raise typer.BadParameter(
                f"{exc}; pass it explicitly", param_hint="--max-new-tokens"
            ) from exc
    try:
        params = SamplingParams(
            temperature=temperature,
            top_p=top_p,
            max_new_tokens=max_new_tokens,
            max_turns=max_turns,
            stop=task_obj.stop,
        )
    except ValueError as exc:  # e.g. top_p = 0
        raise typer.BadParameter(str(exc)) from exc
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
    elif where is not None:
        path = where / f"eval-{task}-{split}-k{k}.json"
    else:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model).strip("-")
        path = Path(f"eval-{slug}-{task}-{split}-k{k}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    typer.echo(path)


def _engine(
    model: str,
    task: str,
    task_kwargs: dict[str, Any],
    seed: int,
    device: str,
    tokenizer: Path | None,
    adapter: Path | None = None,
) -> tuple[Any, Any, Path | None]:
    """The engine a ``--model`` names, its tokenizer, and the model directory (None unless
    ``model`` is one): ``http:URL`` samples through the ``http`` engine, anything else loads
    with ``load_spec`` and samples in this process."""
    from anchor_rl.rollout.engine import make_engine
    from anchor_rl.rollout.spec import bare_url

    if why := bare_url(model):  # http://... starts with "http:" too
        raise typer.BadParameter(why, param_hint="--model")
    if model.startswith("http:"):
        if adapter is not None:
            raise typer.BadParameter(
                "--adapter applies to a model loaded here; load the adapter into the server "
                "instead (anchor-rl serve --adapter)",
                param_hint="--adapter",
            )
        engine = served(model, tokenizer)
        return engine, engine.tokenizer, None
    policy, tok = load_model(model, task, task_kwargs, seed, device, adapter)
    where = Path(model) if (Path(model) / "config.json").is_file() else None
    return make_engine("hf", policy, tok), tok, adapter if adapter is not None else where
