"""Soak benchmark: one long `anchor-rl train` run watched from outside for leaks.

    python benchmarks/soak.py --steps 2000 --out docs/results/soak/inprocess.json
    OMP_NUM_THREADS=1 RAY_AUTH_MODE=disabled python benchmarks/soak.py --steps 2000 --workers 2 \\
        --out docs/results/soak/ray2.json -- rollout.engine_args.num_cpus_per_worker=0.5
    python benchmarks/soak.py --table docs/results/soak      # rebuild soak.md from the JSONs

The run is the `pvpo_paper` preset on `model=random:tiny` (arithmetic), small steps (4 prompts x 4
responses, 16 new tokens), evaluation off, a checkpoint every `--checkpoint-every` steps with
`checkpoint.keep=--keep`, and the anchors refreshed every `--refresh-every` steps into an
anchor store of its own, so the run writes metrics, checkpoints and store rows as it goes.
`--workers N` samples in N Ray rollout workers (`cluster.rollout_workers`; the workers at
the trainer's priority, `RAY_worker_niceness=0`, unless set). `--time-limit S` sets `time_limit` (the run stops after
the step that reaches it, and the verdicts judge the steps it ran). Arguments after `--` are
more `key=value` overrides (a PVPO run on Ray holds two sets of workers, the policy's and the
reference's: on 2 cores add `rollout.engine_args.num_cpus_per_worker=0.5`).

Every `--interval` seconds the script samples, from outside the run: each process of the
run's process tree (the trainer and what it started: Ray's raylet, GCS and workers, spawned
learners) with its resident memory (RSS), open file descriptors and threads (psutil where
installed, else /proc) and its threads' names; the run directory's bytes (checkpoints apart, and how many
`step_*` checkpoints exist); the complete rows of `metrics.jsonl` and the last step among
them; the anchor store's rows per table and its refresh keys.

The verdicts (`verdicts`), with warm-up = the first `--warmup` steps (default: 10% of the
steps, at least past the first refresh and two checkpoints) and the samples of the steps
after it up to the last step:
- `rss`: the trainer's RSS, and the whole tree's, stay within `--rss-tol` (10%) of their
  value at the first sample after warm-up;
- `fds`, `threads`: the tree's open descriptors and threads over the last five samples
  (median) exceed those of the first five after warm-up by at most `--fd-tol` / `--thread-tol`;
  `by_role` names the process roles whose count changed, and for threads `by_name` the
  thread names (Linux's `comm`: gRPC pollers, Ray's io threads, Python thread names) per role;
- `disk`: never more than keep + 1 `step_*` checkpoints (the newest is published before the
  oldest is deleted), exactly keep at the end, and checkpoint bytes at the end within 10% of
  those after warm-up; the other files' growth is reported per 1,000 steps;
- `metrics`: every sample's rows are steps 1..s without a gap and at least the newest
  checkpoint's step; at the end, rows == steps;
- `store`: every sample holds every refresh due by its metrics step (a refresh after step
  kK runs in step kK + 1, before its row), the end holds floor((steps - 1) / K) refreshes and
  its `stats` rows grew by the training prompts once per refresh.

Writes the samples, the settings and the verdicts as JSON to `--out` and rebuilds `soak.md`
(one table over every JSON in that folder) beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

try:  # optional: the /proc fallback below covers Linux without it
    import psutil
except ImportError:  # pragma: no cover - psutil ships with the dev extra
    psutil = None

CHECKPOINTS = "checkpoints"
CRITERIA = ("rss", "fds", "threads", "disk", "metrics", "store")


# ---------------------------------------------------------------- sampling


def _thread_names(pid: int) -> dict[str, int]:
    """How many of the process's threads carry each name (Linux's 15-character ``comm``: gRPC
    pollers, Ray's io contexts, Python's ``threading`` names); empty where /proc is absent."""
    names: dict[str, int] = defaultdict(int)
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            names[Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()] += 1
        except OSError:
            continue
    return dict(names)


def _proc_tree(root: int) -> list[dict[str, Any]]:
    """``[{pid, role, rss, fds, threads, names}]`` of ``root`` and its descendants (rss in
    bytes, names: :func:`_thread_names`); processes that exit while read are skipped."""
    if psutil is not None:
        try:
            top = psutil.Process(root)
            procs = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            try:
                with p.oneshot():
                    row = dict(pid=p.pid, role=_role(p.pid == root, p.cmdline()),
                               rss=p.memory_info().rss, fds=p.num_fds(),
                               threads=p.num_threads(), names=_thread_names(p.pid))  # fmt: skip
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
            out.append(row)
        return out
    return _proc_tree_linux(root)


def _proc_tree_linux(root: int) -> list[dict[str, Any]]:
    """What :func:`_proc_tree` reads, from /proc."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    tree, frontier = [root], [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        tree += frontier
    out = []
    for pid in tree:
        try:
            status = dict(
                line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
            )
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            out.append(dict(pid=pid, role=_role(pid == root, [c.decode() for c in cmd if c]),
                            rss=int(status["VmRSS"].split()[0]) * 1024,
                            fds=len(os.listdir(f"/proc/{pid}/fd")),
                            threads=int(status["Threads"]), names=_thread_names(pid)))  # fmt: skip
        except (OSError, KeyError, ValueError):
            continue
    return out


def _role(is_root: bool, cmdline: list[str]) -> str:
    """A process's role in the tree: ``trainer`` (the root), a Ray process title
    (``ray::RolloutWorker``), or its program (and script, for Python)."""
    if is_root:
        return "trainer"
    if not cmdline:
        return "?"
    head = cmdline[0].split()[0]
    if head.startswith("ray::"):  # an actor's title names its running method: drop it
        return head.split(".")[0]
    name = Path(head).name
    script = [c for c in cmdline[1:] if not c.startswith("-")]  # past `-u` and the like
    if name.startswith("python") and script:
        return f"python {Path(script[0]).name}"
    return name


def _tree_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (files vanishing while walked are skipped)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except OSError:
                continue
    return total


class MetricsReader:
    """Reads ``metrics.jsonl`` as it grows: complete lines only, each read once."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.steps = path, 0, []

    def read(self) -> list[int]:
        """Every step row so far (the ``step`` of each complete line, in order)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return self.steps
        end = chunk.rfind(b"\n") + 1
        for line in chunk[:end].splitlines():
            if line.strip():
                self.steps.append(int(json.loads(line)["step"]))
        self.offset += end
        return self.steps


def store_rows(path: Path) -> dict[str, int] | None:
    """Rows of the anchor store's tables and its refresh keys; None while it does not exist or
    is locked."""
    if not path.exists():
        return None
    try:
        con = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=2.0)
        try:
            rows = {t: con.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0]
                    for t in ("keys", "stats", "trajectories")}  # fmt: skip
            rows["refreshes"] = con.execute(
                "SELECT COUNT(*) FROM keys WHERE tag LIKE 'refresh/%'"
            ).fetchone()[0]
        finally:
            con.close()
    except sqlite3.Error:
        return None
    return rows


def sample(pid: int, run_dir: Path, store: Path, metrics: MetricsReader, t0: float) -> dict:
    """One observation of the run. Checkpoints are listed before the metrics are read and the
    metrics before the store, so a sample never sees a checkpoint or a refresh ahead of the
    metrics row that precedes it."""
    t = time.monotonic() - t0
    procs = _proc_tree(pid)
    ckpt_root = run_dir / CHECKPOINTS
    ckpts = sorted(p.name for p in ckpt_root.glob("step_*")) if ckpt_root.is_dir() else []
    ckpt_bytes = _tree_bytes(ckpt_root) if ckpt_root.is_dir() else 0
    steps = metrics.read()
    roles: dict[str, dict[str, int]] = {k: defaultdict(int) for k in ("rss", "fds", "threads")}
    names: dict[str, int] = defaultdict(int)  # "role/thread name" -> threads
    for p in procs:
        for key, by_role in roles.items():
            by_role[p["role"]] += p[key]
        for name, n in p["names"].items():
            names[f"{p['role']}/{name}"] += n
    return dict(
        t=round(t, 2),
        step=steps[-1] if steps else 0,
        rows=len(steps),
        contiguous=steps == list(range(1, len(steps) + 1)),
        procs=len(procs),
        rss_trainer=next((p["rss"] for p in procs if p["role"] == "trainer"), 0),
        rss_tree=sum(p["rss"] for p in procs),
        **{f"{key}_by_role": dict(by_role) for key, by_role in roles.items()},
        fds_trainer=next((p["fds"] for p in procs if p["role"] == "trainer"), 0),
        fds_tree=sum(p["fds"] for p in procs),
        threads_trainer=next((p["threads"] for p in procs if p["role"] == "trainer"), 0),
        threads_tree=sum(p["threads"] for p in procs),
        thread_names=dict(names),
        ckpt_count=len(ckpts),
        ckpt_newest=int(ckpts[-1].split("_")[1]) if ckpts else 0,
        ckpt_bytes=ckpt_bytes,
        run_bytes=_tree_bytes(run_dir),
        store=store_rows(store),
        store_bytes=store.stat().st_size if store.exists() else 0,
    )


# ---------------------------------------------------------------- verdicts


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def verdicts(
    samples: list[dict],
    *,
    steps: int,
    keep: int,
    refresh_every: int,
    warmup: int,
    final_steps: list[int],
    refresh_rows: int | None = None,
    rss_tol: float = 0.10,
    fd_tol: int = 2,
    thread_tol: int = 2,
) -> dict[str, dict[str, Any]]:
    """One verdict per criterion (``ok`` and the figures behind it) from the run's samples.

    ``samples``: dicts as :func:`sample` returns, in time order; ``final_steps``: the steps of
    every row of the finished ``metrics.jsonl``; ``warmup``: the steps of warm-up;
    ``refresh_rows``: the ``stats`` rows one refresh adds (the training prompts), None to skip
    that check. The memory, descriptor and thread verdicts use the samples whose metrics step
    is past warm-up and before the last step (the run's teardown excluded)."""
    post = [s for s in samples if warmup <= s["step"] < steps]
    out: dict[str, dict[str, Any]] = {}
    if len(post) < 2:
        short = dict(ok=False, why=f"{len(post)} samples between step {warmup} and {steps}")
        out.update({k: short for k in ("rss", "fds", "threads")})
    else:
        first, span = post[0], post[-1]["step"] - post[0]["step"]
        rss = {}
        for key in ("rss_trainer", "rss_tree"):
            base, values = first[key], [s[key] for s in post]
            rss[key] = dict(
                at_warmup=base,
                end=values[-1],
                max=max(values),
                min=min(values),
                max_ratio=round(max(values) / base, 4),
                min_ratio=round(min(values) / base, 4),
                growth_per_1k_steps=round((values[-1] - base) / max(span, 1) * 1000),
            )
        ok = all(1 - rss_tol <= r["min_ratio"] and r["max_ratio"] <= 1 + rss_tol
                 for r in rss.values())  # fmt: skip
        out["rss"] = dict(ok=ok, tol=rss_tol, warmup_step=first["step"], **rss)
        for name, tol in (("fds", fd_tol), ("threads", thread_tol)):
            key = f"{name}_tree"
            head = _median([s[key] for s in post[:5]])
            tail = _median([s[key] for s in post[-5:]])
            out[name] = dict(ok=tail - head <= tol, tol=tol, start=head, end=tail,
                             max=max(s[key] for s in post),
                             trainer_start=_median([s[f"{name}_trainer"] for s in post[:5]]),
                             trainer_end=_median([s[f"{name}_trainer"] for s in post[-5:]]),
                             by_role=_changed(post, f"{name}_by_role"))  # fmt: skip
        out["threads"]["by_name"] = _changed(post, "thread_names")
    out["disk"] = _disk_verdict(samples, steps, keep, warmup)
    out["metrics"] = _metrics_verdict(samples, steps, final_steps)
    out["store"] = _store_verdict(samples, steps, refresh_every, refresh_rows)
    return out


def _changed(post: list[dict], key: str) -> dict[str, list[float]]:
    """``{name: [start, end]}`` of the entries of ``sample[key]`` (a dict of counts) whose
    median over the first five samples differs from that over the last five."""
    names = sorted({n for s in post for n in s.get(key, {})})
    out = {}
    for n in names:
        head = _median([s.get(key, {}).get(n, 0) for s in post[:5]])
        tail = _median([s.get(key, {}).get(n, 0) for s in post[-5:]])
        if head != tail:
            out[n] = [head, tail]
    return out


def _disk_verdict(samples: list[dict], steps: int, keep: int, warmup: int) -> dict[str, Any]:
    most = max((s["ckpt_count"] for s in samples), default=0)
    end = samples[-1] if samples else {}
    base = next((s for s in samples if s["step"] >= warmup and s["ckpt_count"] >= keep), None)
    ok = most <= keep + 1 and end.get("ckpt_count") == keep and base is not None
    ckpt_ratio = None
    if base is not None:
        ckpt_ratio = round(end["ckpt_bytes"] / max(base["ckpt_bytes"], 1), 4)
        ok = ok and ckpt_ratio <= 1.1
    other = [(s["step"], s["run_bytes"] - s["ckpt_bytes"]) for s in samples if s["step"] > 0]
    per_1k = None
    if len(other) > 1 and other[-1][0] > other[0][0]:
        per_1k = round((other[-1][1] - other[0][1]) / (other[-1][0] - other[0][0]) * 1000)
    return dict(ok=ok, keep=keep, max_checkpoints=most, end_checkpoints=end.get("ckpt_count"),
                ckpt_bytes_end=end.get("ckpt_bytes"), ckpt_bytes_ratio=ckpt_ratio,
                run_bytes_end=end.get("run_bytes"), other_bytes_per_1k_steps=per_1k)  # fmt: skip


def _metrics_verdict(samples: list[dict], steps: int, final_steps: list[int]) -> dict[str, Any]:
    gaps = [s["t"] for s in samples if not s["contiguous"] or s["rows"] != s["step"]]
    behind = [s["t"] for s in samples if s["rows"] < s["ckpt_newest"]]
    whole = final_steps == list(range(1, steps + 1))
    return dict(ok=whole and not gaps and not behind, rows=len(final_steps), steps=steps,
                samples_with_gaps=len(gaps), samples_behind_checkpoint=len(behind))  # fmt: skip


def _store_verdict(
    samples: list[dict], steps: int, every: int, refresh_rows: int | None
) -> dict[str, Any]:
    if every <= 0:
        return dict(ok=None, why="no refreshes (pvpo.refresh_every = 0)")
    read = [s for s in samples if s["store"] is not None]
    if not read:
        return dict(ok=False, why="the store was never read")
    lagging = [s["t"] for s in read if s["store"]["refreshes"] < max(s["step"] - 1, 0) // every]
    expected = (steps - 1) // every
    end = read[-1]["store"]
    ok = not lagging and end["refreshes"] == expected
    # the presampled anchors (training has begun, no refresh yet): each refresh adds to them
    first = next((s["store"] for s in read if 0 < s["step"] < every), None)
    if refresh_rows is not None and first is not None:
        grew = end["stats"] - first["stats"]
        ok = ok and grew == (end["refreshes"] - first["refreshes"]) * refresh_rows
    return dict(ok=ok, refresh_every=every, refreshes_end=end["refreshes"],
                refreshes_expected=expected, samples_lagging=len(lagging),
                stats_rows_presampled=first and first["stats"], stats_rows_end=end["stats"],
                stats_rows_per_refresh=refresh_rows, trajectories_end=end["trajectories"])  # fmt: skip


# ---------------------------------------------------------------- the run


def train_command(args: argparse.Namespace, run_dir: Path, store: Path) -> list[str]:
    """The `anchor-rl train` command line of the soak run."""
    # pvpo_paper: the soak refreshes (pvpo.refresh_every), which the pvpo preset's lazy
    # presampling refuses
    cmd = [sys.executable, "-m", "anchor_rl.cli", "train", "--preset", "pvpo_paper", "-o",
           str(run_dir),
           f"model={args.model}", f"steps={args.steps}", f"seed={args.seed}",
           "rollout.prompts_per_step=4", "rollout.n=4", "rollout.max_new_tokens=16",
           "pvpo.m=4", f"pvpo.prompts={args.prompts}", f"pvpo.refresh_every={args.refresh_every}",
           f"pvpo.store={store}", "eval.every=0", f"checkpoint.every={args.checkpoint_every}",
           f"checkpoint.keep={args.keep}", "log.progress=false"]  # fmt: skip
    if args.workers:
        cmd.append(f"cluster.rollout_workers={args.workers}")
    if args.time_limit:
        cmd.append(f"time_limit={args.time_limit}")
    return cmd + list(args.overrides)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run the soak, sampling it; the result JSON (settings, samples, verdicts)."""
    work = Path(args.work or tempfile.mkdtemp(prefix="soak-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir, store = work / "run", work / "anchors.db"
    shutil.rmtree(run_dir, ignore_errors=True)
    store.unlink(missing_ok=True)
    cmd = train_command(args, run_dir, store)
    env = dict(os.environ)
    if args.workers:
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env.setdefault("RAY_worker_niceness", "0")  # Ray's 15 starves them on a busy machine
    metrics, samples = MetricsReader(run_dir / "metrics.jsonl"), []
    with open(work / "train.log", "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=work)
        try:
            while proc.poll() is None:
                samples.append(sample(proc.pid, run_dir, store, metrics, t0))
                if args.verbose and len(samples) % 20 == 1:
                    s = samples[-1]
                    print(f"t={s['t']:.0f}s step={s['step']} rss={s['rss_tree'] / 2**20:.0f}MiB "
                          f"fds={s['fds_tree']} threads={s['threads_tree']}", flush=True)  # fmt: skip
                time.sleep(args.interval)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(60)
    wall = time.monotonic() - t0
    samples.append(sample(proc.pid, run_dir, store, metrics, t0))  # the finished run's files
    if proc.returncode != 0:
        tail = (work / "train.log").read_text()[-3000:]
        raise SystemExit(f"the run failed ({proc.returncode}):\n{tail}")
    cfg = json.loads((run_dir / "config.json").read_text())
    pvpo = (
        json.loads((run_dir / "pvpo.json").read_text()) if (run_dir / "pvpo.json").exists() else {}
    )
    warmup = args.warmup if args.warmup is not None else default_warmup(args)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # `time_limit` ends the run after the step that reaches it: judge the steps it ran
    steps = rows[-1]["step"] if args.time_limit and rows else args.steps
    step_times = [r["time/step"] for r in rows if "time/step" in r]
    result = dict(
        name=args.name or (f"ray{args.workers}" if args.workers else "inprocess"),
        note=args.note,
        command=" ".join(["anchor-rl", *cmd[3:]]).replace(str(work), "WORK"),
        steps=steps,
        steps_asked=args.steps,
        time_limit_s=args.time_limit,
        workers=args.workers,
        interval_s=args.interval,
        env={k: env[k] for k in ("RAY_worker_niceness", "OMP_NUM_THREADS") if k in env},
        warmup_steps=warmup,
        wall_s=round(wall, 1),
        step_s_median=round(statistics.median(step_times), 4) if step_times else None,
        psutil=psutil is not None,
        cpus=os.cpu_count(),
        verdicts=verdicts(
            samples,
            steps=steps,
            keep=cfg["checkpoint"]["keep"],
            refresh_every=cfg["pvpo"]["refresh_every"],
            warmup=warmup,
            final_steps=[r["step"] for r in rows],
            refresh_rows=pvpo.get("training_prompts"),
            rss_tol=args.rss_tol,
            fd_tol=args.fd_tol,
            thread_tol=args.thread_tol,
        ),  # fmt: skip
        # the per-name thread counts are summed up in the threads verdict (`by_name`)
        samples=[{k: v for k, v in s.items() if k != "thread_names"} for s in samples],
    )
    if not args.keep_work:
        shutil.rmtree(work, ignore_errors=True)
    return result


def default_warmup(args: argparse.Namespace) -> int:
    """10% of the steps, and at least past the first refresh and the second checkpoint."""
    return max(args.steps // 10, args.refresh_every + 1, 2 * args.checkpoint_every + 1)


# ---------------------------------------------------------------- the table


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _mem(rss: dict[str, Any], key: str) -> str:
    m = rss.get(key)
    if not m:
        return "-"
    return f"{_mib(m['at_warmup'])} → {_mib(m['end'])}, {_mib(m['max'])} (×{m['max_ratio']})"


def table(folder: Path) -> str:
    """A markdown table of every soak result JSON in ``folder``."""
    head = ("| run | steps | s/step | warm-up | RSS trainer MiB (warm-up → end, max) | "
            "RSS tree MiB (warm-up → end, max) | fds | threads | checkpoints (keep) | "
            "metrics rows | refreshes in store | verdicts |")  # fmt: skip
    lines = [head, "|" + " --- |" * 12]
    for path in sorted(folder.glob("*.json")):
        r = json.loads(path.read_text())
        v = r["verdicts"]
        rss, disk, store, met = v["rss"], v["disk"], v["store"], v["metrics"]
        fds, thr = v["fds"], v["threads"]

        oks = " ".join(f"{k} {'ok' if v[k]['ok'] else ('n/a' if v[k]['ok'] is None else 'FAIL')}"
                       for k in CRITERIA)  # fmt: skip
        lines.append(
            f"| {r['name']} | {r['steps']} | {r['step_s_median']} | {r['warmup_steps']} "
            f"| {_mem(rss, 'rss_trainer')} | {_mem(rss, 'rss_tree')} "
            f"| {fds.get('start')} → {fds.get('end')} | {thr.get('start')} → {thr.get('end')} "
            f"| max {disk['max_checkpoints']}, end {disk['end_checkpoints']} ({disk['keep']}) "
            f"| {met['rows']} / {met['steps']} "
            f"| {store.get('refreshes_end')} / {store.get('refreshes_expected')} | {oks} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--workers", type=int, default=0, help="Ray rollout workers")
    parser.add_argument("--model", default="random:tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prompts", type=int, default=32, help="pvpo.prompts")
    parser.add_argument("--refresh-every", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=100)
    parser.add_argument("--keep", type=int, default=2)
    parser.add_argument("--time-limit", type=float, help="time_limit: stop after N seconds")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    parser.add_argument("--warmup", type=int, help="warm-up steps (default: see the docstring)")
    parser.add_argument("--rss-tol", type=float, default=0.10)
    parser.add_argument("--fd-tol", type=int, default=2)
    parser.add_argument("--thread-tol", type=int, default=2)
    parser.add_argument("--name", help="the run's name in the table")
    parser.add_argument("--note", help="recorded in the JSON (e.g. the commit that ran)")
    parser.add_argument("--work", help="work folder (default: a temporary one)")
    parser.add_argument("--keep-work", action="store_true", help="keep the run directory")
    parser.add_argument("--out", type=Path, help="result JSON; soak.md is rebuilt beside it")
    parser.add_argument("--table", type=Path, help="only rebuild FOLDER/soak.md")
    parser.add_argument("-v", "--verbose", action="store_true")
    parser.add_argument("overrides", nargs="*", help="more key=value overrides (after --)")
    args = parser.parse_args()
    if args.table:
        (args.table / "soak.md").write_text(table(args.table))
        return
    result = run(args)
    summary = {k: v["ok"] for k, v in result["verdicts"].items()}
    print(json.dumps({k: result[k] for k in ("name", "steps", "wall_s", "step_s_median")}
                     | {"verdicts": summary}, indent=2))  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        (args.out.parent / "soak.md").write_text(table(args.out.parent))


if __name__ == "__main__":
    main()
