import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from anchor_rl.tools.base import Tool
from anchor_rl.tools.search import SearchTool

DOCS = [
    "Zorl was born in Pimva.",
    "Pimva is located in Drask.",
    "The capital of Drask is Tovu.",
    "Kelo was founded by Zorl.",
]


@pytest.fixture(scope="module")
def tool():
    return SearchTool(DOCS)


def test_is_a_tool(tool):
    assert isinstance(tool, Tool)
    assert tool.name == "search"


@pytest.mark.parametrize(
    ("query", "doc"),
    [("Drask capital", 2), ("Zorl born", 0), ("Kelo founded", 3), ("Pimva located", 1)],
)
def test_top1(tool, query, doc):
    assert tool(query) == DOCS[doc]
    assert tool.retrieve(query)[0][0] == doc


def test_top_k_joins_documents_best_first():
    two = SearchTool(DOCS, top_k=2)
    hits = two.retrieve("Zorl born")
    assert [i for i, _ in hits] == [0, 3]  # "born" and "zorl" beat "zorl" alone
    assert hits[0][1] > hits[1][1] > 0
    assert two("Zorl born") == f"{DOCS[0]} {DOCS[3]}"


def test_only_positive_scores_are_returned():
    hits = SearchTool(DOCS, top_k=4).retrieve("Tovu")  # only one document mentions Tovu
    assert [i for i, _ in hits] == [2]


@pytest.mark.parametrize(
    ("query", "message"),
    [
        ("", "empty query"),
        ("   ", "empty query"),
        ("the of", "no results for 'the of'"),
        ("!!!", "no results for '!!!'"),
        ("qqqq", "no results for 'qqqq'"),
    ],
)
def test_bad_queries_get_messages(tool, query, message):
    assert tool(query) == message


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_never_raises(query):
    out = SearchTool(DOCS)(query)
    assert isinstance(out, str) and out


def test_max_chars_cuts_long_results():
    tool = SearchTool(["alpha " * 20], max_chars=12)
    assert tool("alpha") == "alpha alp..."


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"docs": []}, "at least one"),
        ({"docs": DOCS, "top_k": 0}, "top_k"),
        ({"docs": DOCS, "max_chars": 2}, "max_chars"),
    ],
)
def test_rejects_bad_settings(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SearchTool(**kwargs)
