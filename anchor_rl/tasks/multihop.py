"""Multi-hop questions over a generated knowledge base, answered with a BM25 search tool.

The knowledge base holds fictional people, cities, countries and companies with short
made-up names and one fact per (entity, relation), each stated in one short sentence
(one document). A question is a start entity and a path of 2..4 relations:

    prompt  Kelo: founded > born?
    trace   <search>Kelo founded</search><result>Kelo was founded by Zorl.</result>
            <search>Zorl born</search><result>Zorl was born in Pimva.</result>
            <answer>Pimva</answer>                       (one line, no spaces between)

Each hop queries ``"{entity} {relation}"``; the environment answers with the top-k
documents (``SearchTool``). Every fact's query is checked at construction to return
its own document first, so every trace is reproducible by the real tool.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from anchor_rl.rewards import pvpo, qa
from anchor_rl.rewards.extract import extract_answer
from anchor_rl.tasks._generate import check_counts, mix
from anchor_rl.tasks.base import GuardedTask, Record, Split
from anchor_rl.tools.parsing import format_result
from anchor_rl.tools.search import SearchTool

Reward = Literal["em", "f1", "pvpo"]


@dataclass(frozen=True)
class Relation:
    """A functional relation: each ``subject`` entity has exactly one ``obj`` entity."""

    name: str  # also the query keyword; appears in the sentence
    subject: str
    obj: str
    sentence: str


RELATIONS: tuple[Relation, ...] = (
    Relation("born", "person", "city", "{s} was born in {o}."),
    Relation("works", "person", "company", "{s} works for {o}."),
    Relation("located", "city", "country", "{s} is located in {o}."),
    Relation("capital", "country", "city", "The capital of {s} is {o}."),
    Relation("leader", "country", "person", "The leader of {s} is {o}."),
    Relation("founded", "company", "person", "{s} was founded by {o}."),
    Relation("based", "company", "city", "{s} is based in {o}."),
)
_BY_NAME = {r.name: r for r in RELATIONS}
_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class KnowledgeBase:
    """Entities by type, facts ``(entity, relation) -> entity`` and their documents."""

    entities: dict[str, list[str]]
    facts: dict[tuple[str, str], str]
    docs: list[str]
    doc_of: dict[tuple[str, str], int]


def _names(rng: random.Random, n: int) -> list[str]:
    """``n`` distinct capitalised names like ``Kelo`` or ``Tavim`` (4-5 letters)."""
    names: set[str] = set()
    while len(names) < n:
        syllables = [rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(2)]
        tail = rng.choice(_CONSONANTS) if rng.random() < 0.5 else ""
        names.add(("".join(syllables) + tail).capitalize())
    return sorted(names)


def build_kb(rng: random.Random, sizes: dict[str, int]) -> KnowledgeBase:
    """A consistent knowledge base: every country's capital is one of its cities."""
    pool = _names(rng, sum(sizes.values()))
    rng.shuffle(pool)
    entities: dict[str, list[str]] = {}
    for kind, n in sizes.items():
        entities[kind], pool = pool[:n], pool[n:]
    people, cities, countries, companies = (
        entities[k] for k in ("person", "city", "country", "company")
    )
    facts: dict[tuple[str, str], str] = {}
    for i, city in enumerate(cities):  # every country gets at least one city
        facts[(city, "located")] = countries[i] if i < len(countries) else rng.choice(countries)
    for country in countries:
        facts[(country, "capital")] = rng.choice(
            [c for c in cities if facts[(c, "located")] == country]
        )
        facts[(country, "leader")] = rng.choice(people)
    for person in people:
        facts[(person, "born")] = rng.choice(cities)
        facts[(person, "works")] = rng.choice(companies)
    for company in companies:
        facts[(company, "founded")] = rng.choice(people)
        facts[(company, "based")] = rng.choice(cities)
    keys = sorted(facts)
    docs = [_BY_NAME[r].sentence.format(s=s, o=facts[(s, r)]) for s, r in keys]
    return KnowledgeBase(entities, facts, docs, {key: i for i, key in enumerate(keys)})


def query(entity: str, relation: str) -> str:
    """The search query of one hop."""
    return f"{entity} {relation}"


def _paths(hops: int, kind: str) -> list[tuple[str, ...]]:
    """Type-consistent relation paths of length ``hops`` starting from an entity of ``kind``."""
    if hops == 0:
        return [()]
    return [
        (r.name, *rest) for r in RELATIONS if r.subject == kind for rest in _paths(hops - 1, r.obj)
    ]


def _questions(
    kb: KnowledgeBase, hops: int, resolvable: set[tuple[str, str]]
) -> list[tuple[str, tuple[str, ...], list[str]]]:
    """All ``(start, path, chain)`` of ``hops`` hops whose entities are all distinct."""
    out = []
    for kind, names in kb.entities.items():
        for path in _paths(hops, kind):
            for start in names:
                chain = [start]
                for rel in path:
                    if (chain[-1], rel) not in resolvable:
                        break
                    chain.append(kb.facts[(chain[-1], rel)])
                if len(chain) == hops + 1 and len(set(chain)) == hops + 1:
                    out.append((start, path, chain))
    return out


def _finds(search: SearchTool, key: tuple[str, str], doc: int) -> bool:
    """Whether the query of fact ``key`` ranks its document first, strictly ahead of the next."""
    hits = search.retrieve(query(*key), k=2)
    return bool(hits) and hits[0][0] == doc and (len(hits) == 1 or hits[0][1] > hits[1][1])


class MultihopTask(GuardedTask):
    """2..4-hop questions over a seeded knowledge base, with the ``search`` tool.

    Args:
        n_train, n_test: records per split (questions are distinct across both).
        seed: seeds the knowledge base and the questions.
        hops: the hop counts to mix (each 2..4); default 2, 3, 4.
        weights: sampling weight per hop count (default uniform).
        reward: ``"em"`` (exact match, default), ``"f1"`` (token F1) or ``"pvpo"`` (the
            PVPO manager: format floor, F1 or cover-exact-match). ``correct`` is always
            exact match.
        top_k: documents per search result.
        n_people, n_cities, n_countries, n_companies: knowledge-base size.
    """

    name = "multihop"
    scoring_kwargs = frozenset({"reward"})
    instruction = (
        "Look facts up with <search>entity relation</search>; "
        "give the final entity inside <answer></answer>."
    )

    def __init__(
        self,
        n_train: int = 2000,
        n_test: int = 200,
        seed: int = 0,
        hops: Sequence[int] = (2, 3, 4),
        weights: Sequence[float] | None = None,
        reward: Reward = "em",
        top_k: int = 1,
        n_people: int = 200,
        n_cities: int = 60,
        n_countries: int = 12,
        n_companies: int = 80,
    ) -> None:
        super().__init__()
        check_counts(n_train, n_test)
        if reward not in ("em", "f1", "pvpo"):
            raise ValueError(f"reward must be 'em', 'f1' or 'pvpo', got {reward!r}")
        self.hops = [int(h) for h in hops]
        if any(not 2 <= h <= 4 for h in self.hops):
            raise ValueError(f"hops must lie in 2..4, got {self.hops}")
        weights_ = mix(self.hops, weights, "hop")
        sizes = {
            "person": n_people,
            "city": n_cities,
            "country": n_countries,
            "company": n_companies,
        }
        if n_countries < 1 or n_cities < n_countries or min(sizes.values()) < 1:
            raise ValueError(f"need >= 1 entity of each kind and n_cities >= n_countries: {sizes}")
        self.reward_kind: Reward = reward
        rng = random.Random(seed)
        self.kb = build_kb(rng, sizes)
        search = SearchTool(self.kb.docs, top_k=top_k)
        self.tools = {search.name: search}
        resolvable = {key for key, doc in self.kb.doc_of.items() if _finds(search, key, doc)}
        pools = {h: _questions(self.kb, h, resolvable) for h in self.hops}
        for pool in pools.values():
            rng.shuffle(pool)
        self._splits = self._draw(rng, pools, weights_, n_test, n_train)

    def _draw(
        self,
        rng: random.Random,
        pools: dict[int, list[tuple[str, tuple[str, ...], list[str]]]],
        weights: list[float],
        n_test: int,
        n_train: int,
    ) -> dict[Split, list[Record]]:
        out: dict[Split, list[Record]] = {"test": [], "train": []}
        for split, n in (("test", n_test), ("train", n_train)):
            for i in range(n):
                live = [
                    (h, w) for h, w in zip(self.hops, weights, strict=True) if pools[h] and w > 0
                ]
                if not live:
                    raise ValueError(
                        f"multihop: ran out of distinct questions after {i} {split} records; "
                        "enlarge the knowledge base (n_people, ...) or ask for fewer records"
                    )
                h = rng.choices([h for h, _ in live], [w for _, w in live])[0]
                start, path, chain = pools[h].pop()
                meta = {
                    "difficulty": h,
                    "hops": h,
                    "path": list(path),
                    "entities": chain,
                    "queries": [query(e, r) for e, r in zip(chain, path, strict=False)],
                }
                prompt = f"{start}: {' > '.join(path)}?"
                out[split].append(Record(f"{self.name}-{split}-{i}", prompt, chain[-1], meta))
        return out

    def records(self, split: Split) -> list[Record]:
        return list(self._splits[split])

    def score(self, completion: str, record: Record) -> float:
        """The configured reward: EM or F1 of the extracted answer (0.0 if none), or PVPO."""
        if self.reward_kind == "pvpo":
            return pvpo.reward(completion, record.answer, tools=tuple(self.tools))
        pred = extract_answer(completion)
        if pred is None:
            return 0.0
        return (
            qa.exact_match(pred, record.answer)
            if self.reward_kind == "em"
            else qa.f1(pred, record.answer)
        )

    def verdict(self, completion: str, record: Record) -> bool:
        """Exact match of the extracted answer, whatever the training reward."""
        pred = extract_answer(completion)
        return pred is not None and qa.exact_match(pred, record.answer) == 1.0

    def trace(self, record: Record) -> str:
        """The oracle's tool turns, with results produced by this task's search tool."""
        search = self.tools["search"]
        turns = "".join(
            f"<search>{q}</search>{format_result(search(q))}" for q in record.meta["queries"]
        )
        return f"{turns}<answer>{record.answer}</answer>"
