"""Predicted prefixes: what this router just routed, believed cached for a few seconds."""

from __future__ import annotations

import random

from router.routing.predicted import PredictedPrefixes

KEYS = [11, 22, 33, 44]


def test_a_recorded_prefix_matches_its_longest_leading_run() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS[:3], now=0.0)
    assert predicted.match(KEYS, now=1.0) == {"w1": 3}
    assert predicted.match(KEYS[:2], now=1.0) == {"w1": 2}
    assert len(predicted) == 3


def test_match_stops_at_the_first_key_not_predicted() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    # Keys are chained: after a key that differs, every later key differs too.
    assert predicted.match([11, 99, 98, 97], now=1.0) == {"w1": 1}
    assert predicted.match([99, 11, 22], now=1.0) == {}
    assert predicted.match([], now=1.0) == {}


def test_two_workers_with_different_prefix_depths() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("deep", KEYS, now=0.0)
    predicted.record("shallow", KEYS[:2], now=0.0)
    assert predicted.match(KEYS, now=1.0) == {"deep": 4, "shallow": 2}
    # A worker holding later keys but not the first one has no prefix at all.
    predicted.record("tail", KEYS[1:], now=0.0)
    assert "tail" not in predicted.match(KEYS, now=1.0)


def test_entries_expire_after_their_time_to_live() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=10.0)
    assert predicted.match(KEYS, now=12.9) == {"w1": 4}
    assert predicted.match(KEYS, now=13.0) == {}
    predicted.prune(now=13.0)
    assert len(predicted) == 0


def test_recording_again_extends_the_expiry_and_pruning_keeps_the_newer_entry() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    predicted.record("w1", KEYS, now=2.0)  # expires at 5, not 3
    predicted.prune(now=3.5)  # reads the first record, which is superseded
    assert len(predicted) == 4
    assert predicted.match(KEYS, now=4.0) == {"w1": 4}
    predicted.prune(now=5.0)
    assert len(predicted) == 0


def test_pruning_one_worker_keeps_another_workers_entry_for_the_same_keys() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    predicted.record("w2", KEYS, now=1.0)
    predicted.prune(now=3.0)
    assert predicted.match(KEYS, now=3.0) == {"w2": 4}


def test_removed_keys_end_the_prediction_at_once() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    predicted.record("w2", KEYS, now=0.0)
    predicted.removed("w1", [33])
    assert predicted.match(KEYS, now=1.0) == {"w1": 2, "w2": 4}
    predicted.removed("w1", [999])  # a key never predicted: nothing happens
    assert len(predicted) == 7


def test_forget_worker_drops_all_of_its_entries_only() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    predicted.record("w2", KEYS[:2], now=0.0)
    predicted.forget_worker("w1")
    assert predicted.match(KEYS, now=1.0) == {"w2": 2}
    assert len(predicted) == 2
    predicted.prune(now=10.0)  # the forgotten worker's record expires harmlessly
    assert len(predicted) == 0


def test_a_time_to_live_of_zero_records_nothing() -> None:
    predicted = PredictedPrefixes(ttl_s=0.0)
    predicted.record("w1", KEYS, now=0.0)
    assert len(predicted) == 0
    assert predicted.match(KEYS, now=0.0) == {}


def test_an_empty_prefix_records_nothing() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", [], now=0.0)
    assert len(predicted) == 0


def test_a_forgotten_worker_matches_only_what_it_records_afterwards() -> None:
    predicted = PredictedPrefixes(ttl_s=3.0)
    predicted.record("w1", KEYS, now=0.0)
    predicted.forget_worker("w1")  # a new incarnation: nothing of the old one holds
    predicted.record("w1", [55, 66], now=1.0)
    assert predicted.match(KEYS, now=1.5) == {}
    assert predicted.match([55, 66, 77], now=1.5) == {"w1": 2}
    predicted.removed("w1", [55])  # its first block gone: no prefix is left there
    assert predicted.match([55, 66], now=1.5) == {}


class _Model:
    """What PredictedPrefixes must answer, kept the plain way: every entry's expiry."""

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.expiry: dict[tuple[str, int], float] = {}

    def record(self, worker: str, keys: list[int], now: float) -> None:
        for key in keys:
            self.expiry[worker, key] = now + self.ttl_s

    def match(self, keys: list[int], now: float) -> dict[str, int]:
        matched = {}
        for worker in {worker for worker, _ in self.expiry}:
            held = 0
            while held < len(keys) and self.expiry.get((worker, keys[held]), 0.0) > now:
                held += 1
            if held:
                matched[worker] = held
        return matched

    def removed(self, worker: str, keys: list[int]) -> None:
        for key in keys:
            self.expiry.pop((worker, key), None)

    def forget_worker(self, worker: str) -> None:
        for entry in [entry for entry in self.expiry if entry[0] == worker]:
            del self.expiry[entry]

    def live(self, now: float) -> int:
        return sum(1 for expiry in self.expiry.values() if expiry > now)


def test_it_answers_as_a_plain_record_of_every_entry_would() -> None:
    """Random traffic over few workers and prompts sharing prefixes, long enough for
    workers' maps to be compacted and dropped: every match, and the count after each
    prune, as the plain model's. Removals cut a prompt's tail, as engines evict."""
    rng = random.Random(5)
    predicted, model = PredictedPrefixes(ttl_s=3.0), _Model(ttl_s=3.0)
    prompts = [[rng.getrandbits(62) for _ in range(rng.randrange(1, 300))] for _ in range(40)]
    workers = ["w1", "w2", "w3"]
    now = 0.0
    for _ in range(3000):
        now += rng.choice([0.0, 0.01, 0.2, 1.0])
        prompt = rng.choice(prompts)
        worker = rng.choice(workers)
        action = rng.random()
        if action < 0.5:
            length = rng.randrange(1, len(prompt) + 1)
            predicted.prune(now)
            predicted.record(worker, prompt[:length], now)
            model.record(worker, prompt[:length], now)
        elif action < 0.6:
            cut = rng.randrange(len(prompt))
            predicted.removed(worker, prompt[cut:])
            model.removed(worker, prompt[cut:])
        elif action < 0.62:
            predicted.forget_worker(worker)
            model.forget_worker(worker)
        predicted.prune(now)
        assert predicted.match(prompt, now) == model.match(prompt, now)
        assert len(predicted) == model.live(now)


def test_a_worker_past_thousands_of_keys_keeps_only_its_live_ones() -> None:
    """Expired entries of a worker that keeps getting requests are dropped in bulk once
    its map has grown past the floor (4096 keys): the answers stay, the memory goes."""
    predicted = PredictedPrefixes(ttl_s=3.0)
    old, new = list(range(1, 4001)), list(range(10_001, 10_201))
    predicted.record("w1", old, now=0.0)  # expire at 3.0
    predicted.record("w1", old[:2], now=1.0)  # w1 stays (its last record expires at 4.0)
    predicted.record("w1", new, now=3.5)  # 4,200 keys held: compacted
    assert predicted.match(new, now=3.6) == {"w1": 200}
    assert predicted.match(old, now=3.6) == {"w1": 2}
    assert len(predicted) == 202
    assert len(predicted._expiry["w1"]) == 202  # the memory bound itself, not an answer
