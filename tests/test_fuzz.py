"""Generated bad input, HTTP and gRPC: no 5xx, no INTERNAL, every service still healthy.
(The bar of 10,000 inputs runs as `specserve fuzz --count 3400`; the suite runs a sample.)"""

from __future__ import annotations

import httpx

from specserve.tools.fuzz import Tally, fuzz_grpc, fuzz_http


def test_generated_http_bodies_get_4xx_not_5xx(stack):
    tally = Tally()
    fuzz_http(stack.url, 150, tally)
    assert tally.inputs >= 150 and not tally.failures
    assert httpx.get(f"{stack.url}/health").status_code == 200


def test_generated_grpc_messages_get_request_errors_not_internal(stack, split_stack):
    """The default stack's verifier (its own speculative decodes included) and a draft service."""
    tally = Tally()
    fuzz_grpc(stack.verify_address, split_stack.draft_address, 150, tally)
    assert tally.inputs >= 150 and not tally.failures
    assert httpx.get(f"{stack.url}/health").status_code == 200
    assert httpx.get(f"{split_stack.url}/health").status_code == 200
