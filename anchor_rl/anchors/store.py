"""The anchor store: per-prompt reference statistics and teacher trajectories in SQLite.

One embedded SQLite database file (WAL journal, so readers never block the writer and a
killed writer leaves the file consistent). Every write is one transaction: a batch of
prompts is either fully stored or not at all, so a process killed at any moment (even
``kill -9``) leaves no half-written rows, and running the same job again only does the
prompts that are missing.

Two kinds of rows, both filed under the digest of an :class:`~anchor_rl.anchors.keys.AnchorKey`:

- ``stats``: sufficient statistics of a prompt's reference rollouts (count, correct count,
  reward sum and sum of squares). New rollouts are merged into them, so a prompt can be
  topped up from M to 2M rollouts without redoing the first M.
- ``trajectories``: one teacher outcome per prompt: a correct trajectory in the policy's
  token ids with the teacher's per-token log-probs, or a record that the teacher failed.
- ``rollouts``: the reference's rollouts themselves (tokens, the log-probs they were
  sampled with, text, reward), rollout ``j`` of a prompt, kept only where a run asks
  (``pvpo.reuse_presample``: they train as the prompt's first group). Written in the same
  transaction as the statistics they are part of.
"""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from anchor_rl.anchors.keys import AnchorKey, canonical_json
from anchor_rl.anchors.records import AnchorStat, TeacherTrajectory
from anchor_rl.batch import RolloutBatch
from anchor_rl.errors import AnchorRLError

SCHEMA_VERSION = 1
Table = Literal["stats", "trajectories"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (
    digest TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    tokenizer TEXT NOT NULL,
    sampling TEXT NOT NULL,
    task TEXT NOT NULL,
    tag TEXT NOT NULL,
    created REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS stats (
    key TEXT NOT NULL REFERENCES keys(digest),
    prompt_id TEXT NOT NULL,
    n INTEGER NOT NULL CHECK (n > 0),
    n_correct INTEGER NOT NULL CHECK (n_correct >= 0 AND n_correct <= n),
    reward_sum REAL NOT NULL,
    reward_sq_sum REAL NOT NULL CHECK (reward_sq_sum >= 0),
    created REAL NOT NULL,
    updated REAL NOT NULL,
    PRIMARY KEY (key, prompt_id)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS trajectories (
    key TEXT NOT NULL REFERENCES keys(digest),
    prompt_id TEXT NOT NULL,
    solved INTEGER NOT NULL CHECK (solved IN (0, 1)),
    teacher TEXT NOT NULL,
    tries INTEGER NOT NULL,
    reward REAL,
    text TEXT,
    token_ids BLOB,
    logprobs BLOB,
    loss_mask BLOB,
    created REAL NOT NULL,
    PRIMARY KEY (key, prompt_id),
    CHECK (solved = 0 OR (text IS NOT NULL AND token_ids IS NOT NULL
                          AND logprobs IS NOT NULL AND loss_mask IS NOT NULL))
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS rollouts (
    key TEXT NOT NULL REFERENCES keys(digest),
    prompt_id TEXT NOT NULL,
    j INTEGER NOT NULL CHECK (j >= 0),
    reward REAL NOT NULL,
    correct INTEGER NOT NULL CHECK (correct IN (0, 1)),
    data BLOB NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (key, prompt_id, j)
) WITHOUT ROWID;
"""

_CHUNK = 500  # ids per ``IN (...)`` query, well under SQLite's variable limit


def _digest(key: AnchorKey | str) -> str:
    return key.digest if isinstance(key, AnchorKey) else key


def _to_blob(t: Tensor, dtype: np.dtype) -> bytes:
    return t.detach().cpu().numpy().astype(dtype).tobytes()


def _from_blob(blob: bytes, dtype: np.dtype, torch_dtype: torch.dtype) -> Tensor:
    return torch.from_numpy(np.frombuffer(blob, dtype=dtype).copy()).to(torch_dtype)


class AnchorStore:
    """Per-prompt anchors and teacher trajectories in one SQLite file (WAL mode).

    Use as a context manager or call :meth:`close`. Writes are transactions; group
    several into one with ``with store.batch(): ...``. Several processes may read while
    one writes.
    """

    def __init__(self, path: str | Path, timeout: float = 60.0) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise AnchorRLError(
                f"{self.path} is a directory, not an anchor store; give a file such as "
                f"{self.path / 'anchors.db'}"
            )
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(self.path, timeout=timeout, isolation_level=None)
        except (OSError, sqlite3.Error) as exc:  # an unwritable place, a file as a folder...
            raise AnchorRLError(f"cannot open the anchor store {self.path}: {exc}") from None
        self._depth = 0
        try:
            mode = self._conn.execute("PRAGMA journal_mode=WAL").fetchone()[0]
        except sqlite3.OperationalError as exc:  # cannot create or read the file there
            self._conn.close()
            raise AnchorRLError(f"cannot open the anchor store {self.path}: {exc}") from None
        except sqlite3.DatabaseError as exc:  # another kind of file: not ours to touch
            self._conn.close()
            raise AnchorRLError(f"{self.path} is not an anchor store ({exc})") from None
        if mode.lower() != "wal":
            raise RuntimeError(
                f"{self.path}: SQLite refused WAL mode (got {mode!r}); use a local file system"
            )
        # NORMAL is durable against a killed process (the OS keeps the written WAL);
        # only a power loss can drop the last committed batches, never corrupt the file.
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute("PRAGMA foreign_keys=ON")
        version = self._conn.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(
                f"{self.path} has anchor-store schema {version}; this anchor-rl reads up to {SCHEMA_VERSION}"
            )
        with self.batch():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._conn.execute(statement)
            self._conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")

    # -- plumbing ---------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection (committed data is safe either way)."""
        self._conn.close()

    def __enter__(self) -> AnchorStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @contextmanager
    def batch(self) -> Iterator[None]:
        """One transaction around every write inside the block (nested blocks join the outer one).

        Commits when the outermost block ends, rolls everything back if it raises.
        """
        if self._depth == 0:
            self._conn.execute("BEGIN IMMEDIATE")
        self._depth += 1
        try:
            yield
        except BaseException:
            self._depth -= 1
            if self._depth == 0:
                self._conn.execute("ROLLBACK")
            raise
        self._depth -= 1
        if self._depth == 0:
            self._conn.execute("COMMIT")

    def register(self, key: AnchorKey) -> None:
        """Store the full key beside its digest (idempotent; writers call it themselves)."""
        with self.batch():
            self._conn.execute(
                "INSERT OR IGNORE INTO keys VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    key.digest,
                    key.model,
                    key.tokenizer,
                    canonical_json(dict(key.sampling)),
                    key.task,
                    key.tag,
                    time.time(),
                ),
            )

    def keys(self) -> list[dict[str, Any]]:
        """Every registered key with its fields and row counts, oldest first."""
        rows = self._conn.execute(
            "SELECT k.digest, k.model, k.tokenizer, k.sampling, k.task, k.tag, k.created,"
            " (SELECT COUNT(*) FROM stats s WHERE s.key = k.digest),"
            " (SELECT COUNT(*) FROM trajectories t WHERE t.key = k.digest)"
            " FROM keys k ORDER BY k.created"
        ).fetchall()
        names = (
            "digest",
            "model",
            "tokenizer",
            "sampling",
            "task",
            "tag",
            "created",
            "stats",
            "trajectories",
        )
        return [dict(zip(names, r, strict=True)) for r in rows]

    # -- anchors ----------------------------------------------------------------------

    def add_rollouts(
        self,
        key: AnchorKey,
        prompt_ids: Sequence[str],
        rewards: Tensor | Sequence[Sequence[float]],
        correct: Tensor | Sequence[Sequence[bool]],
    ) -> None:
        """Merge k new rollouts of each of P prompts into their statistics, in one transaction.

        rewards: [P, k] rewards; correct: [P, k] booleans (the task's verdict per rollout).
        A prompt seen before under ``key`` gets its counts and sums increased.
        """
        rewards = torch.as_tensor(rewards, dtype=torch.float64)
        correct = torch.as_tensor(correct, dtype=torch.bool)
        p = len(prompt_ids)
        if rewards.dim() != 2 or rewards.shape[0] != p or rewards.shape[1] == 0:
            raise ValueError(f"rewards must be [P={p}, k>0], got {tuple(rewards.shape)}")
        if correct.shape != rewards.shape:
            raise ValueError(
                f"correct has shape {tuple(correct.shape)}, rewards {tuple(rewards.shape)}"
            )
        if not torch.isfinite(rewards).all():
            raise ValueError("rewards must be finite")
        if len(set(prompt_ids)) != p:
            raise ValueError("prompt_ids must be unique within one call")
        now = time.time()
        rows = [
            (key.digest, str(pid), rewards.shape[1], int(c), float(s), float(q), now, now)
            for pid, c, s, q in zip(
                prompt_ids,
                correct.sum(1).tolist(),
                rewards.sum(1).tolist(),
                (rewards**2).sum(1).tolist(),
                strict=True,
            )
        ]
        with self.batch():
            self.register(key)
            self._conn.executemany(
                "INSERT INTO stats VALUES (?, ?, ?, ?, ?, ?, ?, ?)"
                " ON CONFLICT (key, prompt_id) DO UPDATE SET"
                " n = n + excluded.n, n_correct = n_correct + excluded.n_correct,"
                " reward_sum = reward_sum + excluded.reward_sum,"
                " reward_sq_sum = reward_sq_sum + excluded.reward_sq_sum,"
                " updated = excluded.updated",
                rows,
            )

    def get_anchors(
        self, key: AnchorKey | str, prompt_ids: Iterable[str] | None = None
    ) -> dict[str, AnchorStat]:
        """prompt id -> :class:`AnchorStat` under ``key`` (all prompts when ``prompt_ids`` is None).

        Prompts without statistics under this key are absent from the result.
        """
        cols = "prompt_id, n, n_correct, reward_sum, reward_sq_sum, created, updated"
        digest = _digest(key)
        if prompt_ids is None:
            rows = self._conn.execute(
                f"SELECT {cols} FROM stats WHERE key = ?", (digest,)
            ).fetchall()
        else:
            rows = []
            ids = list(dict.fromkeys(str(i) for i in prompt_ids))
            for start in range(0, len(ids), _CHUNK):
                chunk = ids[start : start + _CHUNK]
                marks = ",".join("?" * len(chunk))
                rows += self._conn.execute(
                    f"SELECT {cols} FROM stats WHERE key = ? AND prompt_id IN ({marks})",
                    (digest, *chunk),
                ).fetchall()
        return {r[0]: AnchorStat(*r) for r in rows}

    # -- teacher trajectories ---------------------------------------------------------

    def put_trajectories(
        self,
        key: AnchorKey,
        outcomes: Mapping[str, TeacherTrajectory | None],
        teacher: str,
        tries: int,
    ) -> None:
        """Store teacher outcomes in one transaction, replacing earlier ones for the same prompts.

        ``outcomes[prompt_id]`` is a trajectory, or None when the teacher failed after
        ``tries`` samples (remembered so a rerun does not ask again). ``teacher`` names the
        teacher on failure rows (trajectories carry their own name and tries).
        """
        now = time.time()
        rows = []
        for pid, traj in outcomes.items():
            if traj is None:
                rows.append(
                    (key.digest, str(pid), 0, teacher, tries, None, None, None, None, None, now)
                )
                continue
            if traj.prompt_id != pid:
                raise ValueError(f"trajectory of prompt {traj.prompt_id!r} filed under {pid!r}")
            rows.append(
                (
                    key.digest,
                    str(pid),
                    1,
                    traj.teacher,
                    traj.tries,
                    float(traj.reward),
                    traj.text,
                    _to_blob(traj.token_ids, np.int64),
                    _to_blob(traj.logprobs, np.float32),
                    _to_blob(traj.loss_mask, np.uint8),
                    now,
                )
            )
        with self.batch():
            self.register(key)
            self._conn.executemany(
                "INSERT OR REPLACE INTO trajectories VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", rows
            )

    def get_outcomes(
        self, key: AnchorKey | str, prompt_ids: Iterable[str]
    ) -> dict[str, TeacherTrajectory | None]:
        """prompt id -> stored teacher outcome (None: the teacher failed); prompts never tried are absent."""
        digest = _digest(key)
        ids = list(dict.fromkeys(str(i) for i in prompt_ids))
        out: dict[str, TeacherTrajectory | None] = {}
        for start in range(0, len(ids), _CHUNK):
            chunk = ids[start : start + _CHUNK]
            marks = ",".join("?" * len(chunk))
            for row in self._conn.execute(
                "SELECT prompt_id, solved, teacher, tries, reward, text, token_ids, logprobs, loss_mask"
                f" FROM trajectories WHERE key = ? AND prompt_id IN ({marks})",
                (digest, *chunk),
            ):
                out[row[0]] = _trajectory(row) if row[1] else None
        return out

    # -- reference rollouts -----------------------------------------------------------

    def put_rollouts(
        self,
        key: AnchorKey,
        prompt_ids: Sequence[str],
        first: Sequence[int],
        batch: RolloutBatch,
        rewards: Tensor,
        correct: Tensor,
    ) -> None:
        """Keep the rollouts of P prompts, in one transaction: ``batch`` holds k rows per
        prompt, group ``i`` for ``prompt_ids[i]`` in request order, its row ``j`` the
        prompt's rollout ``first[i] + j``; ``rewards[P, k]``, ``correct[P, k]`` their scores."""
        seen = [0] * len(prompt_ids)
        now, rows = time.time(), []
        for r, g in enumerate(batch.group.tolist()):
            j = seen[g]
            seen[g] += 1
            rows.append((
                key.digest, str(prompt_ids[g]), int(first[g]) + j, float(rewards[g, j]),
                int(bool(correct[g, j])), _row_blob(batch, r), now,
            ))  # fmt: skip
        with self.batch():
            self.register(key)
            self._conn.executemany(
                "INSERT OR REPLACE INTO rollouts VALUES (?, ?, ?, ?, ?, ?, ?)", rows
            )

    def get_rollouts(
        self, key: AnchorKey | str, prompt_id: str, n: int
    ) -> tuple[RolloutBatch, Tensor] | None:
        """Rollouts ``0 .. n-1`` of ``prompt_id`` kept under ``key`` as one batch (group 0,
        right-padded) and their rewards ``[n]``; None unless all ``n`` are kept."""
        found = self._conn.execute(
            "SELECT reward, data FROM rollouts WHERE key = ? AND prompt_id = ? AND j < ?"
            " ORDER BY j",
            (_digest(key), str(prompt_id), n),
        ).fetchall()
        if len(found) < n:
            return None
        batch = RolloutBatch.cat([_row_batch(blob) for _, blob in found])
        return batch, torch.tensor([reward for reward, _ in found], dtype=torch.float32)

    def rollout_count(self, key: AnchorKey | str) -> int:
        """Reference rollouts kept under ``key``."""
        row = self._conn.execute("SELECT COUNT(*) FROM rollouts WHERE key = ?", (_digest(key),))
        return int(row.fetchone()[0])

    # -- inspection -------------------------------------------------------------------

    def rows(
        self, table: Table = "stats", key: AnchorKey | str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Flat dict rows of a table joined with their key's fields, for export and inspection."""
        if table not in ("stats", "trajectories"):
            raise ValueError(f"unknown table {table!r}; choose 'stats' or 'trajectories'")
        key_cols = "k.model, k.tokenizer, k.sampling, k.task, k.tag"
        where, args = ("WHERE t.key = ?", (_digest(key),)) if key is not None else ("", ())
        if table == "stats":
            sql = (
                f"SELECT t.key, t.prompt_id, t.n, t.n_correct, t.reward_sum, t.reward_sq_sum, t.created, t.updated, {key_cols}"
                f" FROM stats t JOIN keys k ON k.digest = t.key {where} ORDER BY t.key, t.prompt_id"
            )
            for r in self._conn.execute(sql, args):
                stat = AnchorStat(r[1], r[2], r[3], r[4], r[5], r[6], r[7])
                yield {
                    "key": r[0],
                    "prompt_id": stat.prompt_id,
                    "mean_reward": stat.mean,
                    "reward_std": stat.std,
                    "accuracy": stat.accuracy,
                    "n": stat.n,
                    "n_correct": stat.n_correct,
                    "created": stat.created,
                    "updated": stat.updated,
                    **_key_fields(r[8:]),
                }
            return
        sql = (
            "SELECT t.prompt_id, t.solved, t.teacher, t.tries, t.reward, t.text, t.token_ids, t.logprobs, t.loss_mask,"
            f" t.key, t.created, {key_cols} FROM trajectories t JOIN keys k ON k.digest = t.key {where}"
            " ORDER BY t.key, t.prompt_id"
        )
        for r in self._conn.execute(sql, args):
            traj = _trajectory(r[:9]) if r[1] else None
            yield {
                "key": r[9],
                "prompt_id": r[0],
                "solved": bool(r[1]),
                "teacher": r[2],
                "tries": r[3],
                "reward": r[4],
                "text": r[5],
                "token_ids": traj.token_ids.tolist() if traj else None,
                "logprobs": traj.logprobs.tolist() if traj else None,
                "loss_mask": traj.loss_mask.long().tolist() if traj else None,
                "created": r[10],
                **_key_fields(r[11:]),
            }

    def export(
        self, out: str | Path, table: Table = "stats", key: AnchorKey | str | None = None
    ) -> int:
        """Write :meth:`rows` to ``out`` as JSON lines (``.jsonl``) or Parquet (``.parquet``); returns the row count."""
        out = Path(out)
        rows = list(self.rows(table, key))
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".jsonl":
            with out.open("w") as f:
                for row in rows:
                    f.write(json.dumps(row) + "\n")
        elif out.suffix == ".parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(rows), out)
        else:
            raise ValueError(
                f"cannot tell the export format of {out}: use a .jsonl or .parquet file name"
            )
        return len(rows)


def _row_blob(batch: RolloutBatch, row: int) -> bytes:
    """Row ``row`` of ``batch``, cut to its width, as ``torch.save`` bytes."""
    one = batch.select([row]).trimmed()
    data = {
        "prompt_ids": torch.tensor(one.prompt_ids[0], dtype=torch.long),
        "response_ids": one.response_ids[0], "attention_mask": one.attention_mask[0],
        "loss_mask": one.loss_mask[0], "logprobs": one.logprobs[0].float(),
        "tool_calls": one.tool_calls[0], "truncated": one.truncated[0],
        "pad_id": torch.tensor(one.pad_id), "text": torch.tensor(list(one.texts[0].encode()), dtype=torch.uint8),
    }  # fmt: skip
    buffer = io.BytesIO()
    torch.save(data, buffer)
    return buffer.getvalue()


def _row_batch(blob: bytes) -> RolloutBatch:
    """A one-row batch (group 0) from :func:`_row_blob`'s bytes."""
    d = torch.load(io.BytesIO(blob), weights_only=True)
    return RolloutBatch(
        group=torch.zeros(1, dtype=torch.long),
        prompt_ids=[d["prompt_ids"].tolist()],
        response_ids=d["response_ids"][None], attention_mask=d["attention_mask"][None],
        loss_mask=d["loss_mask"][None], logprobs=d["logprobs"][None],
        texts=[bytes(d["text"].tolist()).decode()],
        tool_calls=d["tool_calls"][None], truncated=d["truncated"][None],
        pad_id=int(d["pad_id"]),
    )  # fmt: skip


def _key_fields(values: Sequence[Any]) -> dict[str, Any]:
    model, tokenizer, sampling, task, tag = values
    return {"model": model, "tokenizer": tokenizer, "sampling": sampling, "task": task, "tag": tag}


def _trajectory(row: Sequence[Any]) -> TeacherTrajectory:
    pid, _, teacher, tries, reward, text, ids, logprobs, mask = row
    return TeacherTrajectory(
        prompt_id=pid,
        token_ids=_from_blob(ids, np.int64, torch.long),
        logprobs=_from_blob(logprobs, np.float32, torch.float32),
        loss_mask=_from_blob(mask, np.uint8, torch.float32),
        text=text,
        reward=reward,
        teacher=teacher,
        tries=tries,
    )
