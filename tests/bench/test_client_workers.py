"""The arrival schedule and its split over client processes (asyncserve/bench/client_workers.py)."""

from __future__ import annotations

import statistics

import pytest

from asyncserve.bench.client_workers import Job, arrival_times, split_concurrency, split_jobs


def test_all_at_once() -> None:
    assert arrival_times(5, float("inf"), seed=0) == [0.0] * 5


def test_poisson_schedule_is_seeded_and_has_the_rate() -> None:
    times = arrival_times(20000, rate=16.0, seed=3)
    assert times == arrival_times(20000, rate=16.0, seed=3)
    assert times[0] == 0.0 and times == sorted(times)
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    assert statistics.fmean(gaps) == pytest.approx(1 / 16, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    assert statistics.stdev(gaps) == pytest.approx(1 / 16, rel=0.05)


def test_split_partitions_the_schedule_round_robin() -> None:
    jobs = [Job(i, t, [1], 4) for i, t in enumerate(arrival_times(103, 10.0, seed=1))]
    parts = split_jobs(jobs, 4)
    assert [len(p) for p in parts] == [26, 26, 26, 25]
    merged = sorted((j for p in parts for j in p), key=lambda j: j.index)
    assert merged == jobs  # nothing lost, nothing repeated, times unchanged
    for part in parts:
        assert [j.send_at for j in part] == sorted(j.send_at for j in part)
        # each part spans the whole run, not one slice of it
        assert part[-1].send_at > 0.9 * jobs[-1].send_at


def test_concurrency_split_adds_up() -> None:
    assert split_concurrency(None, 3) == [None, None, None]
    assert split_concurrency(10, 3) == [4, 3, 3]
    assert sum(split_concurrency(257, 8)) == 257
