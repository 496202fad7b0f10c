"""Method suffix: its counts, its drafts, what it shares across sessions (a tenant's only),
its bound, and its output through the stack (greedy equal to target-only, sampled exact)."""

from __future__ import annotations

import random
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

from specserve.drafting import Drafter, DraftJob, DraftOptions
from specserve.methods.suffix import (
    MAX_FOLLOWERS,
    QUEUED_TOKENS,
    TOTAL,
    SuffixCounts,
    SuffixSession,
    SuffixStore,
    suffix_drafts,
)
from specserve.sampling import SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def test_counts_follow_every_context_up_to_the_depth_and_the_longest_match_wins():
    table = SuffixCounts(depth=3)
    table.add([1, 2, 3, 1, 2, 4, 1, 2, 3])
    assert table.longest_match([9, 1, 2]) == (2, {TOTAL: 3, 3: 2, 4: 1})  # [1, 2] was followed by 3 twice, 4 once
    assert table.longest_match([3, 1, 2]) == (3, {TOTAL: 1, 4: 1})  # [3, 1, 2]: by 4
    assert table.longest_match([7, 8]) == (0, None)
    # The drafts follow the likeliest token while the path's share stays above the floor.
    # [1, 2] -> 3 (2 of 3), then [1, 2, 3] -> 1, [2, 3, 1] -> 2, [3, 1, 2] -> 4 (each 1 of 1).
    assert suffix_drafts([(table, "")], [5, 1, 2], 4, 0.0) == [3, 1, 2, 4]
    assert suffix_drafts([(table, "")], [5, 1, 2], 4, 0.6) == [3, 1, 2, 4]  # the path's share stays 2/3
    assert suffix_drafts([(table, "")], [5, 1, 2], 4, 0.7) == []
    assert suffix_drafts([(table, "")], [7, 8], 4, 0.0) == []
    # Counting on from where it stopped gives what counting at once gives.
    stepwise, tokens = SuffixCounts(depth=3), [1, 2, 3, 1, 2, 4, 1, 2, 3]
    stepwise.add(tokens[:4])
    stepwise.add(tokens[:5], start=4)
    stepwise.add(tokens, start=5)
    assert dict(stepwise.table) == dict(table.table)
    # A context keeps its MAX_FOLLOWERS likeliest followers; its total counts every one.
    split = SuffixCounts(depth=1)
    split.add([t for follower in range(100, 100 + MAX_FOLLOWERS + 4) for t in (7, follower, 7, 100)])
    n, counts = split.longest_match([7])
    assert len(counts) == MAX_FOLLOWERS + 1 and counts[100] == MAX_FOLLOWERS + 4 + 1
    assert counts[TOTAL] == 2 * (MAX_FOLLOWERS + 4)
    assert suffix_drafts([(split, "")], [7], 1, 0.0) == [100]  # its share: 21 of 40, not of the kept ones


def test_a_session_learns_from_its_tenants_finished_sessions_and_never_from_anothers():
    store = SuffixStore(min_probability=0.0)
    answer = [40, 41, 42, 43, 44, 45]
    first = SuffixSession("tenant-a")
    prompt = [1, 2, 3, 4]
    store.drafts(first, prompt, 0, 4)
    store.finish(first, prompt + answer)  # what the target made for it
    # The same prompt again: the same tenant's session drafts the earlier answer; another
    # tenant's, with nothing in its own sequence to follow, drafts nothing.
    assert store.drafts(SuffixSession("tenant-a"), prompt, 0, 4) == answer[:4]
    assert store.drafts(SuffixSession("tenant-b"), prompt, 0, 4) == []
    # A session's own tokens win a tie with the shared counts.
    own = SuffixSession("tenant-a")
    assert store.drafts(own, [9, 4, 77, 9, 4], 0, 1) == [77]


def test_the_shared_table_stays_within_its_bound_after_10000_requests():
    bound = 20_000
    store = SuffixStore(max_contexts=bound, min_probability=0.0)
    rng = random.Random(0)
    for request in range(10_000):
        session = SuffixSession(f"tenant-{request % 7}")
        prompt = [rng.randrange(500) for _ in range(20)]
        store.drafts(session, prompt, 0, 4)
        store.finish(session, prompt + [rng.randrange(500) for _ in range(40)])
        if request % 1000 == 999:
            store.drafts(SuffixSession("tenant-0"), prompt, 0, 4)  # folds the finished ones in
            assert len(store.shared) <= bound
    assert len(store.shared) == bound  # full, and evicting
    # Sessions finishing faster than batches count them in: the oldest waiting are dropped.
    for _ in range(2000):
        session = SuffixSession("tenant-0", prompt_length=10)
        store.finish(session, list(range(10)) + [rng.randrange(500) for _ in range(300)])
    assert QUEUED_TOKENS - 310 < store.queued_tokens <= QUEUED_TOKENS
    table = store.shared.table
    size = sys.getsizeof(table) + sum(sys.getsizeof(key) + sys.getsizeof(counts) for key, counts in table.items())
    assert size < bound * 500  # bytes: each context's key and counts (docs/design.md, "Suffix decoding")


def test_the_drafter_serves_suffix_without_a_model_and_shares_on_close():
    drafter = Drafter({}, DraftOptions(vocab_size=300, max_context_length=512, max_sessions=4))
    prompt, answer = (5, 6, 7, 8), (50, 51, 52, 53, 54)

    def round_of(session, tokens, num_verified):
        [proposal] = drafter.step([DraftJob(session, tokens, num_verified, 4, GREEDY)])
        return proposal.draft_token_ids

    session = drafter.open_session("one", "suffix", "tenant")
    assert round_of(session, prompt, 4) == ()
    round_of(session, answer, 9)
    drafter.close_session(session)
    again = drafter.open_session("two", "suffix", "tenant")
    assert round_of(again, prompt, 4) == answer[:4]
    assert round_of(again, (50, 51), 6) == (52, 53, 54)  # fewer than K: the answer ended there
    other = drafter.open_session("three", "suffix", "another")
    assert round_of(other, prompt, 4) == ()
    # An isolated session (a seeded sampled request's) drafts from its own tokens only.
    isolated = drafter.open_session("four", "suffix", "tenant", isolated=True)
    assert round_of(isolated, prompt, 4) == ()


def test_a_seeded_sampled_request_learns_from_no_other_and_a_tenant_is_its_key():
    from gateway.api import CompletionRequest, plan_for
    from gateway.clients import ServedModel
    from gateway.config import GatewayConfig

    served = ServedModel("m", 300, 512, frozenset({0}), 8, frozenset({"suffix"}), frozenset())
    config = GatewayConfig()

    def plan(**body):
        request = CompletionRequest(prompt=[1, 2], max_tokens=4, speculation={"method": "suffix"}, **body)
        return plan_for(request, [1, 2], served, config, tenant="key-hash").speculation

    assert plan(temperature=0.8, seed=7).isolated and not plan(temperature=0.8).isolated
    assert not plan(temperature=0, seed=7).isolated and plan(temperature=0).tenant == "key-hash"


def _complete(url: str, prompt, speculation: dict, key: str | None = None, **body) -> dict:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    reply = httpx.post(f"{url}/v1/completions", headers=headers, timeout=120, json={
        "prompt": list(prompt), "max_tokens": 32, "temperature": 0, "return_token_ids": True,
        "speculation": speculation, **body})  # fmt: skip
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_greedy_suffix_output_equals_target_only_and_learns_across_requests(request):
    """Through the stack, drafted in the verifier and by a draft service: each output is the
    target-only one, and a prompt asked again drafts what the target made for it before."""
    from tests.test_e2e import PROMPTS

    for stack_name in ("stack", "split_stack"):
        stack = request.getfixturevalue(stack_name)
        for prompt in PROMPTS:
            reference = _complete(stack.url, prompt, {"method": "none"})["choices"][0]["token_ids"]
            first = _complete(stack.url, prompt, {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False})
            again = _complete(stack.url, prompt, {"method": "suffix", "num_speculative_tokens": 4, "adaptive": False})
            assert first["choices"][0]["token_ids"] == again["choices"][0]["token_ids"] == reference, stack_name
            if len(reference) == 32:  # the earlier answer, drafted and kept
                kept = [body["usage"]["speculation"]["num_accepted_tokens"] for body in (first, again)]
                assert kept[1] > kept[0] and kept[1] >= 16, (stack_name, prompt, kept)


def test_sampled_suffix_rounds_follow_the_target_distribution(stack):
    """1200 seeded requests at temperature 1 on a prompt whose repeats the round after the
    prefill copies: the second token follows the target exactly."""
    from tests.test_e2e import PROMPTS, _copy_firing_prompt, check_second_tokens

    prompt, _ = _copy_firing_prompt(stack.target_dir, PROMPTS[0])

    def run(seed):
        body = _complete(stack.url, prompt, {"method": "suffix", "num_speculative_tokens": 3, "adaptive": False},
                         max_tokens=4, temperature=1.0, seed=seed)  # fmt: skip
        return body["choices"][0]["token_ids"], body["usage"]["speculation"]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(run, range(1200)))
    check_second_tokens(stack.target_dir, prompt, results)
