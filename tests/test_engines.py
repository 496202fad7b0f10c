"""The engines in-process: slot admission, and batching that changes no result."""

from __future__ import annotations

import threading

import pytest
import torch

from draft_service.config import DraftConfig
from specserve.drafting import Drafter, DraftJob, DraftOptions
from specserve.errors import FailedPrecondition, ResourceExhausted
from specserve.model.loading import load_model
from specserve.sampling import SamplingParams
from specserve.serving.batching import Again
from verify_service.config import VerifyConfig
from verify_service.decisions import stop_at_end_of_sequence
from verify_service.engine import Verifier
from verify_service.jobs import DecodeJob, PrefillJob, ReleaseJob, VerifyJob

CPU = torch.device("cpu")
GREEDY = SamplingParams(temperature=0)


def test_full_verifier_refuses_new_sessions_until_one_is_released(tiny_pair):
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32, num_slots=2), VerifyConfig(max_sessions=2))
    assert all(not isinstance(r, Exception) for r in verifier.step([PrefillJob(s, (1, 2), GREEDY) for s in "ab"]))
    [refused] = verifier.step([PrefillJob("c", (1, 2), GREEDY)])
    assert isinstance(refused, ResourceExhausted)
    assert not isinstance(verifier.step([PrefillJob("a", (3, 4), GREEDY)])[0], Exception)  # a restart reuses its slot
    verifier.step([ReleaseJob("b")])
    assert not isinstance(verifier.step([PrefillJob("c", (1, 2), GREEDY)])[0], Exception)


def test_a_release_in_the_same_batch_as_a_call_of_its_session_frees_no_slot_under_it(tiny_pair):
    # The call must not run on the slot the release frees (which another session may own next).
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32, num_slots=2), VerifyConfig(max_sessions=2))
    verifier.step([PrefillJob("gone", (4, 5), GREEDY)])
    verifier.step([PrefillJob("keep", (1, 2, 3), GREEDY)])  # the last slot, where slot -1 points
    before = verifier.step([VerifyJob("keep", 4, (), (), None)])[0].next_token_id
    verifier.step([PrefillJob("keep", (1, 2, 3), GREEDY)])  # the same session again, from scratch
    decode = DecodeJob("gone", 3, 5, None, lambda outcome: None, threading.Event(), verifier.sessions["gone"])
    results = verifier.step([VerifyJob("gone", 3, (), (), None), ReleaseJob("gone"), decode])
    # Both are told the session is gone (the decode's caller, still there, prefills again).
    assert isinstance(results[0], FailedPrecondition) and isinstance(results[2], FailedPrecondition)
    assert verifier.step([VerifyJob("keep", 4, (), (), None)])[0].next_token_id == before
    assert verifier.backend.in_use == 1


def test_a_prefill_of_a_decoding_session_wins_and_the_decode_stops(tiny_pair):
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32), VerifyConfig())
    verifier.step([PrefillJob("s", (9, 8, 7), GREEDY)])
    made, ended = [], threading.Event()
    [again] = verifier.step([DecodeJob("s", 4, 10, None, made.append, ended)])
    assert isinstance(again, Again) and len(made) == 1
    # A gateway that gave up on the stream (its cancel not seen yet) prefills again: same batch.
    decode_result, prefill_result = verifier.step([again.item, PrefillJob("s", (9, 8, 7), GREEDY)])
    assert isinstance(decode_result, FailedPrecondition) and prefill_result.num_verified == 4
    # Or in a later batch: the decode still holds the session object the prefill replaced.
    verifier.step([PrefillJob("s", (9, 8, 7), GREEDY)])
    assert isinstance(verifier.step([again.item])[0], FailedPrecondition)
    # A decode whose call ended before its first token makes nothing and claims nothing.
    ended.set()
    nothing, prefill_result = verifier.step(
        [DecodeJob("s", 4, 10, None, made.append, ended), PrefillJob("s", (1,), GREEDY)]
    )
    assert nothing is None and prefill_result.num_verified == 2 and len(made) == 1


def test_a_decode_makes_a_token_per_batch_until_done_or_its_caller_has_gone(tiny_pair):
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32), VerifyConfig())
    for session in ("by-decode", "by-verify"):
        verifier.step([PrefillJob(session, (9, 8, 7), GREEDY)])
    made, ended = [], threading.Event()
    job = DecodeJob("by-decode", 4, 3, None, made.append, ended)
    while isinstance(result := verifier.step([job])[0], Again):
        job = result.item
    assert [o.num_verified for o in made] == [5, 6, 7] and result is made[-1]
    expected = [verifier.step([VerifyJob("by-verify", n, (), (), None)])[0].next_token_id for n in (4, 5, 6)]
    assert [o.next_token_id for o in made] == expected
    ended.set()  # the caller went away: the next step makes nothing
    [result] = verifier.step([DecodeJob("by-decode", 7, 3, None, made.append, ended, verifier.sessions["by-decode"])])
    assert result is None and len(made) == 3


def _verify_alone_and_together(verifier: Verifier, sampling: SamplingParams):
    prompts = {"x": (5, 6, 7, 8), "y": (40, 41), "z": (99,) * 9}
    drafts = {"x": (1, 2, 3), "y": (7,), "z": (8, 8, 8, 8, 8)}
    for session, prompt in prompts.items():
        verifier.step([PrefillJob(session, prompt, sampling)])
    alone = {s: verifier.step([VerifyJob(s, len(p) + 1, drafts[s], (), None)])[0] for s, p in prompts.items()}
    for session, prompt in prompts.items():  # the same sessions again, from scratch
        verifier.step([PrefillJob(session, prompt, sampling)])
    together = verifier.step([VerifyJob(s, len(p) + 1, drafts[s], (), None) for s, p in prompts.items()])
    return alone, dict(zip(prompts, together))


def test_batched_verification_equals_each_row_alone(tiny_pair):
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32), VerifyConfig())
    alone, together = _verify_alone_and_together(verifier, GREEDY)
    for session in alone:
        assert (alone[session].num_accepted, alone[session].next_token_id) == (
            together[session].num_accepted,
            together[session].next_token_id,
        )
    assert together["x"].batch_size == 3 and alone["x"].batch_size == 1


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, seed=5)])
def test_batched_drafting_equals_each_session_alone(tiny_pair, sampling):
    _, draft_dir = tiny_pair
    loaded = load_model(str(draft_dir), CPU, torch.float32)
    drafter = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(), loaded))
    prefixes = [(1, 2, 3), (9,) * 12, (200, 100)]
    ks = [4, 2, 3]

    def propose(indices):
        sessions = {i: drafter.open_session(str(i), "draft_model") for i in indices}
        jobs = [DraftJob(sessions[i], prefixes[i], len(prefixes[i]), ks[i], sampling) for i in indices]
        first = drafter.step(jobs)
        # A second round: the first proposal's first draft was accepted, then a new token.
        follow = [DraftJob(sessions[i], (p.draft_token_ids[0], 77), len(prefixes[i]) + 2, ks[i], sampling)
                  for i, p in zip(indices, first)]  # fmt: skip
        second = drafter.step(follow)
        for session in sessions.values():
            drafter.close_session(session)
        return list(first + second)

    alone = [propose([i]) for i in range(3)]
    together = propose([0, 1, 2])
    expected = [alone[0][0], alone[1][0], alone[2][0], alone[0][1], alone[1][1], alone[2][1]]
    for got, want in zip(together, expected):
        assert got.draft_token_ids == want.draft_token_ids
        for q_got, q_want in zip(got.draft_distributions, want.draft_distributions, strict=True):
            # Same support; probabilities equal up to float rounding (a batched matmul may
            # sum in another order), which moves a draw only at a measure-zero boundary.
            assert q_got.token_ids == q_want.token_ids
            assert torch.allclose(torch.tensor(q_got.probs), torch.tensor(q_want.probs), atol=1e-5)


def test_ngram_drafts_copy_after_the_latest_longest_repeat():
    from specserve.methods.ngram import ngram_drafts

    tokens = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 1, 2, 3]
    assert ngram_drafts(tokens, 2, max_n=3) == [7, 8]  # the latest [1, 2, 3] was followed by 7, 8
    assert ngram_drafts(tokens, 5, max_n=3) == [7, 8, 1, 2, 3]
    assert ngram_drafts([4, 5, 6], 3, max_n=3) == []  # nothing repeats
    assert ngram_drafts([5, 5], 3, max_n=3) == [5]
    assert ngram_drafts(tokens, 2, max_n=3, min_n=3) == [7, 8]
    assert ngram_drafts([1, 2, 9, 2], 2, max_n=3, min_n=2) == []  # only [2] repeats


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=0.9, seed=5)])
def test_a_models_drafts_start_with_a_copy_where_the_context_repeats(tiny_pair, sampling):
    """The copy comes first, one-hot when sampled; the model's drafts after it are the ones a
    session holding the copy as verified tokens would make; a later round on the same
    session drafts what a fresh one would."""
    _, draft_dir = tiny_pair
    loaded = load_model(str(draft_dir), CPU, torch.float32)
    copying = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(), loaded))
    plain = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(copy_min_ngram=0), loaded))

    def draft(drafter, tokens, k, start=0, session=None):
        session = session or drafter.open_session(str(tokens), "draft_model")
        job = DraftJob(session, tuple(tokens[start:]), len(tokens), k, sampling, want_bonus_guess=True)
        return drafter.step([job])[0], session

    prefix = [5, 6, 7, 8, 30, 5, 6]  # [5, 6] repeats: 7, 8, 30, 5, 6 followed it
    got, session = draft(copying, prefix, 7)
    copy = [7, 8, 30, 5, 6]
    assert list(got.draft_token_ids[:5]) == copy
    rest, _ = draft(plain, prefix + copy, 2)
    assert got.draft_token_ids[5:] == rest.draft_token_ids and got.bonus_guess == rest.bonus_guess
    if not sampling.is_greedy:
        assert all(q.token_ids == (t,) and q.probs == (1.0,) for q, t in zip(got.draft_distributions, copy))
        for q_got, q_want in zip(got.draft_distributions[5:], rest.draft_distributions, strict=True):
            assert q_got.token_ids == q_want.token_ids
    # Two copied drafts kept, then a token of the target's: the cache drops the rest of the copy.
    verified = prefix + copy[:2] + [99]
    again, _ = draft(copying, verified, 4, start=len(prefix), session=session)
    fresh, _ = draft(copying, verified, 4)
    assert again.draft_token_ids == fresh.draft_token_ids and again.bonus_guess == fresh.bonus_guess
    # No suffix of two or more tokens repeats: the model drafts it all, as without the copy.
    alone, _ = draft(copying, [1, 2, 3, 1], 3)
    assert alone.draft_token_ids == draft(plain, [1, 2, 3, 1], 3)[0].draft_token_ids


def test_copies_stop_where_the_models_drafts_hold_the_target_better_and_come_back_when_they_do_not():
    from specserve.methods.ngram import CopyScore

    score = CopyScore()
    assert score.prefers_copy()  # no evidence yet: copies first
    for position in range(0, 40, 4):  # the copy offered 7, 8; the target wrote 1, 2 as the model drafted
        score.proposed(position, [7, 8, 5], [7, 8], copied=2)
        score.judge([1, 2, 5, 6] * 11)
        if not score.prefers_copy():
            break
    assert not score.prefers_copy()
    for position in range(4, 200, 4):  # drafting from the model: its drafts wrong, the copy (judged unused) right
        score.proposed(position, [9, 9], [1, 2], copied=0)
        score.judge([1, 2, 5, 6] * 51)
        if score.prefers_copy():
            break
    assert score.prefers_copy()


def test_a_session_whose_copies_are_rejected_drafts_from_the_model(tiny_pair):
    _, draft_dir = tiny_pair
    loaded = load_model(str(draft_dir), CPU, torch.float32)
    drafter = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(), loaded))
    plain = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(copy_min_ngram=0), loaded))
    session = drafter.open_session("s", "draft_model")
    verified = [5, 6, 7, 8, 30, 5, 6]  # offers the copy 7, 8, ...

    def propose(drafter, session):
        job = DraftJob(session, tuple(verified[len(session.verified) :]), len(verified), 3, GREEDY)
        return drafter.step([job])[0].draft_token_ids

    assert propose(drafter, session)[:2] == (7, 8)
    for _ in range(12):  # the target never writes the copy's first token, then [5, 6] again
        verified += [100 + len(verified) % 50, 5, 6]
        propose(drafter, session)
    assert not session.copy_score.prefers_copy()
    assert propose(drafter, session) == propose(plain, plain.open_session("p", "draft_model"))


def test_confidence_stop_and_bonus_guess(tiny_pair):
    _, draft_dir = tiny_pair
    loaded = load_model(str(draft_dir), CPU, torch.float32)
    drafter = Drafter({"draft_model": loaded}, DraftOptions.of(DraftConfig(), loaded))
    session = drafter.open_session("s", "draft_model")
    sure = drafter.step([DraftJob(session, (1, 2, 3), 3, 4, GREEDY, want_bonus_guess=True)])[0]
    assert len(sure.draft_token_ids) == 4 and sure.bonus_guess >= 0
    other = drafter.open_session("t", "draft_model")
    shy = drafter.step([DraftJob(other, (1, 2, 3), 3, 4, GREEDY, min_draft_probability=1.0, want_bonus_guess=True)])[0]
    assert shy.draft_token_ids == () and shy.bonus_guess == -1  # never sure enough: no drafts
    # Rewinding: a request that starts before the session's end drops what lay past it.
    again = drafter.step([DraftJob(session, (1, 2, 3), 3, 4, GREEDY)])[0]
    assert again.draft_token_ids == sure.draft_token_ids


def _colocated_verifier(tiny_pair) -> Verifier:
    from specserve.drafting import DraftOptions
    from verify_service.local_drafts import LocalDrafting

    target_dir, draft_dir = tiny_pair
    target = load_model(str(target_dir), CPU, torch.float32)
    draft = load_model(str(draft_dir), CPU, torch.float32, row_invariant=False)
    drafter = Drafter({"draft_model": draft}, DraftOptions.of(VerifyConfig(), target))
    return Verifier(target, VerifyConfig(), None, LocalDrafting(drafter, 16))


def _decode(verifier: Verifier, session: str, prompt: tuple[int, ...], max_tokens: int, speculation=None) -> list:
    """Every Outcome of a decode after the prefill, run batch by batch to its end."""
    first = verifier.step([PrefillJob(session, prompt, GREEDY)])[0]
    made = []
    job = DecodeJob(session, len(prompt) + 1, max_tokens, None, made.append, threading.Event(),
                    speculation=speculation)  # fmt: skip
    while isinstance(result := verifier.step([job])[0], Again):
        job = result.item
    assert not isinstance(result, Exception), result
    return [first.next_token_id], made


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_the_verifiers_own_rounds_make_the_target_only_tokens_and_stop_at_max_tokens(tiny_pair, method):
    from specserve.speculation import Speculation

    verifier = _colocated_verifier(tiny_pair)
    prompt = (104, 105, 104, 105, 104, 105, 32, 7)
    first, plain = _decode(verifier, "plain", prompt, 37)
    _, rounds = _decode(verifier, "spec", prompt, 37, Speculation(method, 5, adaptive=False))
    tokens = [t for o in rounds for t in (*o.accepted_token_ids, o.next_token_id)]
    assert tokens == [o.next_token_id for o in plain] and len(tokens) == 37  # never past max_tokens
    assert any(o.num_draft_tokens for o in rounds)  # the prompt repeats: even n-gram lookup drafts
    if method == "draft_model":
        assert len(rounds) < len(plain)  # drafts were kept
    assert all(o.num_draft_tokens <= 5 and o.num_accepted <= o.num_draft_tokens for o in rounds)
    assert all(o.draft_ended_ns >= o.draft_started_ns > 0 for o in rounds if o.num_draft_tokens)


def test_every_row_of_a_batch_is_told_its_drafting_the_drafted_rows_their_own(tiny_pair):
    """A row that drafted nothing waited for the batch's drafting too: the K choice takes it
    out of the rest of that row's round (specserve/adaptive.py, Batch.draft_s)."""
    from specserve.speculation import Speculation

    verifier = _colocated_verifier(tiny_pair)
    prompt = (3, 4, 5, 6)
    for session in ("spec", "plain"):
        verifier.step([PrefillJob(session, prompt, GREEDY)])
    made = []
    jobs = [
        DecodeJob("spec", len(prompt) + 1, 4, None, made.append, threading.Event(),
                  speculation=Speculation("draft_model", 3, adaptive=False)),
        DecodeJob("plain", len(prompt) + 1, 4, None, made.append, threading.Event()),
    ]  # fmt: skip
    verifier.step(jobs)
    drafted, plain = made
    assert drafted.num_draft_tokens == 3 and plain.num_draft_tokens == 0
    assert drafted.batch_draft_ns == plain.batch_draft_ns == drafted.draft_ended_ns - drafted.draft_started_ns > 0
    assert plain.draft_started_ns == 0  # its own: it drafted nothing


def test_a_round_ends_at_an_accepted_end_of_sequence_draft(tiny_pair):
    verifier = _colocated_verifier(tiny_pair)
    eos = verifier.loaded.eos_token_ids[0]
    eos_ids = verifier.loaded.eos_token_ids
    assert stop_at_end_of_sequence((5, eos, 6), 3, 9, eos_ids) == (1, eos)  # kept d_1, then EOS ends it
    assert stop_at_end_of_sequence((5, eos, 6), 1, 9, eos_ids) == (1, 9)  # EOS was not kept: as decided
    assert stop_at_end_of_sequence((), 0, eos, eos_ids) == (0, eos)


def test_a_token_past_the_drafts_own_vocabulary_is_refused_not_an_index_error(tiny_pair):
    from specserve.drafting import DraftOptions
    from specserve.errors import InvalidArgument

    _, draft_dir = tiny_pair
    loaded = load_model(str(draft_dir), CPU, torch.float32)  # 257 ids
    options = DraftOptions(vocab_size=300, max_context_length=512, max_sessions=4)  # a target padded further
    drafter = Drafter({"draft_model": loaded}, options)
    session = drafter.open_session("s", "draft_model")
    [refused] = drafter.step([DraftJob(session, (1, 280), 2, 3, GREEDY)])
    assert isinstance(refused, InvalidArgument)


def test_a_drafting_failure_costs_its_rounds_their_drafts_not_the_batch(tiny_pair, monkeypatch):
    from specserve.speculation import Speculation

    verifier = _colocated_verifier(tiny_pair)
    prompt = (3, 4, 5, 6)
    _, plain = _decode(verifier, "plain", prompt, 12)

    def broken(jobs):
        raise RuntimeError("a draft forward that failed")

    monkeypatch.setattr(verifier.local.drafter, "step", broken)
    _, rounds = _decode(verifier, "spec", prompt, 12, Speculation("draft_model", 4, adaptive=False))
    assert [o.next_token_id for o in rounds] == [o.next_token_id for o in plain]  # target-only rounds, all there
    assert all(o.num_draft_tokens == 0 for o in rounds)


def test_a_prefill_beside_its_sessions_release_makes_no_session(tiny_pair):
    """A client that left mid-prefill: the gateway's release may reach the batch its prefill
    is in (releases run first), which must not leave a session held until the TTL."""
    target_dir, _ = tiny_pair
    verifier = Verifier(load_model(str(target_dir), CPU, torch.float32, num_slots=2), VerifyConfig(max_sessions=2))
    results = verifier.step([PrefillJob("left", (4, 5), GREEDY), ReleaseJob("left")])
    assert isinstance(results[0], FailedPrecondition) and "left" not in verifier.sessions
    assert verifier.backend.in_use == 0


def test_a_prefill_may_copy_another_sessions_cache_of_its_prompt(tiny_pair, monkeypatch):
    """n choices share one prefill: a session prefilled with copy_of another that holds the same
    prompt feeds only its last token, and decodes what a full prefill would; where the other
    holds another prompt, it prefills in full."""
    verifier = _colocated_verifier(tiny_pair)
    copies = []
    original = verifier.backend.copy_prefix
    monkeypatch.setattr(verifier.backend, "copy_prefix", lambda *args: copies.append(args[2]) or original(*args))
    prompt = (3, 9, 27, 81, 243, 4, 12)
    _, alone = _decode(verifier, "first", prompt, 9)
    made = []
    verifier.step([PrefillJob("second", prompt, GREEDY, copy_of="first")])
    job = DecodeJob("second", len(prompt) + 1, 9, None, made.append, threading.Event())
    first = verifier.step([PrefillJob("third", prompt, GREEDY, copy_of="first")])[0]
    while isinstance(result := verifier.step([job])[0], Again):
        job = result.item
    assert copies == [len(prompt) - 1, len(prompt) - 1]
    assert first.next_token_id == verifier.sessions["first"].tokens[len(prompt)]
    assert [o.next_token_id for o in made] == [o.next_token_id for o in alone]
    verifier.step([PrefillJob("other", (5, 6, 7), GREEDY, copy_of="first")])  # not its prompt: in full
    assert copies == [len(prompt) - 1, len(prompt) - 1]


def test_a_prefill_refused_for_its_settings_holds_no_slot(tiny_pair):
    verifier = _colocated_verifier(tiny_pair)
    used = verifier.backend.in_use
    [refused] = verifier.step([PrefillJob("bad", (1, 2, 3), GREEDY, prompt_logprobs=21)])
    assert "prompt_top_logprobs" in str(refused) and verifier.backend.in_use == used and "bad" not in verifier.sessions
