"""Method lookahead: its window as a token tree, the n-grams it collects, its pool's bound, its
settings' checks, and its output through the stack (greedy equal to target-only, sampled
exact, every round one forward in the verifier)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from specserve.errors import InvalidArgument
from specserve.methods.lookahead import MAX_POOL, LookaheadSession, LookaheadShape
from specserve.methods.trees import depths


def test_the_window_is_a_tree_whose_node_l_c_sees_level_0_to_column_c_and_its_column_below():
    session = LookaheadSession(LookaheadShape(window=3, ngram=3, guesses=2))
    session.levels = [[10, 11, 12], [20, 21, 22]]
    drafts, q, parents, window = session.propose([5, 6, 7], depth=2, greedy=True, room=100)
    assert window == 6 and q == ()
    assert drafts == (10, 20, 11, 21, 12, 22)  # no candidates yet: the window alone, column by column
    assert parents == (0, 1, 1, 3, 3, 5)  # (0, c) follows (0, c - 1); (1, c) is (0, c)'s child
    node_depths = depths((-1, *parents))[1:]
    assert node_depths == [1, 2, 2, 3, 3, 4]  # (l, c) at offset c + l + 1
    # The target's argmax at each node; the top level's guesses close the columns' n-grams.
    session.learn([0, 30, 0, 31, 0, 32])
    assert session.levels == [[20, 21, 22], [30, 31, 32]]  # one Jacobi step: level 0 dropped
    assert list(session.pool) == [(10, 20, 30), (11, 21, 31), (12, 22, 32)]
    # The next round after token 11 verifies the copy of the context first, then the pool's n-gram.
    drafts, _, parents, window = session.propose([11, 4, 11], depth=2, greedy=True, room=100)
    assert drafts[:4] == (4, 11, 21, 31) and parents[:4] == (0, 1, 0, 3)
    assert window == 6 and len(drafts) == 10


def test_the_window_grows_to_n_minus_1_levels_before_it_collects_and_fits_the_context():
    session = LookaheadSession(LookaheadShape(window=2, ngram=4, guesses=1))
    _, _, parents, window = session.propose([1, 2, 3], depth=3, greedy=True, room=100)
    assert window == 2 and parents == (0, 1)  # level 0 only, drawn from the context
    assert set(session.levels[0]) <= {1, 2, 3}
    session.learn([7, 8])
    assert session.levels[1] == [7, 8] and not session.pool
    assert session.propose([1, 2, 3], depth=3, greedy=True, room=100)[3] == 4
    session.learn([0, 5, 0, 6])
    assert len(session.levels) == 3 and not session.pool  # N - 1 levels: the next step collects
    assert session.propose([1, 2, 3], depth=3, greedy=True, room=3)[3] == 0  # offsets up to 4: no room
    session.learn(None)
    assert len(session.levels) == 3


def test_uncopied_rounds_feed_the_window_and_copied_ones_verify_the_copy_alone_as_a_chain():
    session = LookaheadSession(LookaheadShape(window=2, ngram=3, guesses=2), every_round=False)
    session.levels = [[10, 11], [20, 21]]
    session._add((7, 8, 9))
    drafts, _, parents, window = session.propose([7, 5, 7], depth=2, greedy=True, room=100)
    assert (drafts, parents, window) == ((5, 7), (), 0)  # the copy, a chain: no window, no pool
    session.learn(None)
    assert session.levels == [[10, 11], [20, 21]]  # unchanged
    drafts, _, parents, window = session.propose([1, 2, 7], depth=2, greedy=True, room=100)
    assert drafts == (8, 9, 10, 20, 11, 21) and parents == (0, 1, 0, 3, 3, 5) and window == 4


def test_a_sampled_round_verifies_one_candidate_with_one_hot_q_and_the_pool_is_bounded():
    session = LookaheadSession(LookaheadShape(window=1, ngram=2, guesses=3))
    for token in range(MAX_POOL + 10):
        session._add((token % 50, token))
    assert len(session.pool) == MAX_POOL
    assert sum(len(rest) for rest in session.following.values()) == MAX_POOL
    newest = MAX_POOL + 9
    assert (0, 0) not in session.pool and (newest % 50, newest) in session.pool  # the oldest went first
    drafts, q, parents, window = session.propose([newest % 50], depth=1, greedy=False, room=10)
    assert drafts[0] == newest and [d.token_ids for d in q] == [(newest,)] and q[0].probs == (1.0,)
    assert len(drafts) == 1 + window  # one candidate, then the window


def test_settings_out_of_range_are_refused():
    with pytest.raises(InvalidArgument, match="ngram must lie in 2"):
        LookaheadShape(ngram=1)
    with pytest.raises(InvalidArgument, match="nodes passes the most"):
        LookaheadShape().with_settings((16, 8, 8))
    assert LookaheadShape(4, 4, 3).with_settings((0, 3, 0)) == LookaheadShape(4, 3, 3)


def _complete(url: str, prompt, speculation: dict, **body) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=120, json={
        "prompt": list(prompt), "max_tokens": 32, "temperature": 0, "return_token_ids": True,
        "speculation": speculation, **body})  # fmt: skip


def test_greedy_lookahead_output_equals_target_only(stack):
    """Several shapes at once, sharing batches; then one at a time, keeping drafts."""
    from tests.test_e2e import PROMPTS

    shapes = ({}, {"window": 2, "ngram": 2, "guesses": 1}, {"window": 5, "ngram": 3, "guesses": 4})
    jobs = [(prompt, shape) for prompt in PROMPTS for shape in shapes]

    def run(job):
        prompt, shape = job
        reply = _complete(stack.url, prompt, {"method": "lookahead", "lookahead": shape})
        assert reply.status_code == 200, reply.text
        return reply.json()

    with ThreadPoolExecutor(len(jobs)) as pool:
        results = dict(zip(range(len(jobs)), pool.map(run, jobs)))
    for i, (prompt, _) in enumerate(jobs):
        reference = _complete(stack.url, prompt, {"method": "none"}).json()["choices"][0]["token_ids"]
        assert results[i]["choices"][0]["token_ids"] == reference, jobs[i]
    # One at a time (a crowded gateway decodes target-only), every round lookahead's (not
    # adaptive: no target-only stretches where it does not pay, see specserve/pacing.py):
    # drafts are kept, and counted are the candidates only, never the window's nodes.
    alone = [
        _complete(
            stack.url, prompt, {"method": "lookahead", "lookahead": {"ngram": 3, "guesses": 2}, "adaptive": False}
        ).json()["usage"]["speculation"]
        for prompt in PROMPTS
    ]
    assert sum(u["num_accepted_tokens"] for u in alone) >= 20, alone
    assert all(u["num_draft_tokens"] <= 4 * u["num_drafts"] for u in alone), alone


def test_bad_lookahead_settings_are_a_400_naming_the_field(stack):
    for speculation, words in (
        ({"method": "lookahead", "lookahead": {"ngram": 1}}, "ngram must lie in 2"),
        ({"method": "lookahead", "lookahead": {"window": 0}}, ">= 1"),
        ({"method": "lookahead", "lookahead": {"window": 16, "ngram": 8, "guesses": 8}}, "nodes"),
        ({"method": "ngram", "lookahead": {"window": 3}}, "needs method lookahead"),
        ({"method": "lookahead", "lookahead": {"depth": 3}}, "depth"),
    ):
        reply = _complete(stack.url, [1, 2, 3], speculation)
        assert reply.status_code == 400, (speculation, reply.text)
        assert words in reply.text, (speculation, reply.text)


@pytest.mark.parametrize("every_round", [True, False])
def test_the_verifiers_lookahead_rounds_make_the_target_only_tokens_batched_or_alone(tiny_pair, every_round):
    """In the verifier itself, three sessions decoding together and then alone: the target-only
    tokens, with the window fed every round (a GPU's policy) or only in uncopied rounds."""
    import threading

    import torch

    from specserve.drafting import Drafter, DraftOptions
    from specserve.model.loading import load_model
    from specserve.sampling import SamplingParams
    from specserve.serving.batching import Again
    from specserve.speculation import Speculation
    from verify_service.config import VerifyConfig
    from verify_service.engine import Verifier
    from verify_service.jobs import DecodeJob, PrefillJob
    from verify_service.local_drafts import LocalDrafting

    target = load_model(str(tiny_pair[0]), torch.device("cpu"), torch.float32)
    drafter = Drafter({}, DraftOptions.of(VerifyConfig(), target))
    verifier = Verifier(target, VerifyConfig(), None, LocalDrafting(drafter, 16, None, LookaheadShape(), every_round))
    greedy = SamplingParams(temperature=0.0)
    prompts = [(72, 101, 108, 108, 111), (1, 2, 3, 4, 5, 6, 7, 8), (10, 32, 32, 32, 32)]

    def decode(tag: str, speculation, together: bool) -> list[list[int]]:
        made: list[list] = [[] for _ in prompts]
        jobs = []
        for i, prompt in enumerate(prompts):
            verifier.step([PrefillJob(f"{tag}{i}", prompt, greedy)])
            jobs.append(DecodeJob(f"{tag}{i}", len(prompt) + 1, 40, None, made[i].append, threading.Event(),
                                  speculation=speculation))  # fmt: skip
        while jobs:
            batch = jobs if together else jobs[:1]
            again = [r.item for r in verifier.step(batch) if isinstance(r, Again)]
            jobs = again + ([] if together else jobs[1:])
        return [[t for o in outcomes for t in (*o.accepted_token_ids, o.next_token_id)] for outcomes in made]

    plain = decode("plain", None, False)
    for together in (True, False):
        tokens = decode(f"look{together}", Speculation("lookahead", 4, lookahead=(3, 3, 2)), together)
        assert tokens == plain
    trees = [row for row in verifier.sessions.values() if row.sequence.branch_slots]
    assert trees, "the window's nodes ran as token trees, on branch slots"


@pytest.mark.parametrize("every_round", [True, False])
def test_sampled_lookahead_rounds_follow_the_target(tiny_pair, every_round):
    """In the verifier, the window fed every round (its nodes beside a sampled round's one
    candidate, a tree) or only in uncopied rounds (a copy verified as a chain): 1000 seeded
    decodes at temperature 1, the second token follows the target."""
    import threading

    import torch

    from specserve.drafting import Drafter, DraftOptions
    from specserve.model.loading import load_model
    from specserve.sampling import SamplingParams
    from specserve.serving.batching import Again
    from specserve.speculation import Speculation
    from tests.test_e2e import PROMPTS, _copy_firing_prompt, check_second_tokens
    from verify_service.config import VerifyConfig
    from verify_service.engine import Verifier
    from verify_service.jobs import DecodeJob, PrefillJob, ReleaseJob
    from verify_service.local_drafts import LocalDrafting

    target_dir = tiny_pair[0]
    prompt, _ = _copy_firing_prompt(target_dir, PROMPTS[0])
    target = load_model(str(target_dir), torch.device("cpu"), torch.float32)
    drafter = Drafter({}, DraftOptions.of(VerifyConfig(), target))
    verifier = Verifier(
        target, VerifyConfig(), None, LocalDrafting(drafter, 16, None, LookaheadShape(2, 3, 2), every_round)
    )
    speculation = Speculation("lookahead", 4, adaptive=False, isolated=True)
    results, windows = [], 0
    for seed in range(1000):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        first = verifier.step([PrefillJob(f"s{seed}", tuple(prompt), sampling)])[0]
        made = []
        job = DecodeJob(f"s{seed}", len(prompt) + 1, 3, None, made.append, threading.Event(), speculation=speculation)
        while isinstance(result := verifier.step([job])[0], Again):
            job = result.item
        windows += bool(verifier.sessions[f"s{seed}"].sequence.branch_slots)
        verifier.step([ReleaseJob(f"s{seed}")])
        tokens = [first.next_token_id, *(t for o in made for t in (*o.accepted_token_ids, o.next_token_id))]
        drafts = {"num_draft_tokens": sum(o.num_draft_tokens for o in made),
                  "num_accepted_tokens": sum(o.num_accepted for o in made)}  # fmt: skip
        results.append((tokens, drafts))
    assert windows == 1000 if every_round else 0 < windows < 1000  # the window fed in every session, or some
    check_second_tokens(target_dir, prompt, results)
