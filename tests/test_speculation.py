"""The choice of K: from measured costs and acceptance, 0 (no drafts) included, and back."""

from __future__ import annotations

import pytest

from specserve.adaptive import PROBE_STRETCH, Acceptance, Batch, KChooser, RoundCosts, Shared
from specserve.errors import InvalidArgument
from specserve.speculation import Speculation

ADAPTIVE = Speculation("draft_model", 4, adaptive=True, k_bounds=(0, 8))


def costs(draft_step: float, verify_one: float, per_token: float, overhead: float = 0.0) -> Shared:
    """Shared estimates as if measured: a draft step, and verifies of 1 to 9 tokens."""
    shared = Shared()
    for k in range(9):
        draft = draft_step * k if k else None
        verify = verify_one + per_token * k
        for _ in range(30):
            shared.costs.observe("draft_model", k, draft, verify, (draft or 0.0) + verify + overhead)
    return shared


def test_fixed_k_stays_but_never_runs_past_max_tokens():
    chooser = KChooser(Speculation("draft_model", 4, adaptive=False))
    chooser.observe(4, 0, 0.001, 0.002, 0.004)
    assert [chooser.next_k(remaining) for remaining in (64, 5, 3, 1)] == [4, 4, 2, 0]


def test_cheap_drafts_that_are_kept_get_a_large_k():
    shared = costs(draft_step=0.0001, verify_one=0.002, per_token=0.0001)
    chooser = KChooser(ADAPTIVE, shared)
    for _ in range(20):
        chooser.observe(4, 4, 0.0004, 0.0024, 0.003)  # every draft kept
    assert chooser.next_k(100) >= 6


def test_dear_drafts_that_are_rejected_stop_drafting_then_try_again():
    shared = costs(draft_step=0.002, verify_one=0.002, per_token=0.0005)
    chooser = KChooser(ADAPTIVE, shared)
    for _ in range(20):
        chooser.observe(2, 0, 0.004, 0.003, 0.007)  # nothing kept
    assert chooser.next_k(100) == 0
    assert chooser.target_only_tokens == PROBE_STRETCH[0]
    for _ in range(PROBE_STRETCH[0] - 1):
        assert chooser.next_k(100) == 0
        chooser.observe(0, 0, None, 0.002, 0.002)
    chooser.observe(0, 0, None, 0.002, 0.002)
    assert chooser.next_k(100) >= 1  # the stretch is over: a round of drafts, to measure again
    chooser.observe(1, 0, 0.002, 0.0025, 0.0045)
    assert chooser.next_k(100) == 0 and chooser.target_only_tokens == 2 * PROBE_STRETCH[0]  # doubled


def test_a_round_that_kept_every_draft_is_followed_by_a_longer_one_within_bounds():
    shared = costs(draft_step=0.001, verify_one=0.002, per_token=0.001)
    chooser = KChooser(Speculation("draft_model", 3, adaptive=True, k_bounds=(1, 5)), shared)
    chooser.observe(3, 3, 0.003, 0.005, 0.008)
    assert chooser.next_k(100) >= 4
    chooser.observe(5, 5, 0.005, 0.007, 0.012)
    assert chooser.next_k(100) == 5  # not past the upper bound
    assert chooser.next_k(3) == 2  # nor past max_tokens


def test_costs_unknown_start_at_the_asked_k():
    assert KChooser(ADAPTIVE).next_k(100) == 4


def test_verify_cost_is_a_line_through_the_sizes_seen():
    measured = RoundCosts()
    assert measured.verify_seconds(3) is None
    measured.observe("draft_model", 4, 0.001, 0.006, 0.008)  # one size: a prior slope
    assert measured.verify_seconds(5) == pytest.approx(0.006)
    assert 0 < measured.verify_seconds(1) < 0.006
    for _ in range(5):
        measured.observe("draft_model", 0, None, 0.002, 0.0025)
        measured.observe("draft_model", 4, 0.001, 0.006, 0.008)
    assert measured.verify_seconds(1) == pytest.approx(0.002, rel=0.05)
    assert measured.verify_seconds(3) == pytest.approx(0.004, rel=0.05)
    assert measured.round_seconds("ngram", 2) is None  # no ngram draft measured yet
    assert measured.round_seconds("draft_model", 0) == pytest.approx(0.0025, rel=0.05)


def test_a_size_measured_only_while_slower_fades_from_the_line():
    """Drafting of 1 token measured while a compile ran (three times its cost), then only 4
    and 8 tokens for a while: the line runs through the fresh sizes again."""
    costs = RoundCosts()
    for _ in range(20):
        costs.observe("draft_model", 1, 3e-3, 1e-3, 5e-3)
    stale = costs.drafting["draft_model"].at(1)
    for _ in range(150):
        costs.observe("draft_model", 4, 1.6e-3, 1e-3, 3e-3)
        costs.observe("draft_model", 8, 2.4e-3, 1e-3, 4e-3)
    fresh = 1.6e-3 - 3 * (2.4e-3 - 1.6e-3) / 4  # the line through 4 and 8, at 1
    assert stale == pytest.approx(3e-3)
    # 4 is the size nearest 1: the stale point, at a fortieth of its weight, still moves it a little
    assert costs.drafting["draft_model"].at(1) == pytest.approx(fresh, rel=0.1)


def test_costs_that_bend_are_read_near_the_size_asked_not_from_a_line_through_all():
    """What a CPU verifier of 16 sessions measured: a target-only batch (16 tokens) costs 15.8
    ms, batches whose sessions drafted 1-3 tokens each (32-64) 28-31 ms: per token dearer at
    first, then cheaper. One line through them put the target-only batch near 26 ms, K = 1
    looked as cheap as K = 0, and a batch drafting where drafts did not pay kept on (0.91x
    target-only). Read near each size, the batch's K = 0 costs what it was measured to."""
    shared = Shared()
    for i in range(30):  # target-only rounds of the 16 sessions
        shared.costs.observe("draft_model", 0, None, 15.8e-3, 22.8e-3, Batch(16, 16, 0, started_ns=i + 1))
    for i in range(150):  # then rounds where most sessions drafted
        tokens = 32 + i % 33
        drafting, verify = 8e-3 + 0.05e-3 * (tokens - 16), 28e-3 + 0.1e-3 * (tokens - 32)
        shared.costs.observe(
            "draft_model",
            2,
            drafting,
            verify,
            drafting + verify + 11e-3,
            Batch(16, tokens, tokens - 16, started_ns=100 + i),
        )
    assert shared.costs.round_seconds("draft_model", 0, sessions=16) == pytest.approx(22.8e-3, rel=0.05)
    assert shared.costs.round_seconds("draft_model", 1, sessions=16) == pytest.approx(47.8e-3, rel=0.05)
    chooser = KChooser(ADAPTIVE, shared)
    for accepted in [1, 0, 2, 0, 1] * 8:  # a first draft kept 0.6 of the time: E(1) = 1.6
        chooser.acceptance.observe(2, accepted)
    assert chooser.next_round(100, sessions=16).k == 0  # 16 / 22.8 ms beats 16 x 1.6 / 47.8 ms


def test_sampled_sessions_read_their_own_costs_not_those_greedy_load_measured():
    """A sampled decision costs each verified row a softmax and draws, a greedy one an argmax:
    after greedy rounds, sampled drafts read off the same lines looked cheaper than they were
    (a default request drafted in 10-29% of sampled rounds under load, below target-only)."""
    shared = Shared()
    for k in range(3):  # sampled rounds: a draft step 0.3 ms, a verify 2 ms and 1.1 ms a draft
        for _ in range(20):
            verify = 2e-3 + 1.1e-3 * k
            shared.costs_for(True).observe("draft_model/sampled", k, 0.3e-3 * k or None, verify, verify + 0.5e-3)
    for k in range(3):  # then greedy load: 0.1 ms a draft
        for _ in range(200):
            verify = 2e-3 + 0.1e-3 * k
            shared.costs_for(False).observe("draft_model", k, 0.3e-3 * k or None, verify, verify + 0.5e-3)
    sampled, greedy = KChooser(ADAPTIVE, shared, sampled=True), KChooser(ADAPTIVE, shared)
    for chooser in (sampled, greedy):
        for accepted in [1, 0] * 10:  # a first draft kept half the time: E(1) = 1.5
            chooser.acceptance.observe(2, accepted)
    assert greedy.next_k(100) == 1  # 1.5 / 2.9 ms beats 1 / 2.5 ms
    assert sampled.next_k(100) == 0  # 1 / 2.5 ms beats 1.5 / 3.9 ms


def test_the_rest_of_a_round_leaves_out_the_batchs_drafting_counted_or_not():
    """Every session of a batch waits for its drafting, whether it drafted or not, and whether
    or not that drafting gives a drafting point (a draft model first catching up after
    target-only rounds gives none). Counted as the rest of a round, it made batches of that
    size look dear: at 4 sampled clients a target-only batch of 4 tokens was read at 8.1 ms
    against 6.8 measured, and sessions drafted where drafts did not pay."""
    costs = RoundCosts()
    # A target-only session reports first; the other session caught up and drafted 3 tokens in 4 ms.
    costs.observe("draft_model", 0, None, 3e-3, 8e-3, Batch(2, 5, 3, started_ns=1, caught_up=True, draft_s=4e-3))
    costs.observe("draft_model", 3, None, 3e-3, 8e-3, Batch(2, 5, 3, started_ns=1, caught_up=True, draft_s=4e-3))
    # Alone, catching up: no drafting point, and its drafting is no rest either.
    costs.observe("draft_model", 3, None, 2.5e-3, 7.5e-3, Batch(1, 4, 3, started_ns=2, caught_up=True, draft_s=4e-3))
    assert costs.rest.averages[5].value == pytest.approx(1e-3)
    assert costs.rest.averages[4].value == pytest.approx(1e-3)
    assert "draft_model" not in costs.drafting


@pytest.mark.parametrize("draft_step, drafts", [(0.8e-3, False), (0.3e-3, True)])
def test_drafts_must_promise_more_than_the_costs_error_over_target_only(draft_step, drafts):
    """A first draft kept half the time, alone: K = 1 makes 1.5 tokens for 2 ms of verify and
    its drafting. At a draft step of 0.8 ms that is 1.5 / 2.8 ms, 6% more tokens a second than
    1 / 2 ms target-only, within what the costs err by: no drafts. At 0.3 ms, 1.5 / 2.3 ms,
    30% more: drafts."""
    shared = costs(draft_step=draft_step, verify_one=2e-3, per_token=0.0)
    chooser = KChooser(Speculation("draft_model", 1, adaptive=True, k_bounds=(0, 1)), shared)
    for accepted in [1, 0] * 10:
        chooser.acceptance.observe(1, accepted)
    assert 1.5 / (2e-3 + draft_step) > 1 / 2e-3  # K = 1 is faster on the costs as read
    assert (chooser.best_k(100) == 1) is drafts


def test_a_position_no_round_reaches_keeps_what_was_known_of_it():
    """Rounds of one draft say nothing of the second position: its rate stays what rounds of
    four measured, not the prior (which made a longer K look worse than it was, and a batch
    drafting one token a session never tried two)."""
    seen = Acceptance()
    for _ in range(40):
        seen.observe(4, 4)  # every draft kept
    second = seen.rate(1)
    for _ in range(100):
        seen.observe(1, 1)
    assert seen.rate(1) == pytest.approx(second) and second > 0.95
    for _ in range(100):
        seen.observe(4, 0)  # the first rejected: the second is not reached either
    assert seen.rate(1) == pytest.approx(second) and seen.rate(0) < 0.05


def test_expected_tokens_follow_the_rates_of_each_position():
    seen = Acceptance()
    for _ in range(200):
        seen.observe(2, 2)
    # Counts decay to about ten rounds, and half a round of 0.5 smooths each rate.
    assert seen.expected_tokens(2) == pytest.approx(3.0, rel=0.03)
    assert seen.expected_tokens(4) == pytest.approx(5.0, rel=0.06)  # past the deepest: its rate
    never = Acceptance()
    for _ in range(200):
        never.observe(4, 0)
    assert never.expected_tokens(4) == pytest.approx(1.0, abs=0.03)


def test_a_session_starts_from_its_methods_acceptance_across_sessions():
    shared = Shared()
    KChooser(ADAPTIVE, shared).observe(4, 4, 0.001, 0.003, 0.004)
    fresh = KChooser(ADAPTIVE, shared)
    assert fresh.acceptance.rate(0) > 0.5  # the first session kept everything


@pytest.mark.parametrize(
    "fields",
    [{"method": "bogus"}, {"num_speculative_tokens": 0}, {"k_bounds": (3, 2)}, {"k_bounds": (0, 0)},
     {"min_draft_probability": 1.5}, {"min_draft_probability": float("nan")}],
)  # fmt: skip
def test_bad_speculation_settings_are_invalid(fields):
    with pytest.raises(InvalidArgument):
        Speculation(**fields)


def test_speculation_travels_in_its_message():
    sent = Speculation("ngram", 6, adaptive=True, k_bounds=(1, 9), min_draft_probability=0.25)
    assert Speculation.from_proto(sent.to_proto()) == sent


def test_a_drafting_that_reads_more_than_a_round_made_is_not_counted_as_a_rounds_cost():
    """The first drafting reads the prompt and the first after target-only rounds reads what
    they made: neither is what a round's drafting costs (counted, target-only stretches fed
    themselves: dear drafts, longer stretches, longer catch-ups)."""
    from types import SimpleNamespace

    from verify_service.local_drafts import SessionDrafts

    seen = []
    chooser = SimpleNamespace(observe=lambda k, accepted, draft_s, verify_s, round_s, tree, batch: seen.append(draft_s))
    drafts = SessionDrafts(speculation=None, draft=None, chooser=chooser)
    for k in (4, 4, 0, 0, 4, 4):
        outcome = SimpleNamespace(decided_ns=2, batch_started_ns=1, draft_seconds=5e-4 if k else 0.0,
                                  num_draft_tokens=k, num_accepted=0, batch_sessions=0)  # fmt: skip
        drafts.observe(outcome, 1e-3)
    assert seen == [None, 5e-4, 0.0, None, None, 5e-4]


def test_a_tree_is_cut_to_what_max_tokens_leaves():
    from specserve.methods.trees import TreeShape

    tree = TreeShape.parse([2, 1, 1])
    chooser = KChooser(Speculation("draft_model", 4, adaptive=False, tree=tree))
    assert chooser.next_round(64).tree == tree and chooser.next_round(64).k == 6
    assert chooser.next_round(3).tree == TreeShape.parse([2, 1]) and chooser.next_round(3).k == 4
    assert chooser.next_round(1).k == 0 and chooser.next_round(1).tree is None


@pytest.mark.parametrize("tree_tokens, tree_cost, chosen", [(5.0, 0.004, "tree"), (1.5, 0.006, "chain")])
def test_adaptive_takes_the_tree_where_it_gives_more_tokens_per_second(tree_tokens, tree_cost, chosen):
    """A tree is tried first; then it is taken while its measured tokens per second beat the
    best chain's, and tried again every TREE_PROBE_ROUNDS chain rounds."""
    from specserve.adaptive import TREE_PROBE_ROUNDS
    from specserve.methods.trees import TreeShape

    shared = costs(draft_step=0.0002, verify_one=0.002, per_token=0.0002)
    tree = TreeShape.parse([2, 1, 1])
    chooser = KChooser(Speculation("draft_model", 4, adaptive=True, k_bounds=(0, 8), tree=tree), shared)
    for _ in range(10):
        chooser.observe(4, 2, 0.0008, 0.0028, 0.0036)  # a chain of 4 keeps 2: 3 tokens in 3.6 ms
    assert chooser.next_round(100).tree == tree  # never measured: tried
    for _ in range(10):
        draft = 0.001
        chooser.observe(6, round(tree_tokens) - 1, draft, tree_cost - draft, tree_cost, tree=True)
    choice = chooser.next_round(100)
    assert (choice.tree is not None) == (chosen == "tree")
    if chosen == "chain":
        assert choice.k >= 1
        for _ in range(TREE_PROBE_ROUNDS):
            chooser.observe(choice.k, 2, 0.0008, 0.0028, 0.0036)
        assert chooser.next_round(100).tree == tree  # tried again


def batched_costs(fixed: float, per_token: float, draft_step: float, sessions: int) -> Shared:
    """Shared estimates as if measured by batches of 1 and of `sessions` sessions, each of
    which drafted 0 or 4 tokens: a verify of n tokens costs fixed + per_token n (the weights'
    pass, then each token's products), a drafting of 4 steps 4 (draft_step + per_token rows)."""
    shared = Shared()
    for batch_size in (1, sessions):
        for k in (4, 0):
            tokens, drafted = batch_size * (k + 1), batch_size * k
            verify = fixed + per_token * tokens
            draft = k * (draft_step + per_token * batch_size) if k else None
            for _ in range(30):
                shared.costs.observe("draft_model", k, draft, verify, (draft or 0.0) + verify + 1e-4,
                                     Batch(batch_size, tokens, drafted))  # fmt: skip
    return shared


@pytest.mark.parametrize(
    "per_token, drafts_under_load",
    [(0.4e-3, False), (0.005e-3, True)],  # a CPU's products grow with the rows; a GPU's hardly
)
def test_under_load_k_pays_for_the_rows_it_adds_to_a_shared_verify(per_token, drafts_under_load):
    """The same session, each draft kept about 0.5-0.8 of the time: alone it drafts; in a batch
    of 16 it drafts only where the verify's and the drafting's costs hardly grow with the
    rows (no table of batch sizes: the measured lines)."""
    shared = batched_costs(fixed=5e-3, per_token=per_token, draft_step=0.3e-3, sessions=16)
    chooser = KChooser(ADAPTIVE, shared)
    for accepted in [4, 2, 0, 3, 1] * 8:  # each position kept about 0.6 of the rounds it is reached
        chooser.acceptance.observe(4, accepted)
    assert chooser.next_round(100, sessions=1).k >= 2
    assert (chooser.next_round(100, sessions=16).k > 0) is drafts_under_load


def test_a_round_that_kept_every_draft_does_not_force_drafts_that_do_not_pay():
    """Under load a probe of one draft that is kept must not push the next round to two: the
    escalation after all were kept applies only where drafting pays at all."""
    shared = batched_costs(fixed=5e-3, per_token=0.4e-3, draft_step=0.3e-3, sessions=16)
    chooser = KChooser(ADAPTIVE, shared)
    for accepted in [4, 2, 0, 3, 1] * 8:
        chooser.acceptance.observe(4, accepted)
    assert chooser.next_round(100, sessions=16).k == 0
    chooser._probe_in, chooser._probe_due = 0, False  # the stretch is over: a probe of one draft
    chooser.observe(1, 1, None, 0.0, 0.0, batch=Batch(16, 17, 1, prefill=True))  # kept; no cost point
    assert chooser.next_round(100, sessions=16).k == 0
    chooser._probe_in = 0
    assert chooser.next_round(100, sessions=1).k >= 2  # alone, drafts pay: at least one more than kept


def test_a_batchs_costs_count_once_however_many_of_its_sessions_report_them():
    costs = RoundCosts()
    for session in range(16):  # the first reports a target-only round, the others drafted
        k = 0 if session == 0 else 2
        costs.observe("draft_model", k, 0.004 if k else None, 0.010, 0.020, Batch(16, 46, 30, started_ns=7))
    assert costs.verify.counts == {46: 1} and costs.rest.counts == {46: 1}
    assert costs.drafting["draft_model"].counts == {30: 1}
    costs.observe("draft_model", 2, 0.004, 0.011, 0.021, Batch(16, 46, 30, started_ns=8))
    assert costs.verify.counts[46] > 1


def test_a_new_session_tries_its_own_text_once_then_waits_as_its_methods_others_did():
    """Under load every session finding drafts not paying would probe every few tokens: after
    a first short stretch of its own, a session waits at least what the method's sessions
    reached."""
    shared = costs(draft_step=0.002, verify_one=0.002, per_token=0.0005)
    first = KChooser(ADAPTIVE, shared)
    for _ in range(20):
        first.observe(2, 0, 0.004, 0.003, 0.007)  # nothing kept
    assert first.next_k(100) == 0 and first.target_only_tokens == PROBE_STRETCH[0]
    first._probe_in = 0
    assert first.next_k(100) == 0 and first.target_only_tokens == 2 * PROBE_STRETCH[0]
    second = KChooser(ADAPTIVE, shared)
    assert second.next_k(100) == 0 and second.target_only_tokens == PROBE_STRETCH[0]  # its own text, early
    second._probe_in = 0
    assert second.next_k(100) == 0 and second.target_only_tokens == 4 * PROBE_STRETCH[0]  # the method's


@pytest.mark.parametrize("sessions, cheap_probes, first_stretch", [(16, False, 4), (1, False, 1), (16, True, 1)])
def test_in_a_batch_a_new_session_of_a_draft_model_waits_as_its_methods_others_did(
    sessions, cheap_probes, first_stretch
):
    """A draft model's first try reads the session's whole prompt, and in a batch every session
    waits for it: where the method's sessions found drafts not paying, a new one in a batch
    waits their stretch from its first (alone, or where a try is cheap: a short one of its own)."""
    shared = costs(draft_step=0.002, verify_one=0.002, per_token=0.0005)
    first = KChooser(ADAPTIVE, shared)
    for _ in range(20):
        first.observe(2, 0, 0.004, 0.003, 0.007)  # nothing kept
    for _ in range(2):  # two stretches: the method's reaches 4 x the shortest
        first.next_k(100)
        first._probe_in = 0
    assert shared.stretches[ADAPTIVE.method] == 4 * PROBE_STRETCH[0]
    new = KChooser(ADAPTIVE, shared, cheap_probes=cheap_probes)
    assert new.next_round(100, sessions=sessions).k == 0
    assert new.target_only_tokens == first_stretch * PROBE_STRETCH[0]


def test_a_batch_whose_draft_model_first_caught_up_gives_no_drafting_cost():
    """A draft model that first read a prompt or a target-only stretch for one of the batch's
    sessions made its drafting dearer than a round's: not a point of the drafting line (its
    verify and rest are)."""
    costs = RoundCosts()
    costs.observe("draft_model", 2, 0.050, 0.010, 0.070, Batch(16, 48, 32, started_ns=1, caught_up=True))
    assert "draft_model" not in costs.drafting and costs.verify.counts == {48: 1}
    costs.observe("draft_model", 2, 0.008, 0.010, 0.030, Batch(16, 48, 32, started_ns=2))
    assert costs.drafting["draft_model"].at(32) == pytest.approx(0.008)


@pytest.mark.parametrize("method, drafted_rounds, last_k, catches_up", [
    ("draft_model", 0, 0, True),  # its first drafts read the prompt
    ("draft_model", 3, 0, True),  # after a target-only round, what it made
    ("draft_model", 3, 2, False),
    ("ngram", 0, 0, False),  # drafts from the context: nothing to read first
])  # fmt: skip
def test_a_session_catches_up_where_its_draft_model_has_more_to_read_than_a_round(
    method, drafted_rounds, last_k, catches_up
):
    from verify_service.local_drafts import SessionDrafts

    speculation = Speculation(method, 2, adaptive=True)
    drafts = SessionDrafts(speculation, None, KChooser(speculation), drafted_rounds=drafted_rounds, last_k=last_k)
    assert drafts.catches_up is catches_up


def test_sizes_unmeasured_for_hours_still_give_their_costs():
    """A server that ran single sessions (sizes 1-9), then only batches (40) for hours: the
    small sizes' weights fade, but a single session's costs are still read from them, not 0."""
    line = RoundCosts().verify
    for size in range(1, 10):
        line.add(size, size * 1e-3)
    for _ in range(40_000):
        line.add(40, 5e-3)
    assert line.at(3) == pytest.approx(3e-3)
    assert line.at(40) == pytest.approx(5e-3)
