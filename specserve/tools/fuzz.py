"""`specserve fuzz`: hand-made hostile requests (hostile_requests), then generated bad input,
against a running stack, over HTTP and gRPC. Every answer must be a 4xx (HTTP) or a
request-error status (gRPC); a 5xx, a dropped connection, an INTERNAL or UNKNOWN status, or
a service that stops answering is a failure. Needs hypothesis (the test extras).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field

import grpc
import httpx

ALLOWED_GRPC = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.OUT_OF_RANGE,
}
HTTP_KEYS = ("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
             "seed", "stop", "n", "stream", "stream_options", "speculation", "return_token_ids", "logprobs",
             "echo")  # fmt: skip


@dataclass
class Tally:
    inputs: int = 0
    failures: list[str] = field(default_factory=list)

    def check(self, ok: bool, what: str) -> None:
        self.inputs += 1
        if not ok:
            self.failures.append(what)
            raise AssertionError(what)  # hypothesis shrinks it and reports it


def _strategies():
    from hypothesis import strategies as st

    scalars = st.one_of(
        st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=True, allow_infinity=True),
        st.text(max_size=40), st.sampled_from(["draft_model", "ngram", "none", "bogus", "", "target"]),
    )  # fmt: skip
    values = st.recursive(
        scalars,
        lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
        max_leaves=12,
    )
    body = st.dictionaries(st.sampled_from(HTTP_KEYS) | st.text(max_size=12), values, max_size=8)
    tokens = st.lists(st.integers(-5, 300) | st.integers(-(2**31), 2**31 - 1), max_size=40)
    probs = st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32) | st.floats(0, 1, width=32), max_size=40)
    return st, body, values, tokens, probs


def fuzz_http(url: str, count: int, tally: Tally, headers: dict | None = None) -> None:
    from hypothesis import HealthCheck, given, settings

    st, body, values, _, _ = _strategies()
    client = httpx.Client(timeout=120, headers=headers or {})
    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    raw = st.binary(max_size=200) | body.map(lambda b: json.dumps(b, allow_nan=True).encode())

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(path=paths, payload=raw)
    def check(path, payload):
        reply = client.post(f"{url}{path}", content=payload, headers={"content-type": "application/json"})
        if reply.status_code == 200 and reply.headers.get("content-type", "").startswith("text/event-stream"):
            bad = [line for line in reply.text.splitlines() if '"error"' in line and '"server_error"' in line]
            tally.check(not bad, f"{path} {payload[:200]!r}: stream error {bad[:1]}")
        else:
            tally.check(reply.status_code < 500, f"{path} {payload[:200]!r} -> {reply.status_code} {reply.text[:200]}")

    check()


# Values that have broken servers: non-finite, huge, tiny and denormal numbers (raw JSON,
# some of which parse to infinities), integers past 32 and 64 bits, and wrong types.
HOSTILE_VALUES = ["1e999", "-1e999", "NaN", "Infinity", "1e-320", "5e-324", "-0.0", "2147483648", "9223372036854775808",
                  "18446744073709551616", "1099511627776", "1e308", "-1", "0", "0.5", '"7"', "[]", "{}", "true",
                  "null"]  # fmt: skip
HOSTILE_FIELDS = ["temperature", "top_p", "top_k", "max_tokens", "max_completion_tokens", "seed", "n", "logprobs",
                  "best_of", "presence_penalty", "min_p", "stop", "speculation.num_speculative_tokens",
                  "speculation.min_draft_probability"]  # fmt: skip


def hostile_requests(api_key: str = "") -> list[tuple[str, str, dict, bytes]]:
    """(label, path, headers, body) of hand-made hostile requests: every HOSTILE_VALUE in
    every HOSTILE_FIELD of both endpoints, odd headers (non-ASCII keys), odd chat roles and
    contents, and many or long stop strings."""
    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    json_headers = {"content-type": "application/json", **auth}
    bases = {
        "/v1/completions": '"prompt": "def f(x):"',
        "/v1/chat/completions": '"messages": [{"role": "user", "content": "hi"}]',
    }
    out = []
    for path, base in bases.items():
        for name in HOSTILE_FIELDS:
            for value in HOSTILE_VALUES:
                if name.startswith("speculation."):
                    field_json = f'"speculation": {{"{name.split(".")[1]}": {value}}}'
                else:
                    field_json = f'"{name}": {value}'
                rest = ', "max_tokens": 2' if name not in ("max_tokens", "max_completion_tokens") else ""
                body = f"{{{base}, {field_json}{rest}}}".encode()
                out.append((f"{path} {name}={value}", path, json_headers, body))
    body = b'{"prompt": "hi", "max_tokens": 2}'
    for key in (b"Bearer \xff\xfe", b"Bearer \xc3\xa9t\xc3\xa9", b"\x80", b"Bearer " + b"k" * 8000):
        out.append(
            (
                f"authorization {key[:20]!r}",
                "/v1/completions",
                {"content-type": "application/json", "authorization": key},
                body,
            )
        )
    roles = ["narrator", "", "system" * 100, "\u0000", "tool"]
    for role in roles:
        messages = json.dumps({"messages": [{"role": role, "content": "hi"}], "max_tokens": 2})
        out.append((f"chat role {role[:12]!r}", "/v1/chat/completions", json_headers, messages.encode()))
    for content in ([{"type": "image_url", "image_url": {"url": "x"}}], [{"type": "text"}], 5, [[]]):
        messages = json.dumps({"messages": [{"role": "user", "content": content}], "max_tokens": 2})
        out.append((f"chat content {str(content)[:20]}", "/v1/chat/completions", json_headers, messages.encode()))
    for stop in (["x"] * 5000, ["ab" * 5000], [""], [5], "s" * 100_000):
        body = json.dumps({"prompt": "hi", "max_tokens": 2, "stop": stop}).encode()
        out.append((f"stop {str(stop)[:20]}", "/v1/completions", json_headers, body))
    return out


def fuzz_hostile(url: str, tally: Tally, api_key: str = "") -> None:
    """hostile_requests() against a gateway: each answer must be below 500, and a connection
    dropped without an answer is a failure too."""
    with httpx.Client(timeout=120) as client:
        for label, path, headers, body in hostile_requests(api_key):
            try:
                reply = client.post(f"{url}{path}", content=body, headers=headers)
            except httpx.HTTPError as error:
                tally.failures.append(f"{label}: {type(error).__name__}: {error}")
                tally.inputs += 1
                continue
            tally.inputs += 1
            if reply.status_code >= 500:
                tally.failures.append(f"{label} -> {reply.status_code} {reply.text[:200]}")


def _status_of(call) -> grpc.StatusCode:
    """The status a gRPC call ends with (OK, or the error's)."""
    try:
        call()
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


def fuzz_grpc(verify_address: str, draft_address: str, count: int, tally: Tally) -> None:
    """The verifier's calls (speculative decodes included), and a draft service's streams
    unless draft_address is empty."""
    from hypothesis import HealthCheck, given, settings

    from specserve.v1 import common_pb2, draft_pb2, draft_pb2_grpc, verify_pb2, verify_pb2_grpc

    st, _, _, tokens, probs = _strategies()
    verify = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(verify_address))
    draft = draft_pb2_grpc.DraftServiceStub(grpc.insecure_channel(draft_address)) if draft_address else None
    floats = st.floats(allow_nan=True, allow_infinity=True, width=32)
    sampling = st.builds(common_pb2.SamplingParams, temperature=floats, top_p=floats,
                         top_k=st.integers(-(2**31), 2**31 - 1), seed=st.integers(0, 2**64 - 1))  # fmt: skip
    sessions = st.sampled_from(["fuzz-a", "fuzz-b", "", "x" * 300]) | st.text(max_size=8)
    distribution = st.builds(common_pb2.SparseDistribution, token_ids=tokens, probs=probs)
    counts = st.integers(0, 2**32 - 1) | st.integers(0, 40)
    methods = st.sampled_from(["", "draft_model", "ngram", "early_exit", "bogus"])
    speculation = st.none() | st.builds(
        verify_pb2.Speculation, method=methods, num_speculative_tokens=counts, adaptive=st.booleans(),
        adaptive_k_min=counts, adaptive_k_max=counts, min_draft_probability=floats)  # fmt: skip
    verify_calls = st.one_of(
        st.builds(lambda s, t, p: (verify.Prefill, verify_pb2.PrefillRequest(session_id=s, token_ids=t, sampling=p)),
                  sessions, tokens, sampling),
        st.builds(lambda s, n, d, q, p: (verify.Verify, verify_pb2.VerifyRequest(
            session_id=s, num_verified=n, draft_token_ids=d, draft_distributions=q, sampling=p)),
            sessions, counts, tokens, st.lists(distribution, max_size=20), sampling),
        st.builds(lambda s, n, m, p, x: (decode, verify_pb2.DecodeRequest(
            session_id=s, num_verified=n, max_tokens=m, sampling=p, speculation=x)),
            sessions, counts, st.integers(0, 40) | st.just(2**32 - 1), sampling, speculation),
        st.builds(lambda s: (verify.Release, verify_pb2.ReleaseRequest(session_id=s)), sessions),
    )  # fmt: skip
    draft_requests = st.lists(st.builds(
        draft_pb2.DraftRequest, session_id=sessions, tokens=tokens, num_verified=counts, num_speculative_tokens=counts,
        sampling=sampling, method=methods,
        min_draft_probability=floats, want_bonus_guess=st.booleans()), min_size=1, max_size=4)  # fmt: skip

    def decode(request, timeout):
        return list(verify.Decode(request, timeout=timeout))

    @settings(max_examples=count, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(call=verify_calls)
    def check_verify(call):
        method, request = call
        code = _status_of(lambda: method(request, timeout=60))
        tally.check(code in ALLOWED_GRPC, f"{type(request).__name__} {str(request)[:300]} -> {code}")

    @settings(max_examples=max(1, count // 4), deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(requests=draft_requests)
    def check_draft(requests):
        code = _status_of(lambda: list(draft.Draft(iter(requests), timeout=60)))
        tally.check(code in ALLOWED_GRPC, f"Draft stream {[str(r)[:120] for r in requests]} -> {code}")

    check_verify()
    if draft is not None:
        check_draft()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve fuzz",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the gateway's base URL")
    parser.add_argument("--verify-address", default="127.0.0.1:50052", help="the verify service to fuzz")
    parser.add_argument(
        "--draft-address", default="", help="a draft service to fuzz too (`specserve up --draft-service`)"
    )
    parser.add_argument("--count", type=int, default=2000, help="generated inputs per kind (HTTP, verify, draft)")
    parser.add_argument("--api-key", default="", help="the gateway's API key, where it needs one")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specserve.ports import gateway_url

    args.url = gateway_url(args.url, "specserve fuzz")
    if args.url is None:
        return 2
    try:
        import hypothesis  # noqa: F401
    except ImportError:
        print("specserve fuzz needs hypothesis: pip install -e '.[test]'", file=sys.stderr)
        return 2
    tally = Tally()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    try:
        fuzz_hostile(args.url, tally, args.api_key)
        if tally.failures:
            raise AssertionError(f"{len(tally.failures)} hostile requests failed, first: {tally.failures[0]}")
        fuzz_http(args.url, args.count, tally, headers)
        fuzz_grpc(args.verify_address, args.draft_address, args.count, tally)
    except AssertionError as error:
        print(f"FAILED after {tally.inputs} inputs: {error}", file=sys.stderr)
        return 1
    health = httpx.get(f"{args.url}/health", timeout=10).status_code
    print(f"{tally.inputs} generated inputs: {len(tally.failures)} failures; /health {health}")
    return 0 if health == 200 and not tally.failures else 1


if __name__ == "__main__":
    sys.exit(main())
