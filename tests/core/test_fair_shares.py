"""FairShares: the heaviest group's least recently used item goes first."""

from __future__ import annotations

from proxy.core.budget import FairShares


def test_victim_is_the_heaviest_groups_oldest() -> None:
    fair = FairShares()
    assert fair.victim() is None
    fair.add("alice", "a1")
    for n in range(5):
        fair.add("bob", f"b{n}")
    assert fair.victim() == "b0"
    fair.touch("b0")
    assert fair.victim() == "b1"
    for n in range(1, 5):
        fair.remove(f"b{n}")
    assert fair.total("bob") == 1 and len(fair) == 2
    assert fair.victim() in ("a1", "b0")  # a tie


def test_weights_decide_not_counts() -> None:
    fair = FairShares()
    fair.add("alice", "big", 10_000)
    for n in range(100):
        fair.add("bob", n, 10)
    assert fair.victim() == "big"
    fair.remove("big")
    assert fair.victim() == 0 and fair.total("alice") == 0


def test_the_heap_stays_bounded() -> None:
    fair = FairShares()
    for n in range(10_000):
        fair.add("g", n % 7, n)
    assert len(fair._heap) <= 4 * 1 + 64 + 1  # noqa: SLF001
    assert fair.victim() is not None


def test_heads_and_kept_bodies_are_evicted_from_the_heaviest_identity() -> None:
    from proxy.core.conversation import HeadTable
    from tests.core.test_fastpath import body, call

    heads = HeadTable(max_heads=6, ttl_seconds=1e9, hot_bytes=2000)

    def record(who: str, n: int, now: float) -> None:
        items = [{"role": "user", "content": f"{who} {n} " + "x" * 300}]
        heads.record(who, (who, n), heads.parse(who, body(items)), {"id": f"{who}-{n}", "output": [call(n)]}, now)

    record("alice", 0, 0.0)
    for n in range(40):  # bob: ten times a fair share of heads, and of kept bytes
        record("bob", n, 1.0 + n)
    assert heads.get(("alice", 0)) is not None
    assert heads.prefixes.body(("alice", 0)) is not None  # still hot
    assert sum(1 for h in heads._heads.values() if h.identity == "bob") == 5  # noqa: SLF001
    assert heads.get(("bob", 39)) is not None and heads.get(("bob", 0)) is None


def test_a_head_the_planner_continues_is_its_identitys_last_to_go() -> None:
    # main's split: lookup only reads; the planner's touch() is what makes a head recent, for
    # the identity's fair share too (not only the table's LRU order).
    from proxy.core.conversation import HeadTable
    from tests.core.test_fastpath import body, call

    heads = HeadTable(max_heads=4, ttl_seconds=1e9)

    def record(who: str, n: int, now: float) -> None:
        items = [{"role": "user", "content": f"{who} {n}"}]
        heads.record(who, (who, n), heads.parse(who, body(items)), {"id": f"{who}-{n}", "output": [call(n)]}, now)

    for n in range(4):
        record("bob", n, float(n))
    heads.touch(("bob", 0), 10.0)  # bob's oldest is being continued
    record("bob", 4, 11.0)
    assert heads.get(("bob", 0)) is not None and heads.get(("bob", 1)) is None
