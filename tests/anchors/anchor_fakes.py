"""Fakes shared by the anchor tests (imported by module name; pytest puts this directory on sys.path)."""

from __future__ import annotations

from anchor_rl.tasks.base import Record, Task


class EchoTask(Task):
    """Prompts ``say <word>``; a completion is correct iff it contains ``<answer>word</answer>``.

    ``trace`` writes the answer; ``bad_trace`` ids get a wrong one (the verifier rejects it).
    """

    name = "echo"
    instruction = "Repeat the word."

    def __init__(self, n: int = 6, bad_trace: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.n, self.bad_trace = n, bad_trace

    def records(self, split: str = "train") -> list[Record]:
        return [Record(id=f"p{i}", prompt=f"say w{i}", answer=f"w{i}") for i in range(self.n)]

    def reward(self, completion: str, record: Record) -> float:
        return 1.0 if f"<answer>{record.answer}</answer>" in completion else 0.0

    def trace(self, record: Record) -> str:
        answer = "nope" if record.id in self.bad_trace else record.answer
        return f"<think>easy</think><answer>{answer}</answer>"
