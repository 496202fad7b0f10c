"""Under load, the adaptive sessions of a batch that draft alike draft one K, and stop and try
drafts again together (specserve/batch_choice.py)."""

from __future__ import annotations

from types import SimpleNamespace

from specserve.adaptive import PROBE_STRETCH, Batch, KChooser, Shared
from specserve.batch_choice import DEAR_STRETCH, PARTIAL_AFTER, TRY_READ, BatchChoice
from specserve.speculation import Speculation
from verify_service.local_drafts import LocalDrafting, SessionDrafts

ADAPTIVE = Speculation("draft_model", 4, adaptive=True, k_bounds=(0, 8))


def measured(draft_step: float, sessions: int = 4) -> Shared:
    """Costs as if measured in batches of `sessions`: drafting a step for them all, a verify
    of 2 ms and 0.1 ms a token, 1 ms of rest."""
    shared = Shared()
    for i, k in enumerate(list(range(5)) * 30):
        tokens = sessions * (k + 1)
        verify = 2e-3 + 0.1e-3 * tokens
        draft = draft_step * k or None
        batch = Batch(sessions, tokens, sessions * k, started_ns=i + 1)
        shared.costs.observe("draft_model", k, draft, verify, (draft or 0.0) + verify + 1e-3, batch)
    return shared


def chooser(shared: Shared, kept: list[int], speculation: Speculation = ADAPTIVE) -> KChooser:
    """A draft model session's chooser whose rounds of 4 drafts kept these many."""
    made = KChooser(speculation, shared, cheap_probes=False)
    for accepted in kept:
        made.acceptance.observe(4, accepted)
    return made


def test_sessions_that_would_choose_apart_draft_one_k_from_their_mean_acceptance():
    shared = measured(draft_step=0.5e-3)
    sure, unsure = chooser(shared, [4] * 20), chooser(shared, [0] * 20)
    assert sure.next_round(100, sessions=4).k > 0 and unsure.next_round(100, sessions=4).k == 0  # apart
    ks = BatchChoice().choose([sure, unsure], [100, 100], sessions=4)
    assert ks[0] == ks[1] > 0
    assert BatchChoice().choose([sure, unsure], [100, 2], sessions=4) == [ks[0], 1]  # cut to what it may make


def test_they_stop_together_and_try_again_after_a_stretch_that_doubles():
    shared = measured(draft_step=3e-3)  # drafts dear: none pay
    group = [chooser(shared, [1, 0] * 10), chooser(shared, [0, 1] * 10)]
    batches = BatchChoice()
    assert batches.choose(group, [100, 100], sessions=4) == [0, 0]
    for _ in range(PROBE_STRETCH[0]):
        assert batches.choose(group, [100, 100], sessions=4) == [0, 0]  # target-only batches
    for _ in range(2):  # the stretch is over: a try of drafts, to measure again (a draft model's: two batches)
        tried = batches.choose(group, [100, 100], sessions=4)
        assert tried[0] == tried[1] >= 1
    assert batches.choose(group, [100, 100], sessions=4) == [0, 0]
    assert batches.groups["draft_model"].probe_in == 2 * PROBE_STRETCH[0]  # doubled


def test_a_batch_groups_adaptive_chains_by_method_and_kind_and_leaves_the_rest_alone():
    shared = measured(draft_step=0.5e-3)
    local = LocalDrafting(SimpleNamespace(options=SimpleNamespace(vocab_size=100), models={}), 8)
    local.shared = shared

    def drafts(speculation: Speculation, kept: list[int], sampled: bool = False) -> SessionDrafts:
        made = KChooser(speculation, shared, sampled=sampled)
        for accepted in kept:
            made.acceptance.observe(4, accepted)
        return SessionDrafts(speculation, None, made)

    sure, unsure = drafts(ADAPTIVE, [4] * 20), drafts(ADAPTIVE, [0] * 20)
    fixed = drafts(Speculation("draft_model", 3, adaptive=False), [])
    sampled = drafts(ADAPTIVE, [0] * 20, sampled=True)  # its costs are not measured: it starts at its K
    choices = local.next_rounds([(sure, 100), (unsure, 100), (fixed, 100), (sampled, 100)], sessions=4)
    assert choices[0].k == choices[1].k > 0
    assert choices[2].k == 3 and choices[3].k == 4
    alone = local.next_rounds([(unsure, 100)], sessions=1)  # alone: its own choice
    assert alone[0].k == 0


def test_a_draft_models_batch_tries_drafts_less_often_than_a_cheap_method():
    """A draft model's try of drafts first reads what every session made since its last
    drafting: its stretch doubles further."""
    shared = measured(draft_step=3e-3)
    longest = {}
    for cheap in (True, False):
        group = [KChooser(ADAPTIVE, shared, cheap_probes=cheap) for _ in range(2)]
        batches = BatchChoice()
        for _ in range(2000):
            batches.choose(group, [100, 100], sessions=4)
        longest[cheap] = batches.groups["draft_model"].stretch
    assert longest == {True: PROBE_STRETCH[1], False: DEAR_STRETCH}


def test_after_a_long_stretch_a_dear_try_drafts_for_the_sessions_with_the_least_to_read():
    """A draft model's try first reads every drafting session's tokens since its last
    drafting: after PARTIAL_AFTER target-only batches or more it drafts only for the sessions
    with the fewest, up to TRY_READ tokens (at least one); before, for every session."""
    shared = measured(draft_step=3e-3)  # drafts dear: none pay
    group = [chooser(shared, [1, 0] * 10) for _ in range(4)]
    batches = BatchChoice()
    unread = [300, TRY_READ // 2, 5, TRY_READ // 2]
    tries = []
    for _ in range(1000):
        ks = batches.choose(group, [100] * 4, sessions=4, unread=unread)
        if any(ks):
            tries.append((batches.groups["draft_model"].stopped, ks))
    short = [ks for stopped, ks in tries if stopped < PARTIAL_AFTER]
    long = [ks for stopped, ks in tries if stopped >= PARTIAL_AFTER]
    assert short and long
    assert all(all(k >= 1 for k in ks) for ks in short)
    for ks in long:  # 5 + 128 tokens read, not 5 + 128 + 128
        assert ks[2] >= 1 and ks[1] + ks[3] == ks[2] and ks[0] == 0
    cheap = [KChooser(ADAPTIVE, shared, cheap_probes=True) for _ in range(4)]
    batches = BatchChoice()
    for _ in range(1000):
        ks = batches.choose(cheap, [100] * 4, sessions=4, unread=unread)
        assert ks == [0] * 4 or all(k >= 1 for k in ks)  # a cheap try: every session


def test_a_sessions_unread_tokens_are_those_its_draft_model_has_not_read():
    session = SessionDrafts(ADAPTIVE, SimpleNamespace(verified=[1, 2, 3]), KChooser(ADAPTIVE))
    assert session.unread(10) == 7
    assert SessionDrafts(ADAPTIVE, None, KChooser(ADAPTIVE)).unread(10) == 0


def test_each_batch_whose_drafts_pay_halves_the_next_stretch():
    """One lucky try does not restart the stretch at its shortest: that led to a run of
    tries, each reading every session's tokens again."""
    shared = measured(draft_step=0.5e-3)
    group = [chooser(shared, [4] * 20) for _ in range(2)]  # drafts pay
    batches = BatchChoice()
    batches.choose(group, [100, 100], sessions=4)
    batches.groups["draft_model"].stretch = DEAR_STRETCH  # as after tries that did not pay
    for stretch in (DEAR_STRETCH // 2, DEAR_STRETCH // 4):
        assert all(k > 0 for k in batches.choose(group, [100, 100], sessions=4))
        assert batches.groups["draft_model"].stretch == stretch
    for _ in range(10):
        batches.choose(group, [100, 100], sessions=4)
    assert batches.groups["draft_model"].stretch == PROBE_STRETCH[0]
