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


def test_a_string_alias_is_one_alias(tmp_path):
    """A plain-string aliases column was read character by character: "e" matched "Paree"."""
    rows = [
        {"question": "q0", "answer": "Paris", "alias": "Paree"},
        {"question": "q1", "answer": "Paris", "alias": ["Paree", "Lutetia"]},
        {"question": "q2", "answer": "Paris", "alias": None},
    ]
    path = write(tmp_path / "a.jsonl", rows)
    task = FileTask(path, question="question", answer="answer", aliases="alias", test_size=0)
    first, second, third = task.records("train")
    assert first.meta["aliases"] == ["Paree"]
    assert second.meta["aliases"] == ["Paree", "Lutetia"]
    assert third.meta["aliases"] == []
    assert task.reward("<answer>e</answer>", first) == 0.0 and not task.correct("e", first)
    assert task.reward("<answer>paree</answer>", first) == 1.0
    bad = write(tmp_path / "b.jsonl", [rows[0], {"question": "q", "answer": "x", "alias": 3}])
    with pytest.raises(ValueError, match="b.jsonl row 1: aliases must be a list .* got int"):
        FileTask(bad, question="question", answer="answer", aliases="alias", test_size=0)


@pytest.mark.parametrize(
    ("answer", "kind", "match"),
    [
        ("", "qa", "row 1: empty answer"),
        ("  ", "math", "row 1: empty answer"),
        ("The", "qa", "row 1: answer 'The' is empty once normalised"),
        ("?!", "qa", "row 1: answer '\\?!' is empty once normalised"),
        (["x", "a"], "qa", "row 1: answer 'a' is empty once normalised"),
    ],
)
def test_an_empty_gold_is_refused(tmp_path, answer, kind, match):
    """An empty gold (or one that normalises to nothing) scored any or no answer 1.0."""
    rows = [{"question": "q0", "answer": "ok"}, {"question": "q1", "answer": answer}]
    path = write(tmp_path / "e.jsonl", rows)
    with pytest.raises(ValueError, match=match):
        FileTask(path, question="question", answer="answer", kind=kind, test_size=0)


def test_an_empty_gold_after_the_marker_or_alias_is_refused(tmp_path):
    path = write(tmp_path / "g.jsonl", [{"question": "q", "answer": "work...\n#### "}])
    with pytest.raises(ValueError, match="g.jsonl row 0: empty answer"):
        FileTask(path, format="gsm8k", test_size=0)
    path = write(tmp_path / "m.jsonl", [{"question": "q", "answer": "x", "answer_aliases": ["An"]}])
    with pytest.raises(ValueError, match="m.jsonl row 0: alias 'An' is empty once normalised"):
        FileTask(path, format="musique", test_size=0)


def test_jsonl_splits_on_newlines_only_and_drops_a_bom(tmp_path):
    """splitlines() also split on U+2028 / U+2029 / U+0085, which JSON allows raw in a string;
    a byte-order mark made the first line invalid JSON."""
    rows = [{"question": f"one{sep}two", "answer": "x"} for sep in ("\u2028", "\u2029", "\x85")]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows)
    path = tmp_path / "s.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode("utf-8"))
    assert read_rows(path) == rows
    array = tmp_path / "s.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode("utf-8"))
    assert read_rows(array) == rows
    (tmp_path / "bad.jsonl").write_text('{"a": 1}\r\n\r\n{oops\r\n')
    with pytest.raises(ValueError, match="bad.jsonl:3: not valid JSON"):
        read_rows(tmp_path / "bad.jsonl")


def test_fallback_ids_are_distinct_across_split_files(tmp_path):
    """Files of the same name in train/ and test/ both gave ids data-0, data-1."""
    for split in ("train", "test"):
        (tmp_path / split).mkdir()
        rows = [{"question": f"{split} q{i}", "answer": "x"} for i in range(2)]
        write(tmp_path / split / "data.jsonl", rows)
    task = FileTask(
        train_path=tmp_path / "train" / "data.jsonl",
        test_path=tmp_path / "test" / "data.jsonl",
        question="question",
        answer="answer",
    )
    assert [r.id for r in task.records("train")] == ["data-train-0", "data-train-1"]
    assert [r.id for r in task.records("test")] == ["data-test-0", "data-test-1"]
    # a single file keeps its {stem}-{row} ids, whichever split a row lands in
    single = FileTask(
        tmp_path / "train" / "data.jsonl", question="question", answer="answer", test_size=1
    )
    ids = {r.id for split in ("train", "test") for r in single.records(split)}
    assert ids == {"data-0", "data-1"}


def test_repeated_ids_are_refused(tmp_path):
    rows = [{"id": "same" if i else "other", "question": f"q{i}", "answer": "x"} for i in range(3)]
    path = write(tmp_path / "dup.jsonl", rows)
    with pytest.raises(ValueError, match="dup.jsonl row 2: id 'same' repeats row 1"):
        FileTask(path, question="question", answer="answer", id="id", test_size=0)
    # across the train and test files
    train = write(tmp_path / "train.jsonl", [{"id": "k", "question": "a", "answer": "x"}])
    test = write(tmp_path / "test.jsonl", [{"id": "k", "question": "b", "answer": "x"}])
    with pytest.raises(ValueError, match="1 record id.* both the train file .* e.g. 'k'"):
        FileTask(train_path=train, test_path=test, question="question", answer="answer", id="id")
    # the same row in both files: the train copy is dropped (its prompt is a test prompt)
    rows = [
        {"id": "k", "question": "a", "answer": "x"},
        {"id": "j", "question": "c", "answer": "x"},
    ]
    both = write(tmp_path / "both.jsonl", rows)
    task = FileTask(train_path=both, test_path=train, question="question", answer="answer", id="id")
    assert [r.id for r in task.records("train")] == ["j"]
    assert [r.id for r in task.records("test")] == ["k"]


@pytest.mark.parametrize("limit", [-3, 0, 2.5, True, "2"])
def test_limit_must_be_a_positive_count(tmp_path, limit):
    """A negative limit silently dropped rows from the end."""
    path = write(tmp_path / "l.jsonl", [{"question": f"q{i}", "answer": "x"} for i in range(10)])
    with pytest.raises(ValueError, match="limit must be a whole number >= 1"):
        FileTask(path, question="question", answer="answer", test_size=0, limit=limit)
    kept = FileTask(path, question="question", answer="answer", test_size=0, limit=3)
    assert [r.prompt for r in kept.records("train")] == ["q0", "q1", "q2"]


def test_chat_content_as_text_parts(tmp_path):
    """OpenAI-style content parts became the Python repr of the list."""
    parts = [{"type": "text", "text": "What is "}, {"type": "text", "text": "1+1?"}]
    rows = [
        {
            "prompt": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": parts},
            ],
            "answer": "2",
        }
    ]
    path = write(tmp_path / "c.jsonl", rows)
    task = FileTask(path, question="prompt", answer="answer", kind="math", test_size=0)
    assert task.records("train")[0].prompt == "What is 1+1?"


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "image_url", "image_url": {"url": "x.png"}}],
        [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x.png"}}],
        [],
        ["plain"],
        None,
        3,
    ],
)
def test_chat_content_that_is_not_text_is_refused(tmp_path, content):
    rows = [{"prompt": [{"role": "user", "content": content}], "answer": "2"}]
    path = write(tmp_path / "c.json", rows)
    with pytest.raises(ValueError, match="c.json row 0: the user message's content must be"):
        FileTask(path, question="prompt", answer="answer", kind="math", test_size=0)


@pytest.mark.parametrize(
    ("test_size", "match"),
    [
        (1.0, "strictly between 0 and 1"),  # gave one test record, as 1 does
        (1.5, "strictly between 0 and 1"),
        (-0.1, "strictly between 0 and 1"),
        (-2, "count >= 1"),
        (True, "must be a number"),
        ("0.1", "must be a number"),
        (0.999, "leaves no train prompt"),  # put every record in test
        (10, "leaves no train prompt"),
        (0.01, "leaves no test prompt"),  # rounds to 0 of 10 prompts
    ],
)
def test_test_size_is_a_fraction_or_a_count(tmp_path, test_size, match):
    path = write(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": "x"} for i in range(10)])
    with pytest.raises(ValueError, match=f"test_size.*{match}"):
        FileTask(path, question="question", answer="answer", test_size=test_size)


def test_test_size_splits(tmp_path):
    path = write(tmp_path / "t.jsonl", [{"question": f"q{i}", "answer": "x"} for i in range(10)])
    for test_size, n_test in [(0.1, 1), (0.9, 9), (1, 1), (9, 9), (0, 0), (0.0, 0)]:
        task = FileTask(path, question="question", answer="answer", test_size=test_size)
        assert len(task.records("train")) == 10 - n_test
        if n_test:
            assert len(task.records("test")) == n_test
        else:
            with pytest.raises(ValueError, match="no test records"):
                task.records("test")
