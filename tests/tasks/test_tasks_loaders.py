import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from anchor_rl.tasks import get_task
from anchor_rl.tasks.loaders import DAPO_PREFIX, DAPO_SUFFIX, PRESETS, FileTask, read_rows

# One row per preset in the dataset's published schema, with a right and a wrong completion.
ROWS = {
    "gsm8k": {
        "question": "Tom has 3 apples and buys 4 more. How many apples?",
        "answer": "He has 3+4=<<3+4=7>>7 apples.\n#### 7",
    },
    "math500": {
        "problem": "What is $\\frac{2}{4}$ in lowest terms?",
        "solution": "Divide by 2: $\\boxed{\\frac{1}{2}}$.",
        "answer": "\\frac{1}{2}",
        "subject": "Prealgebra",
        "level": 2,
        "unique_id": "test/prealgebra/1.json",
    },
    "dapo_math": {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PREFIX + "What is 1+1?" + DAPO_SUFFIX, "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b-1"},
    },
    "hotpotqa": {
        "_id": "5a8b57f25542995d1e6f1371",
        "question": "Were Scott Derrickson and Ed Wood of the same nationality?",
        "answer": "yes",
        "type": "comparison",
        "level": "hard",
        "supporting_facts": {"title": ["Scott Derrickson", "Ed Wood"], "sent_id": [0, 0]},
    },
    "musique": {
        "id": "2hop__460946_294723",
        "paragraphs": [
            {"idx": 0, "title": "Green", "paragraph_text": "...", "is_supporting": True}
        ],
        "question": "Who is the spouse of the Green performer?",
        "question_decomposition": [{"id": 460946, "question": "Green >> performer"}],
        "answer": "Miquette Giraudy",
        "answer_aliases": ["M. Giraudy"],
        "answerable": True,
    },
    "2wikimultihopqa": {
        "_id": "13f5ad2c088c11ebbd6fac1f6bf848b6",
        "type": "compositional",
        "question": "Who is the mother of the director of film Polish-Russian War?",
        "evidences": [["Polish-Russian War", "director", "Xawery Zulawski"]],
        "answer": "Malgorzata Braunek",
    },
    "bamboogle": {
        "Question": "Who was president of the U.S. when superconductivity was discovered?",
        "Answer": "William Howard Taft",
    },
}
EXPECTED = {  # preset: (prompt, answer, id, meta subset, right completion, wrong completion)
    "gsm8k": (
        ROWS["gsm8k"]["question"],
        "7",
        "data-0",
        {},
        "<answer>7</answer>",
        "<answer>8</answer>",
    ),
    "math500": (
        ROWS["math500"]["problem"],
        "\\frac{1}{2}",
        "test/prealgebra/1.json",
        {"subject": "Prealgebra", "difficulty": 2},
        "so \\boxed{0.5}",
        "\\boxed{2}",
    ),
    "dapo_math": (
        "What is 1+1?",
        "2",
        "9a9b-1",
        {"data_source": "math_dapo"},
        "<answer>2</answer>",
        "<answer>3</answer>",
    ),
    "hotpotqa": (
        ROWS["hotpotqa"]["question"],
        "yes",
        "5a8b57f25542995d1e6f1371",
        {"type": "comparison", "level": "hard"},
        "<answer>Yes</answer>",
        "<answer>no</answer>",
    ),
    "musique": (
        ROWS["musique"]["question"],
        "Miquette Giraudy",
        "2hop__460946_294723",
        {"aliases": ["M. Giraudy"]},
        "<answer>M. Giraudy</answer>",
        "<answer>Giraudy</answer>",
    ),
    "2wikimultihopqa": (
        ROWS["2wikimultihopqa"]["question"],
        "Malgorzata Braunek",
        "13f5ad2c088c11ebbd6fac1f6bf848b6",
        {"type": "compositional"},
        "<answer>the Malgorzata Braunek</answer>",
        "<answer>Braunek</answer>",
    ),
    "bamboogle": (
        ROWS["bamboogle"]["Question"],
        "William Howard Taft",
        "data-0",
        {},
        "<answer>William Howard Taft</answer>",
        "<answer>Taft</answer>",
    ),
}


def write(path: Path, rows: list[dict]) -> Path:
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_presets_are_covered():
    assert set(PRESETS) == set(ROWS) == set(EXPECTED)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet", ".json"])
@pytest.mark.parametrize("preset", sorted(ROWS))
def test_preset_formats(tmp_path, preset, suffix):
    path = write(tmp_path / f"data{suffix}", [ROWS[preset]])
    task = get_task("file", path=str(path), format=preset, test_size=0)
    [record] = task.records("train")
    prompt, answer, rid, meta, right, wrong = EXPECTED[preset]
    assert (record.prompt, record.answer, record.id) == (prompt, answer, rid)
    assert meta.items() <= record.meta.items()
    assert task.reward(right, record) == 1.0 and task.correct(right, record)
    assert task.reward(wrong, record) == 0.0 and not task.correct(wrong, record)
    assert "<answer>" in task.instruction
    with pytest.raises(NotImplementedError, match="no reference traces"):
        task.trace(record)


def test_custom_fields_and_overrides(tmp_path):
    path = write(tmp_path / "qa.jsonl", [{"q": "Capital of France?", "a": "Paris", "key": "k1"}])
    task = FileTask(path, question="q", answer="a", id="key", test_size=0)
    [record] = task.records("train")
    assert (record.id, record.prompt, record.answer) == ("k1", "Capital of France?", "Paris")
    assert task.reward("<answer>paris</answer>", record) == 1.0
    f1_task = FileTask(path, question="q", answer="a", reward="f1", test_size=0)
    assert f1_task.reward("<answer>paris city</answer>", record) == pytest.approx(2 / 3)
    # an override replaces only the fields it names: gsm8k's "####" marker stays
    marked = write(tmp_path / "m.jsonl", [{"q": "1+1?", "a": "so #### 2"}])
    math_task = FileTask(marked, format="gsm8k", question="q", answer="a", test_size=0)
    assert math_task.format.kind == "math" and math_task.records("train")[0].answer == "2"


def test_list_answers_become_aliases(tmp_path):
    rows = [
        {"question": "q1", "golden_answers": ["NYC", "New York City"]},
        {"question": "q2", "golden_answers": ["72"]},
    ]
    path = write(tmp_path / "flash.parquet", rows)
    task = FileTask(path, question="question", answer="golden_answers", test_size=0)
    first, second = task.records("train")
    assert (first.answer, first.meta["aliases"]) == ("NYC", ["New York City"])
    assert (second.answer, second.meta) == ("72", {})
    assert task.reward("<answer>new york city</answer>", first) == 1.0


def test_split_by_prompt_is_disjoint_and_seeded(tmp_path):
    rows = [{"question": f"q{i % 40}", "answer": str(i)} for i in range(50)]  # 10 duplicates
    path = write(tmp_path / "d.jsonl", rows)
    task = FileTask(path, question="question", answer="answer", test_size=0.25, seed=1)
    train, test = task.records("train"), task.records("test")
    assert len(train) + len(test) == 50
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert len({r.prompt for r in test}) == 10  # 25% of 40 distinct prompts
    again = FileTask(path, question="question", answer="answer", test_size=0.25, seed=1)
    assert again.records("test") == test
    counted = FileTask(path, question="question", answer="answer", test_size=3)
    assert len({r.prompt for r in counted.records("test")}) == 3


def test_train_and_test_files(tmp_path, caplog):
    train = write(
        tmp_path / "train.jsonl",
        [{"question": "a", "answer": "1"}, {"question": "b", "answer": "2"}],
    )
    test = write(tmp_path / "test.parquet", [{"question": "b", "answer": "2"}])
    task = FileTask(
        train_path=train, test_path=test, kind="math", question="question", answer="answer"
    )
    assert [r.prompt for r in task.records("train")] == ["a"]  # "b" is a test prompt
    assert [r.prompt for r in task.records("test")] == ["b"]
    assert "dropped" in caplog.text
    only_test = FileTask(test_path=test, question="question", answer="answer")
    with pytest.raises(ValueError, match="no train records"):
        only_test.records("train")


def test_verifier_failures_are_counted(tmp_path, monkeypatch):
    def broken(pred, gold):
        raise TimeoutError("math-verify took more than 5s")

    monkeypatch.setattr("anchor_rl.tasks.loaders.math_equal", broken)
    path = write(tmp_path / "g.jsonl", [ROWS["gsm8k"]])
    task = FileTask(path, format="gsm8k", test_size=0)
    [record] = task.records("train")
    assert task.reward("<answer>7</answer>", record) == 0.0
    assert task.reward("no answer at all", record) == 0.0  # never reaches the verifier
    assert task.verifier.stats() == {"calls": 2, "failures": 0, "timeouts": 1}
    assert task.correct("<answer>7</answer>", record) is False  # correct is guarded too
    assert task.verifier_stats() == {"failures": 0, "timeouts": 2}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"format": "squad"}, ValueError, "unknown dataset format 'squad'; presets: gsm8k"),
        ({}, ValueError, "give a preset"),
        ({"format": "bamboogle"}, ValueError, r"no field 'Question' \(fields: answer, question\)"),
        ({"format": "gsm8k", "train_path": "x.jsonl"}, ValueError, "not both"),
        ({"format": "gsm8k", "reward": "bleu"}, ValueError, "reward"),
    ],
)
def test_errors(tmp_path, kwargs, error, match):
    path = write(tmp_path / "d.jsonl", [{"question": "q", "answer": "#### 1"}])
    with pytest.raises(error, match=match):
        FileTask(path, **kwargs)


def test_read_rows_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "d.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        read_rows(tmp_path / "d.csv")
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2: not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")
    path = write(tmp_path / "g.jsonl", [{"question": "q", "answer": "no marker"}])
    with pytest.raises(ValueError, match="g.jsonl row 0: answer has no '####' marker"):
        FileTask(path, format="gsm8k")
