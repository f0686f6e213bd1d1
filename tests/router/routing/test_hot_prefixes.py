"""The cached prefixes requests reuse most, within a bounded memory."""

from __future__ import annotations

from kvplane.core.keys import BlockKey
from router.routing.hot_prefixes import HotPrefix, HotPrefixes


def test_the_heaviest_prefixes_come_first_with_exact_counts() -> None:
    hot = HotPrefixes(capacity=4)
    for _ in range(10):
        hot.matched("acme", BlockKey(1), 2048)  # a system prompt, ten requests
    for _ in range(3):
        hot.matched("acme", BlockKey(2), 8192)  # a long document, three
    hot.matched("globex", BlockKey(1), 64)  # another tenant's scope: another prefix
    assert hot.top(2) == [
        HotPrefix("acme", BlockKey(2), 8192, 3, 24_576),
        HotPrefix("acme", BlockKey(1), 2048, 10, 20_480),
    ]
    assert hot.top(10)[-1] == HotPrefix("globex", BlockKey(1), 64, 1, 64)


def test_memory_stays_bounded_and_the_hot_prefixes_stay() -> None:
    hot = HotPrefixes(capacity=8)
    for request in range(10_000):
        hot.matched("acme", BlockKey(1), 4096)  # hot throughout
        hot.matched("acme", BlockKey(1_000 + request), 16)  # each seen once
        assert len(hot) <= 2 * 8 + 1
    (hottest,) = hot.top(1)
    assert (hottest.key, hottest.requests) == (BlockKey(1), 10_000)
