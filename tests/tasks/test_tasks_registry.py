import pytest

from anchor_rl.tasks import TASKS, ArithmeticTask, FileTask, MultihopTask, get_task


def test_names():
    assert list(TASKS) == ["arithmetic", "countdown", "multihop", "file"]


def test_get_task_passes_kwargs():
    task = get_task("arithmetic", n_train=10, n_test=5, seed=2)
    assert isinstance(task, ArithmeticTask)
    assert len(task.records("train")) == 10 and len(task.records("test")) == 5
    assert isinstance(get_task("multihop", n_train=3, n_test=2, n_people=20), MultihopTask)


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match="unknown task 'gsm'; valid names: arithmetic, countdown"):
        get_task("gsm")


def test_unknown_argument_lists_valid_ones():
    with pytest.raises(TypeError, match=r"task 'countdown' got unknown argument\(s\) \['levels'\]"):
        get_task("countdown", levels=[(2, 1)])


def test_file_task(tmp_path):
    path = tmp_path / "g.jsonl"
    path.write_text('{"question": "1+1?", "answer": "#### 2"}\n')
    task = get_task("file", path=str(path), format="gsm8k", test_size=0)
    assert isinstance(task, FileTask)
    assert task.records("train")[0].answer == "2"
