"""The verify and draft services through their generated stubs, as a user would call them:
the verifier of the default stack (which drafts for itself), and a draft service."""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

GREEDY = common_pb2.SamplingParams(temperature=0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def verify(stack):
    with grpc.insecure_channel(stack.verify_address) as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel)


@pytest.fixture(scope="module")
def draft(split_stack):
    with grpc.insecure_channel(split_stack.draft_address) as channel:
        yield draft_pb2_grpc.DraftServiceStub(channel)


@pytest.fixture(scope="module")
def split_verify(split_stack):
    """The verifier beside a draft service (it drafts only with n-gram, suffix and Medusa heads itself)."""
    with grpc.insecure_channel(split_stack.verify_address) as channel:
        yield verify_pb2_grpc.VerifyServiceStub(channel)


def prefill(verify, session_id: str, tokens=(72, 101, 108), sampling=GREEDY) -> verify_pb2.PrefillResponse:
    return verify.Prefill(verify_pb2.PrefillRequest(session_id=session_id, token_ids=tokens, sampling=sampling))


def status_of(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call()
    return caught.value


def test_prefill_verify_release_round_trip(split_verify, draft):
    verify = split_verify
    first = prefill(verify, "round-trip")
    assert first.num_verified == 4
    sequence = [72, 101, 108, first.next_token_id]
    stream = draft.Draft(
        iter(
            [
                draft_pb2.DraftRequest(
                    session_id="round-trip", tokens=sequence, num_verified=4, num_speculative_tokens=3, sampling=GREEDY
                )
            ]
        )
    )
    proposal = next(stream)
    assert proposal.num_verified == 4 and len(proposal.draft_token_ids) == 3 and not proposal.draft_distributions
    reply = verify.Verify(
        verify_pb2.VerifyRequest(session_id="round-trip", num_verified=4, draft_token_ids=proposal.draft_token_ids)
    )
    assert 0 <= reply.num_accepted <= 3 and reply.num_verified == 4 + reply.num_accepted + 1
    assert reply.batch_size >= 1
    verify.Release(verify_pb2.ReleaseRequest(session_id="round-trip"))
    verify.Release(verify_pb2.ReleaseRequest(session_id="round-trip"))  # releasing twice is harmless


def test_sampled_proposals_carry_exact_sparse_distributions(draft):
    request = draft_pb2.DraftRequest(
        session_id="sparse", tokens=[1, 2, 3], num_verified=3, num_speculative_tokens=4, sampling=SAMPLED
    )
    proposal = next(draft.Draft(iter([request])))
    assert len(proposal.draft_distributions) == 4
    for token, distribution in zip(proposal.draft_token_ids, proposal.draft_distributions):
        assert 1 <= len(distribution.token_ids) <= 32  # the default support size
        assert abs(sum(distribution.probs) - 1) < 1e-5
        assert token in distribution.token_ids


def test_out_of_step_caller_gets_failed_precondition_with_the_session_length(verify):
    prefill(verify, "stale")
    error = status_of(lambda: verify.Verify(verify_pb2.VerifyRequest(session_id="stale", num_verified=9)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(error.trailing_metadata())["specserve-num-verified"] == "4"
    error = status_of(lambda: verify.Verify(verify_pb2.VerifyRequest(session_id="never-made", num_verified=1)))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(error.trailing_metadata())["specserve-num-verified"] == "0"
    # The session is untouched: a correct call still works.
    assert verify.Verify(verify_pb2.VerifyRequest(session_id="stale", num_verified=4)).num_verified == 5


BAD_DISTRIBUTIONS = [
    common_pb2.SparseDistribution(token_ids=[5, 6], probs=[0.5]),  # lengths differ
    common_pb2.SparseDistribution(token_ids=[5, 6], probs=[0.9, 0.3]),  # not normalised
    common_pb2.SparseDistribution(token_ids=[5, 6], probs=[float("nan"), 1.0]),
    common_pb2.SparseDistribution(token_ids=[5, 6], probs=[-0.5, 1.5]),
    common_pb2.SparseDistribution(token_ids=[5, 5], probs=[0.5, 0.5]),  # repeated id
    common_pb2.SparseDistribution(token_ids=[5, 99999], probs=[0.5, 0.5]),  # outside the vocabulary
    common_pb2.SparseDistribution(token_ids=[6, 7], probs=[0.5, 0.5]),  # the draft token 5 has no mass
]


@pytest.mark.parametrize("distribution", BAD_DISTRIBUTIONS)
def test_bad_draft_distributions_are_invalid_and_change_nothing(verify, distribution):
    session = f"bad-{BAD_DISTRIBUTIONS.index(distribution)}"
    prefill(verify, session, sampling=SAMPLED)
    request = verify_pb2.VerifyRequest(
        session_id=session, num_verified=4, draft_token_ids=[5], draft_distributions=[distribution], sampling=SAMPLED
    )
    assert status_of(lambda: verify.Verify(request)).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert verify.Verify(verify_pb2.VerifyRequest(session_id=session, num_verified=4)).num_verified == 5
    verify.Release(verify_pb2.ReleaseRequest(session_id=session))


@pytest.mark.parametrize(
    "request_",
    [
        verify_pb2.PrefillRequest(session_id="p", token_ids=[]),
        verify_pb2.PrefillRequest(session_id="p", token_ids=[300000]),
        verify_pb2.PrefillRequest(session_id="p", token_ids=list(range(200)) * 3),  # beyond the 512 window
        verify_pb2.PrefillRequest(session_id="", token_ids=[1]),
        verify_pb2.PrefillRequest(session_id="p", token_ids=[1], sampling=common_pb2.SamplingParams(temperature=-1)),
        verify_pb2.PrefillRequest(session_id="p", token_ids=[1], sampling=common_pb2.SamplingParams(top_p=2)),
    ],
)
def test_bad_prefill_is_invalid_argument(verify, request_):
    assert status_of(lambda: verify.Prefill(request_)).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_too_many_drafts_and_greedy_distributions_are_refused(verify):
    prefill(verify, "limits")
    too_many = verify_pb2.VerifyRequest(session_id="limits", num_verified=4, draft_token_ids=[1] * 17)
    assert status_of(lambda: verify.Verify(too_many)).code() == grpc.StatusCode.INVALID_ARGUMENT
    greedy_with_q = verify_pb2.VerifyRequest(
        session_id="limits",
        num_verified=4,
        draft_token_ids=[5],
        draft_distributions=[common_pb2.SparseDistribution(token_ids=[5], probs=[1.0])],
    )
    assert status_of(lambda: verify.Verify(greedy_with_q)).code() == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_draft_requests_end_the_stream_with_a_status(draft):
    bad = [
        draft_pb2.DraftRequest(session_id="d", tokens=[1], num_verified=1, num_speculative_tokens=0),
        draft_pb2.DraftRequest(session_id="d", tokens=[1], num_verified=1, num_speculative_tokens=99),
        draft_pb2.DraftRequest(session_id="d", tokens=[999999], num_verified=1, num_speculative_tokens=2),
    ]
    for request in bad:
        assert status_of(lambda r=request: next(draft.Draft(iter([r])))).code() == grpc.StatusCode.INVALID_ARGUMENT
    skipped = draft_pb2.DraftRequest(session_id="d", tokens=[1, 2], num_verified=5, num_speculative_tokens=2)
    assert status_of(lambda: next(draft.Draft(iter([skipped])))).code() == grpc.StatusCode.FAILED_PRECONDITION


def test_concurrent_verify_calls_share_a_kernel_call(verify):
    sessions = [f"batch-{i}" for i in range(12)]
    for session in sessions:
        prefill(verify, session, tokens=(1, 2, 3, 4))

    def call(session):
        return verify.Verify(verify_pb2.VerifyRequest(session_id=session, num_verified=5, draft_token_ids=[7, 8, 9]))

    with ThreadPoolExecutor(len(sessions)) as pool:
        replies = list(pool.map(call, sessions))
    assert max(reply.batch_size for reply in replies) > 1
    assert len({(r.num_accepted, r.next_token_id) for r in replies}) == 1  # same input, same answer


def test_health_and_reflection(stack, split_stack):
    for address, service in (
        (stack.verify_address, "specserve.v1.VerifyService"),
        (split_stack.draft_address, "specserve.v1.DraftService"),
    ):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = health.Check(health_pb2.HealthCheckRequest(service=name))
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
            answer = next(
                reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            )
            names = {s.name for s in answer.list_services_response.service}
            assert {service, "grpc.health.v1.Health"} <= names


def test_model_info_of_both_services_agree(verify, split_verify, draft):
    target_info = verify.GetModelInfo(common_pb2.ModelInfoRequest())
    draft_info = draft.GetModelInfo(common_pb2.ModelInfoRequest())
    assert target_info.vocab_size == 257 and target_info.max_context_length == 512
    assert target_info.tokenizer_fingerprint == draft_info.tokenizer_fingerprint
    assert list(target_info.eos_token_ids) == [256]
    # The default stack's verifier drafts with the draft model, early exit, n-gram, suffix and
    # the target's Medusa heads; one beside a draft service with n-gram and suffix (they need no
    # model) and the heads (they need the target's hidden state).
    assert sorted(target_info.local_methods) == ["draft_model", "early_exit", "lookahead", "medusa", "ngram", "suffix"]
    split = split_verify.GetModelInfo(common_pb2.ModelInfoRequest())
    assert sorted(split.local_methods) == ["lookahead", "medusa", "ngram", "suffix"]
    assert sorted(draft_info.local_methods) == ["draft_model", "early_exit", "ngram", "suffix"]  # the draft service's


def decode(verify, session_id: str, num_verified: int, max_tokens: int, sampling=None) -> list:
    request = verify_pb2.DecodeRequest(
        session_id=session_id, num_verified=num_verified, max_tokens=max_tokens, sampling=sampling
    )
    return list(verify.Decode(request))


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_decode_streams_the_tokens_of_verify_calls_without_drafts(verify, sampling):
    start = prefill(verify, f"decode-{sampling.temperature}", sampling=sampling)
    streamed = decode(verify, f"decode-{sampling.temperature}", 4, 12)
    assert [r.num_verified for r in streamed] == list(range(5, 17))
    assert all(r.batch_size >= 1 and r.forward_seconds > 0 for r in streamed)
    prefill(verify, f"by-verify-{sampling.temperature}", sampling=sampling)
    one_by_one = [
        verify.Verify(
            verify_pb2.VerifyRequest(session_id=f"by-verify-{sampling.temperature}", num_verified=n)
        ).next_token_id
        for n in range(4, 16)
    ]
    assert [r.token_id for r in streamed] == one_by_one
    assert start.next_token_id >= 0
    # The session holds every streamed token: rounds go on from there.
    after = verify.Verify(verify_pb2.VerifyRequest(session_id=f"decode-{sampling.temperature}", num_verified=16))
    assert after.num_verified == 17


def test_bad_decode_calls_get_a_status_and_change_nothing(verify):
    prefill(verify, "bad-decode")
    for request, code in [
        (verify_pb2.DecodeRequest(session_id="bad-decode", num_verified=4, max_tokens=0), "INVALID_ARGUMENT"),
        (verify_pb2.DecodeRequest(session_id="bad-decode", num_verified=7, max_tokens=3), "FAILED_PRECONDITION"),
        (verify_pb2.DecodeRequest(session_id="no-such", num_verified=1, max_tokens=3), "FAILED_PRECONDITION"),
        (
            verify_pb2.DecodeRequest(
                session_id="bad-decode", num_verified=4, max_tokens=3, sampling=common_pb2.SamplingParams(top_p=2)
            ),
            "INVALID_ARGUMENT",
        ),
    ]:
        assert status_of(lambda r=request: list(verify.Decode(r))).code().name == code
    assert [r.num_verified for r in decode(verify, "bad-decode", 4, 2)] == [5, 6]


def test_a_cancelled_decode_stops_and_leaves_its_session_usable(verify):
    prefill(verify, "cancelled")
    stream = verify.Decode(verify_pb2.DecodeRequest(session_id="cancelled", num_verified=4, max_tokens=500))
    read = [next(stream).num_verified for _ in range(3)]
    stream.cancel()
    assert read == [5, 6, 7]
    deadline = time.monotonic() + 10
    while True:  # a call beside a decode still running is refused as INVALID_ARGUMENT
        error = status_of(lambda: verify.Verify(verify_pb2.VerifyRequest(session_id="cancelled", num_verified=0)))
        if error.code() == grpc.StatusCode.FAILED_PRECONDITION or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    held = int(dict(error.trailing_metadata())["specserve-num-verified"])
    assert 7 <= held < 100  # it stopped soon after the call ended (500 tokens take seconds), keeping what it made
    assert verify.Verify(verify_pb2.VerifyRequest(session_id="cancelled", num_verified=held)).num_verified == held + 1


def test_concurrent_decodes_share_batches_and_verify_calls_run_beside_them(verify):
    sessions = [f"decode-batch-{i}" for i in range(6)]
    for session in sessions:
        prefill(verify, session, tokens=(1, 2, 3, 4))
    prefill(verify, "verify-beside")

    def verify_beside() -> list[int]:
        return [
            verify.Verify(verify_pb2.VerifyRequest(session_id="verify-beside", num_verified=n)).num_verified
            for n in range(4, 14)
        ]

    with ThreadPoolExecutor(len(sessions) + 1) as pool:
        beside = pool.submit(verify_beside)
        streams = list(pool.map(lambda session: decode(verify, session, 5, 30), sessions))
        assert beside.result() == list(range(5, 15))
    assert all([r.token_id for r in s] == [r.token_id for r in streams[0]] for s in streams)  # same input, same tokens
    assert all(len(s) == 30 for s in streams)
    assert max(r.batch_size for s in streams for r in s) > 1


def speculative_decode(verify, session_id: str, num_verified: int, max_tokens: int, sampling=None, **speculation):
    request = verify_pb2.DecodeRequest(
        session_id=session_id,
        num_verified=num_verified,
        max_tokens=max_tokens,
        sampling=sampling,
        speculation=verify_pb2.Speculation(**speculation),
    )
    return list(verify.Decode(request))


@pytest.mark.parametrize("method", ["draft_model", "early_exit", "ngram"])
def test_a_speculative_decode_streams_rounds_whose_tokens_are_target_only_decodings(verify, method):
    prompt = (104, 105, 104, 105, 104, 105, 32)  # repeats, so that n-gram finds something to copy
    prefill(verify, f"plain-{method}", prompt)
    plain = [r.token_id for r in decode(verify, f"plain-{method}", 8, 30)]
    prefill(verify, f"spec-{method}", prompt)
    rounds = speculative_decode(verify, f"spec-{method}", 8, 30, method=method, num_speculative_tokens=4)
    assert [t for r in rounds for t in (*r.accepted_token_ids, r.token_id)] == plain
    assert all(len(r.accepted_token_ids) <= r.num_draft_tokens <= 4 for r in rounds)
    lengths = itertools.accumulate((len(r.accepted_token_ids) + 1 for r in rounds), initial=8)
    assert [r.num_verified for r in rounds] == list(lengths)[1:]
    assert sum(len(r.accepted_token_ids) for r in rounds) > 0  # fewer rounds than tokens: drafts were kept
    assert all(r.draft_seconds > 0 for r in rounds if r.num_draft_tokens)


@pytest.mark.parametrize(
    "speculation",
    [
        {"method": "nope", "num_speculative_tokens": 4},
        {"method": "draft_model", "num_speculative_tokens": 0},
        {"method": "draft_model", "num_speculative_tokens": 99},
        {"method": "ngram", "num_speculative_tokens": 4, "min_draft_probability": 2.0},
        {
            "method": "draft_model",
            "num_speculative_tokens": 4,
            "adaptive": True,
            "adaptive_k_min": 5,
            "adaptive_k_max": 2,
        },
    ],
)
def test_bad_speculation_is_invalid_and_changes_nothing(verify, speculation):
    prefill(verify, "bad-speculation")
    error = status_of(lambda: speculative_decode(verify, "bad-speculation", 4, 5, **speculation))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert [r.num_verified for r in decode(verify, "bad-speculation", 4, 2)] == [5, 6]  # the session is as it was


def test_a_draft_service_drafts_a_tree_and_the_verifier_keeps_a_path_of_it(split_verify, draft):
    """Greedy: the root's children are the draft's top tokens in rank order; the verifier
    keeps a path of the tree and says which tokens it kept."""
    verify = split_verify
    first = prefill(verify, "tree")
    sequence = [72, 101, 108, first.next_token_id]
    tree = common_pb2.TokenTree(parents=[0, 1, 0, 3], ranks=[0, 0, 1, 0])  # two branches of two
    request = draft_pb2.DraftRequest(
        session_id="tree", tokens=sequence, num_verified=4, num_speculative_tokens=4, sampling=GREEDY, tree=tree
    )
    proposal = next(draft.Draft(iter([request])))
    assert list(proposal.draft_parents) == [0, 1, 0, 3]
    drafts = list(proposal.draft_token_ids)
    assert drafts[0] != drafts[2]  # the first and second choices after the root
    reply = verify.Verify(
        verify_pb2.VerifyRequest(
            session_id="tree", num_verified=4, draft_token_ids=drafts, draft_parents=proposal.draft_parents
        )
    )
    paths = ([], [drafts[0]], drafts[:2], [drafts[2]], drafts[2:])
    assert list(reply.accepted_token_ids) in paths
    assert reply.num_accepted == len(reply.accepted_token_ids) and reply.num_verified == 5 + reply.num_accepted


@pytest.mark.parametrize(
    "parents, sampling, message",
    [
        ([0, 2], GREEDY, "not an earlier node"),
        ([0], GREEDY, "need 2 parents"),
        ([0, 0], SAMPLED, "distribution its siblings"),
    ],
)
def test_bad_trees_are_refused_and_the_session_goes_on(split_verify, parents, sampling, message):
    verify = split_verify
    prefill(verify, "bad-tree", sampling=sampling)
    distributions = []
    if sampling is SAMPLED:
        distributions = [
            common_pb2.SparseDistribution(token_ids=[5, 6], probs=[0.5, 0.5]),
            common_pb2.SparseDistribution(token_ids=[6, 5], probs=[0.5, 0.5]),
        ]
    request = verify_pb2.VerifyRequest(
        session_id="bad-tree",
        num_verified=4,
        draft_token_ids=[5, 6],
        draft_parents=parents,
        draft_distributions=distributions,
    )
    error = status_of(lambda: verify.Verify(request))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
    assert verify.Verify(verify_pb2.VerifyRequest(session_id="bad-tree", num_verified=4)).num_verified == 5


@pytest.mark.parametrize(
    "method, k, message", [("ngram", 2, "ngram drafts chains"), ("draft_model", 3, "needs num_speculative_tokens 2")]
)
def test_a_draft_service_refuses_a_tree_for_ngram_or_of_the_wrong_size(draft, method, k, message):
    tree = common_pb2.TokenTree(parents=[0, 0], ranks=[0, 1])
    request = draft_pb2.DraftRequest(
        session_id=f"bad-tree-{method}",
        tokens=[1, 2, 3],
        num_verified=3,
        num_speculative_tokens=k,
        sampling=GREEDY,
        tree=tree,
        method=method,
    )
    error = status_of(lambda: next(draft.Draft(iter([request]))))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and message in error.details()
