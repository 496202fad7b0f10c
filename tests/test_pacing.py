"""Pacing: a method whose rounds no K describes (lookahead) alternates with target-only rounds
where its tokens per second are fewer, per session, from the process's measured costs."""

from specserve.adaptive import PROBE_STRETCH, RoundCosts
from specserve.pacing import MEASURE_ROUNDS, PROBE_ROUNDS, MethodRate, Pacing


def _costs(target_only_s: float) -> RoundCosts:
    costs = RoundCosts()
    for _ in range(5):
        costs.observe("none", 0, None, target_only_s * 0.9, target_only_s)
    return costs


def _rounds(pacing: Pacing, count: int, tokens: int, seconds: float) -> list[bool]:
    """Which of count rounds were the method's; each of those makes tokens in seconds, each
    target-only one a token in 10 ms."""
    chosen = []
    for _ in range(count):
        speculated = pacing.speculate()
        chosen.append(speculated)
        pacing.observe(speculated, tokens if speculated else 1, seconds if speculated else 0.01, 0.009)
    return chosen


def test_a_method_that_does_not_pay_runs_doubling_target_only_stretches():
    pacing = Pacing(_costs(0.01), MethodRate())
    chosen = _rounds(pacing, 40, tokens=2, seconds=0.04)  # 50 tokens/s against 100
    first = PROBE_STRETCH[0]
    expected = [True] * PROBE_ROUNDS + [False] * first + [True] * PROBE_ROUNDS + [False] * 2 * first
    assert chosen[: len(expected)] == expected
    assert chosen.count(False) > chosen.count(True)


def test_a_method_that_pays_keeps_every_round():
    pacing = Pacing(_costs(0.01), MethodRate())
    assert all(_rounds(pacing, 30, tokens=3, seconds=0.02))  # 150 tokens/s against 100


def test_a_new_session_starts_from_what_earlier_ones_measured():
    costs, shared = _costs(0.01), MethodRate()
    _rounds(Pacing(costs, shared), 10, tokens=2, seconds=0.04)  # two stretches: the next is 4 times the first
    assert shared.stretch == 4 * PROBE_STRETCH[0]
    late = Pacing(costs, shared)
    assert not late.speculate()  # no probe rounds first: the method's rate says it does not pay
    assert late.target_only_left == shared.stretch  # and it waits as long as the last session would have
    assert Pacing(_costs(0.01), MethodRate()).speculate()


def test_without_a_measured_target_only_round_a_couple_are_run_to_measure_one():
    pacing = Pacing(RoundCosts(), MethodRate())
    chosen = _rounds(pacing, PROBE_ROUNDS + MEASURE_ROUNDS + PROBE_ROUNDS, tokens=2, seconds=0.04)
    assert chosen[: PROBE_ROUNDS + MEASURE_ROUNDS] == [True] * PROBE_ROUNDS + [False] * MEASURE_ROUNDS
    assert pacing.costs.round_seconds("none", 0) is not None
    assert not pacing.speculate()  # measured since: 50 tokens/s do not pay against 100
