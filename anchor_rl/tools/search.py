"""BM25 search over a list of short documents (bm25s)."""

from __future__ import annotations

from collections.abc import Sequence

import bm25s

STOPWORDS = "en"


def _tokenize(texts: list[str]) -> list[list[str]]:
    return bm25s.tokenize(texts, stopwords=STOPWORDS, return_ids=False, show_progress=False)


class SearchTool:
    """``search``: the top-k documents for a query, by BM25 (lucene variant, k1=1.5, b=0.75).

    Documents and queries are lower-cased, split into word tokens of two or more word
    characters, and English stop words are dropped (bm25s' defaults). Results are the
    matching documents joined by a space, best first; documents with score 0 (no query
    token in common) are never returned. Never raises on a query: an empty or unmatched
    query returns a short message instead.

    Args:
        docs: the corpus, one string per document (non-empty).
        top_k: documents per answer.
        max_chars: answers longer than this are cut, ending in ``...`` (None: no limit).
    """

    name = "search"

    def __init__(self, docs: Sequence[str], top_k: int = 1, max_chars: int | None = 300) -> None:
        if not docs:
            raise ValueError("SearchTool needs at least one document")
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        if max_chars is not None and max_chars < 3:
            raise ValueError(f"max_chars must be >= 3 or None, got {max_chars}")
        self.docs = list(docs)
        self.top_k = top_k
        self.max_chars = max_chars
        self._index = bm25s.BM25()
        self._index.index(_tokenize(self.docs), show_progress=False)

    def retrieve(self, query: str, k: int | None = None) -> list[tuple[int, float]]:
        """``(doc index, score)`` of the top ``k`` (default ``top_k``) documents with a
        positive score, best first."""
        tokens = _tokenize([query])
        if not tokens[0]:
            return []
        k = min(k or self.top_k, len(self.docs))
        ids, scores = self._index.retrieve(tokens, k=k, show_progress=False, n_threads=1)
        return [(int(i), float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]

    def __call__(self, query: str) -> str:
        """The text of the top-k documents for ``query``, or a readable message."""
        query = query.strip()
        if not query:
            return "empty query"
        hits = self.retrieve(query)
        if not hits:
            return f"no results for {query[:50]!r}"
        text = " ".join(self.docs[i] for i, _ in hits)
        if self.max_chars is not None and len(text) > self.max_chars:
            text = text[: self.max_chars - 3] + "..."
        return text
