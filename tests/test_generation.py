"""The gateway's per-session K schedule."""

from __future__ import annotations

import dataclasses

from gateway.generation import GenerationPlan, KSchedule
from specserve.sampling import SamplingParams


def plan(k: int, adaptive: bool) -> GenerationPlan:
    return GenerationPlan([1], 64, SamplingParams(), "draft_model", k, adaptive=adaptive, k_bounds=(1, 8))


def test_adaptive_k_grows_after_full_acceptance_and_falls_halfway_after_a_rejection():
    schedule = KSchedule(plan(8, adaptive=True))
    schedule.update(8, 8)
    assert schedule.k == 8  # capped at the upper bound
    schedule.update(8, 0)
    assert schedule.k == 5  # halfway from 8 down to 0 kept + 1, rounded up
    schedule.update(5, 5)
    assert schedule.k == 6
    schedule.update(6, 3)
    assert schedule.k == 5
    for _ in range(5):
        schedule.update(schedule.k, 0)
    assert schedule.k == 2  # halfway from 2 to 1, rounded up: repeated misses settle at 2
    bounded = KSchedule(dataclasses.replace(plan(8, adaptive=True), k_bounds=(3, 8)))
    for _ in range(5):
        bounded.update(bounded.k, 0)
    assert bounded.k == 3  # the lower bound


def test_fixed_k_stays():
    schedule = KSchedule(plan(4, adaptive=False))
    schedule.update(4, 0)
    schedule.update(4, 4)
    assert schedule.k == 4
