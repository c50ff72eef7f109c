"""``anchor-rl presample`` and ``anchor-rl anchors {export,keys,filter}``.

torch and transformers are imported inside the commands so ``anchor-rl --help`` stays fast.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from anchor_rl.cli.options import (
    DeviceOpt,
    TaskKwargsOpt,
    TokenizerOpt,
    open_engine,
    parse_task_kwargs,
    sampling_option,
)

if TYPE_CHECKING:
    from anchor_rl.anchors.keys import AnchorKey
    from anchor_rl.anchors.store import AnchorStat, AnchorStore
    from anchor_rl.anchors.teachers import Teacher
    from anchor_rl.rollout.types import SamplingParams
    from anchor_rl.tasks.base import Record, Task

anchors_app = typer.Typer(
    help="Inspect the anchor store and run PVPO group sampling.", no_args_is_help=True
)

FROM_PRESET = " Default: the preset's rollout setting."


@dataclass
class _Setup:
    config: Any  # the preset's TrainConfig
    model: Any  # None for a served (http:) model
    tokenizer: Any
    engine: Any
    task: Task
    task_name: str
    task_id: str
    task_kwargs: dict[str, Any]
    records: list[Record]
    params: SamplingParams
    key: AnchorKey
    db: Path
    preset: str
    split: str
    seed: int
    device: str


def _setup(
    model: Annotated[
        str,
        typer.Option(
            help="Reference policy: a model directory, sft:SIZE, random:SIZE or http:URL[#MODEL] "
            "(a served model, e.g. `anchor-rl serve`).",
        ),
    ],
    preset: Annotated[
        str,
        typer.Option(
            "--preset",
            "-p",
            help="Training preset (name or .toml) whose task and rollout settings are the "
            "defaults, so the anchors land under the key `anchor-rl train` looks up.",
        ),
    ] = "pvpo",
    task: Annotated[
        str | None,
        typer.Option(help="Task name (see anchor_rl.tasks.get_task). Default: the preset's."),
    ] = None,
    task_kwargs: TaskKwargsOpt = None,
    db: Annotated[
        Path | None, typer.Option(help="Anchor store file. Default: $ANCHOR_RL_CACHE/anchors.db.")
    ] = None,
    split: Annotated[str, typer.Option(help="Records split to presample.")] = "train",
    limit: Annotated[
        int | None, typer.Option(min=1, help="Only the first N records of the split.")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option(min=0.0, help="Sampling temperature." + FROM_PRESET)
    ] = None,
    top_p: Annotated[
        float | None, typer.Option(min=0.0, max=1.0, help="Nucleus sampling mass." + FROM_PRESET)
    ] = None,
    max_new_tokens: Annotated[
        int | None,
        typer.Option(min=1, help="Token budget per response (tool output included)." + FROM_PRESET),
    ] = None,
    max_turns: Annotated[
        int | None, typer.Option(min=0, help="Most tool calls per response." + FROM_PRESET)
    ] = None,
    seed: Annotated[
        int,
        typer.Option(
            help="Seed of the anchor draw (part of the store key) and of a random:SIZE init: a "
            "training run's pvpo.presample_seed (0 unless set), for the run to find these "
            "anchors."
        ),
    ] = 0,
    device: DeviceOpt = "cpu",
    tokenizer: TokenizerOpt = None,
) -> _Setup:
    """Everything a presample or filter command needs, from the options they share (declared
    here once; :func:`_with_setup` gives them to both commands); sampling settings and the
    task left as None come from ``preset``, as ``anchor-rl train --preset`` would use them."""
    from anchor_rl.anchors.keys import task_identity
    from anchor_rl.anchors.presample import presample_key, task_params
    from anchor_rl.paths import store_path
    from anchor_rl.tasks import get_task
    from anchor_rl.trainer.config import load_config

    if db is not None and db.is_dir():  # found now, not after loading the model
        raise typer.BadParameter(
            f"{db} is a directory; give the anchor store's file, e.g. {db / 'anchors.db'}",
            param_hint="--db",
        )
    cfg = load_config(preset, [])
    if task is None:
        task = cfg.task
        kwargs = parse_task_kwargs(task_kwargs) if task_kwargs is not None else cfg.task_args
    else:
        kwargs = parse_task_kwargs(task_kwargs)
    try:
        task_obj = get_task(task, **kwargs)
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(str(exc), param_hint="--task") from exc
    if split not in ("train", "test"):
        raise typer.BadParameter(
            f"unknown split {split!r}; choose train or test", param_hint="--split"
        )
    records = task_obj.records(split)[:limit]
    given = {"temperature": temperature, "top_p": top_p, "max_new_tokens": max_new_tokens,
             "max_turns": max_turns}  # fmt: skip
    sampling = {k: getattr(cfg.rollout, k) if v is None else v for k, v in given.items()}
    params = task_params(sampling_option(**sampling), task_obj)
    task_id = task_identity(task, task_obj, kwargs)
    engine, policy, tok = open_engine(model, task, kwargs, seed, device, tokenizer, freeze=True)
    if policy is None:  # served
        key = _served_key(engine, params, task_id, seed)
    else:
        key = presample_key(policy, tok, params, task_id, seed=seed)
    return _Setup(
        cfg, policy, tok, engine, task_obj, task, task_id, kwargs, records, params, key,
        store_path(db), preset, split, seed, device,
    )  # fmt: skip


def _with_setup(command: Callable[..., None]) -> Callable[..., None]:
    """``command(s, **own)`` as a Typer command taking :func:`_setup`'s options (the model,
    task and sampling options presample and filter share) and ``command``'s own: ``s`` is the
    :class:`_Setup` of the former."""
    shared = inspect.signature(_setup, eval_str=True).parameters
    own = list(inspect.signature(command, eval_str=True).parameters.values())[1:]

    @functools.wraps(command)
    def run(**options: Any) -> None:
        command(_setup(**{name: options.pop(name) for name in shared}), **options)

    del run.__wrapped__  # typer reads the options from __signature__
    run.__annotations__ = {}
    params = [p.replace(kind=p.KEYWORD_ONLY) for p in (*shared.values(), *own)]
    run.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return run


def _served_key(engine: Any, params: SamplingParams, task_id: str, seed: int) -> AnchorKey:
    """The presample key of a served model. Its model fingerprint is the content fingerprint
    the server reports (``anchor-rl serve``: ``fingerprint_model`` of its weights, so the key
    is the one an in-process presample of the same weights has), else the served model's
    name: a server that swaps weights under one name is then not detected."""
    from anchor_rl.anchors.keys import AnchorKey, canonical_json, fingerprint_tokenizer
    from anchor_rl.anchors.presample import seeded_settings

    info = engine.info(refresh=True)
    tokenizer = fingerprint_tokenizer(engine.tokenizer)
    if info.tokenizer_fingerprint is not None and info.tokenizer_fingerprint != tokenizer:
        raise typer.BadParameter(
            f"the server {engine.url} serves another tokenizer than the one given; the anchors "
            "would be filed under the wrong tokenizer",
            param_hint="--tokenizer",
        )
    model = info.fingerprint or "http:" + canonical_json({"model": info.model})
    return AnchorKey(
        model=model,
        tokenizer=tokenizer,
        sampling=seeded_settings(params, seed),
        task=task_id,
        tag="presample",
    )


def _distribution_table(stats: dict[str, AnchorStat], title: str) -> Any:
    from rich.table import Table

    from anchor_rl.anchors.filter import PAPER_DISTRIBUTIONS

    total = max(len(stats), 1)
    counts = [
        sum(s.none_correct for s in stats.values()),
        sum(not s.none_correct and not s.all_correct for s in stats.values()),
        sum(s.all_correct for s in stats.values()),
    ]
    table = Table(title=title)
    table.add_column("reference accuracy")
    table.add_column("prompts", justify="right")
    table.add_column("fraction", justify="right")
    for name in PAPER_DISTRIBUTIONS:
        table.add_column(f"paper: {name}", justify="right")
    for i, label in enumerate(["acc = 0", "0 < acc < 1", "acc = 1"]):
        paper = (f"{PAPER_DISTRIBUTIONS[name][i]:.1%}" for name in PAPER_DISTRIBUTIONS)
        table.add_row(label, str(counts[i]), f"{counts[i] / total:.1%}", *paper)
    return table


def _key_note(store: Any, key: AnchorKey, ids: list[str], m: int) -> str:
    """Whether the store is reused under ``key`` (and how many of its prompts hold fewer than
    ``m`` rollouts, to be topped up) and, when nothing is there, why: other keys of the same
    model, tokenizer and task, with the sampling settings that differ."""
    import json

    stored = store.get_anchors(key, ids)
    if stored:
        short = sum(1 for stat in stored.values() if stat.n < m)
        top_up = f", {short} of them to be topped up to M = {m}" if short else ""
        return (
            f"reusing the anchors of {len(stored)} of {len(ids)} prompts already under this "
            f"key{top_up}"
        )
    ours, registered = key.to_dict(), store.keys()
    others = [
        k for k in registered
        if k["tag"] == key.tag and k["digest"] != key.digest and k["model"] == ours["model"]
        and k["tokenizer"] == ours["tokenizer"] and k["task"] == ours["task"]
    ]  # fmt: skip
    if not others:
        return "no anchors under this key yet: sampling all of them"
    diffs = []
    for k in others:
        theirs = json.loads(k["sampling"]) if isinstance(k["sampling"], str) else k["sampling"]
        changed = sorted(f for f in {*theirs, *ours["sampling"]}
                         if theirs.get(f) != ours["sampling"].get(f))  # fmt: skip
        diffs.append(f"{k['digest'][:12]} ({', '.join(f'{f} {theirs.get(f)}' for f in changed)})")
    return (
        "no anchors under this key yet: sampling all of them. The store holds this model and "
        f"task under other sampling settings: {'; '.join(diffs)}; the settings above are "
        "this one's (give --max-new-tokens etc. to match those, or --preset for another run's)"
    )


def _check_export_path(out: Path | None, option: str = "--export") -> Path | None:
    """``out``; a usage error naming it unless anchors can be exported there: a ``.jsonl`` or
    ``.parquet`` file name, not a directory's (None passes)."""
    if out is None:
        return out
    if out.suffix not in (".jsonl", ".parquet"):
        raise typer.BadParameter(f"{out} must end in .jsonl or .parquet", param_hint=option)
    if out.is_dir():
        raise typer.BadParameter(f"{out} is a directory; give a file to write", param_hint=option)
    return out


@_with_setup
def presample_command(
    s: _Setup,
    m: Annotated[
        int | None,
        typer.Option(
            "--m", min=1, help="Reference rollouts per prompt (M). Default: the preset's pvpo.m."
        ),
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Prompts per sampling call (each gets M rollouts). "
            "Default: the preset's pvpo.presample_batch.",
        ),
    ] = None,
    export: Annotated[
        Path | None,
        typer.Option(
            help="Also export this key's anchors (.jsonl or .parquet).",
            callback=lambda out: _check_export_path(out),  # found before the sampling
        ),
    ] = None,
) -> None:
    """Roll the reference policy out M times per prompt and store each prompt's anchor.

    Stores per prompt: mean reward (PVPO's static anchor), accuracy, number of rollouts and
    times, under a key hashing the model weights, tokenizer, sampling settings and task.
    Interrupt it at any time: running the same command again only samples what is missing.
    """
    from rich.console import Console

    from anchor_rl.anchors.presample import RolloutSampler, presample
    from anchor_rl.anchors.store import AnchorStore

    m = s.config.pvpo.m if m is None else m
    batch_size = s.config.pvpo.presample_batch if batch_size is None else batch_size
    console = Console()
    p = s.params
    console.print(
        f"presample {s.task_name}/{s.split}: {len(s.records)} prompts x M={m} into {s.db} "
        f"(key {s.key.digest}; temperature {p.temperature:g}, top_p {p.top_p:g}, "
        f"max_new_tokens {p.max_new_tokens}, max_turns {p.max_turns}: preset {s.preset}'s "
        "unless given)"
    )
    sampler = RolloutSampler(s.engine, s.task, s.params)
    with AnchorStore(s.db) as store:
        console.print(_key_note(store, s.key, [r.id for r in s.records], m))
        result = presample(s.records, sampler, store, s.key, m, batch_size=batch_size, seed=s.seed)
        stats = store.get_anchors(s.key, [r.id for r in s.records])
        if export is not None:
            rows = store.export(export, key=s.key)
            console.print(f"exported {rows} rows to {export}")
    mean = sum(st.mean for st in stats.values()) / max(len(stats), 1)
    console.print(
        f"sampled {result.rollouts} rollouts for {result.prompts_sampled} prompts "
        f"({result.prompts_reused} already held M = {m} or more); mean anchor {mean:.4f}"
    )
    ns = sorted({st.n for st in stats.values()})
    spread = f"{ns[0]}" if len(ns) == 1 else f"{ns[0]}-{ns[-1]}"
    held = f"M = {m}" if ns in ([], [m]) else f"M = {m}; stored n = {spread}"
    console.print(
        _distribution_table(stats, f"reference accuracy over {len(stats)} prompts ({held})")
    )


def _full_digest(store: AnchorStore, prefix: str) -> str:
    """The key digest of ``store`` that ``prefix`` starts (the messages print 12 characters);
    a usage error naming the store's keys when none or several do."""
    registered = store.keys()  # a list of the keys' rows, not a mapping's keys
    digests = [row["digest"] for row in registered]
    found = [d for d in digests if d.startswith(prefix)]
    if len(found) == 1:
        return found[0]
    what = "no key" if not found else f"{len(found)} keys"
    raise typer.BadParameter(
        f"{what} of {store.path} start with {prefix!r}; its keys: "
        f"{', '.join(d[:12] for d in digests) or 'none'} (anchor-rl anchors keys lists them)",
        param_hint="--key",
    )


@anchors_app.command("export")
def export_command(
    db: Annotated[Path, typer.Argument(help="Anchor store file.", exists=True, dir_okay=False)],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file: .jsonl or .parquet.")],
    table: Annotated[
        str, typer.Option(help="stats (anchors) or trajectories (teacher).")
    ] = "stats",
    key: Annotated[
        str | None,
        typer.Option(help="Only rows under this key digest (or a unique prefix of it)."),
    ] = None,
) -> None:
    """Export anchors or teacher trajectories for inspection, joined with their key's fields."""
    from anchor_rl.anchors.store import AnchorStore

    if table not in ("stats", "trajectories"):
        raise typer.BadParameter(
            f"unknown table {table!r}; choose stats or trajectories", param_hint="--table"
        )
    _check_export_path(out, "--out")
    with AnchorStore(db) as store:
        if key is not None:
            key = _full_digest(store, key)
        rows = store.export(out, table=table, key=key)  # type: ignore[arg-type]
    typer.echo(f"{rows} rows -> {out}")


@anchors_app.command("keys")
def keys_command(
    db: Annotated[Path, typer.Argument(help="Anchor store file.", exists=True, dir_okay=False)],
) -> None:
    """List the keys in a store: digest, tag, task, row counts."""
    from rich.console import Console
    from rich.table import Table

    from anchor_rl.anchors.store import AnchorStore

    with AnchorStore(db) as store:
        keys = store.keys()
    table = Table(title=str(db))
    for col in ("digest", "tag", "model", "sampling", "stats", "trajectories"):
        table.add_column(col, overflow="fold")
    for k in keys:
        table.add_row(
            k["digest"],
            k["tag"],
            k["model"][:24],
            k["sampling"],
            str(k["stats"]),
            str(k["trajectories"]),
        )
    Console().print(table)


def _teacher(spec: str, teacher_model: str | None, tries: int, s: _Setup) -> Teacher | None:
    from anchor_rl.methods.pvpo import pvpo_teacher
    from anchor_rl.methods.pvpo_config import PVPOConfig
    from anchor_rl.rollout.spec import frozen, load_spec

    def load_teacher(target: str):
        model, tokenizer = load_spec(target, s.task_name, s.task_kwargs, s.seed, s.device)
        return frozen(model), tokenizer

    if spec == "oracle:reference" and s.model is None:
        raise typer.BadParameter(
            "oracle:reference scores the trace with the reference in this process, and this "
            "reference is served (http:); use oracle, hf:MODEL or http:URL",
            param_hint="--teacher",
        )
    # the trainer's teacher: one key for both (make_teacher checks the spec, not pydantic)
    pc = PVPOConfig.model_construct(teacher=spec, teacher_model=teacher_model, teacher_tries=tries)
    try:
        return pvpo_teacher(pc, s.task, s.tokenizer, s.model, s.params, load_teacher)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--teacher") from None


@anchors_app.command("filter")
@_with_setup
def filter_command(
    s: _Setup,
    teacher: Annotated[
        str | None,
        typer.Option(
            help="Teacher for accuracy-0 prompts: oracle, oracle:reference, hf:MODEL or http:URL. "
            "None: drop them."
        ),
    ] = None,
    teacher_model: Annotated[
        str | None, typer.Option(help="Served model name of an http teacher.")
    ] = None,
    tries: Annotated[int, typer.Option(min=1, help="Most teacher samples per prompt.")] = 8,
    keep_unsolved: Annotated[
        bool, typer.Option(help="Keep accuracy-0 prompts no teacher solved.")
    ] = False,
    stats_out: Annotated[
        Path | None, typer.Option(help="Write the filter statistics here (JSON).")
    ] = None,
) -> None:
    """PVPO group sampling over presampled anchors (same model/sampling options as presample).

    Drops prompts the reference always solves, keeps 0 < acc < 1, asks the teacher for a
    correct trajectory on acc = 0 (cached in the store) and prints the statistics beside
    the paper's reference distributions.
    """
    from rich.console import Console

    from anchor_rl.anchors.filter import group_filter
    from anchor_rl.anchors.store import AnchorStore
    from anchor_rl.anchors.teachers import teacher_key

    with AnchorStore(s.db) as store:
        stats = store.get_anchors(s.key, [r.id for r in s.records])
        if len(stats) < len(s.records):
            raise typer.BadParameter(
                f"{len(s.records) - len(stats)} of {len(s.records)} prompts have no anchors under key "
                f"{s.key.digest} in {s.db}: run `anchor-rl presample` with the same options first"
            )
        t = _teacher(teacher, teacher_model, tries, s) if teacher else None
        key = teacher_key(t, s.task_id) if t is not None else None
        result = group_filter(
            s.records,
            stats,
            teacher=t,
            store=store if t else None,
            key=key,
            keep_unsolved=keep_unsolved,
        )
    result.print(Console())
    if stats_out is not None:
        typer.echo(f"statistics -> {result.stats.save(stats_out)}")
