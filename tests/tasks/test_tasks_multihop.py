import re
from collections import Counter

import pytest

from anchor_rl.rewards.format import format_ok
from anchor_rl.tasks.base import Record
from anchor_rl.tasks.multihop import MultihopTask
from anchor_rl.tools.parsing import format_result, parse_tool_call

TAGS = ("<search>", "</search>", "<result>", "</result>", "<answer>", "</answer>")
TURN = re.compile(r"<search>(.*?)</search><result>(.*?)</result>")


def n_tokens(text: str) -> int:
    return len(text) - sum(text.count(t) * (len(t) - 1) for t in TAGS)


@pytest.fixture(scope="module")
def task():
    return MultihopTask(n_train=400, n_test=100, seed=7)


def test_every_trace_replays_with_the_real_search_tool(task):
    search = task.tools["search"]
    for r in task.records("train") + task.records("test"):
        trace = task.trace(r)
        turns = TURN.findall(trace)
        assert [q for q, _ in turns] == r.meta["queries"]
        for (query, shown), subject, relation, obj in zip(
            turns, r.meta["entities"][:-1], r.meta["path"], r.meta["entities"][1:], strict=True
        ):
            assert query == f"{subject} {relation}"
            assert search(query) == shown  # the real tool returns the shown document
            assert subject in shown.split() or f"{subject}." in shown.split()
            assert shown.endswith(f"{obj}.")
        # the agent loop's view: the text up to each close tag parses to that query
        for match in re.finditer("</search>", trace):
            tag, query = parse_tool_call(trace[: match.end()], ["search"])
            nxt = trace[match.end() :]
            assert nxt.startswith(format_result(search(query)))
        assert trace.endswith(f"<answer>{r.answer}</answer>")
        assert format_ok(trace)
        assert task.reward(trace, r) == 1.0 and task.correct(trace, r)
        assert n_tokens(r.prompt) + n_tokens(trace) <= 220


def test_hops_mix_and_meta(task):
    records = task.records("train")
    counts = Counter(r.meta["hops"] for r in records)
    assert set(counts) == {2, 3, 4}
    assert min(counts.values()) > 80
    for r in records:
        h = r.meta["hops"]
        assert r.meta["difficulty"] == h == len(r.meta["path"]) == len(r.meta["queries"])
        assert len(set(r.meta["entities"])) == h + 1
        assert r.prompt == f"{r.meta['entities'][0]}: {' > '.join(r.meta['path'])}?"


def test_splits_disjoint_and_deterministic(task):
    train, test = task.records("train"), task.records("test")
    assert not {r.prompt for r in train} & {r.prompt for r in test}
    assert len({r.prompt for r in train}) == len(train)
    again = MultihopTask(n_train=400, n_test=100, seed=7)
    assert again.records("train") == train and again.kb.docs == task.kb.docs
    assert MultihopTask(n_train=400, n_test=100, seed=8).kb.docs != task.kb.docs


def test_knowledge_base_is_consistent(task):
    kb = task.kb
    for country in kb.entities["country"]:
        assert kb.facts[(kb.facts[(country, "capital")], "located")] == country
    assert len(kb.docs) == len(kb.facts) == len(set(kb.docs))
    assert all(d.isascii() for d in kb.docs)


RECORD = Record("x", "Kelo: founded > born?", "Pimva Tor", {})


@pytest.mark.parametrize(
    ("reward", "completion", "value", "correct"),
    [
        ("em", "<answer>the pimva tor</answer>", 1.0, True),
        ("em", "<answer>Pimva</answer>", 0.0, False),
        ("em", "Pimva Tor", 0.0, False),
        ("f1", "<answer>Pimva</answer>", 2 / 3, False),  # P = 1, R = 1/2
        ("pvpo", "<answer>Pimva</answer>", 0.1, False),
        ("pvpo", "<answer>in Pimva Tor</answer>", 1.0, False),  # CEM rewards, EM judges
        ("pvpo", "<search>q</search><answer>Pimva Tor</answer>", 0.0, True),  # format
    ],
)
def test_reward_kinds(reward, completion, value, correct):
    task = MultihopTask(n_train=5, n_test=5, reward=reward, n_people=20, n_companies=10)
    assert task.reward(completion, RECORD) == pytest.approx(value)
    assert task.correct(completion, RECORD) is correct


def test_top_k_two_still_replays():
    task = MultihopTask(n_train=30, n_test=10, top_k=2, n_people=40, n_companies=20)
    search = task.tools["search"]
    for r in task.records("train"):
        for query, shown in TURN.findall(task.trace(r)):
            assert search(query) == shown
            assert len(search.retrieve(query)) == 2


def test_tools_and_stops(task):
    assert list(task.tools) == ["search"]
    assert task.stop == ["</answer>", "</search>"]


def test_bad_settings():
    with pytest.raises(ValueError, match="reward"):
        MultihopTask(reward="bleu")
    with pytest.raises(ValueError, match="hops"):
        MultihopTask(hops=[1, 2])
    with pytest.raises(ValueError, match="ran out of distinct questions"):
        MultihopTask(n_train=5000, n_test=0, hops=[2], n_people=10, n_companies=5)
