"""`python -m gateway`: check the model pair, then serve the HTTP API."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import create_app
from gateway.backends import IncompatibleModels, check_pair, served_model, wait_for_model_info
from gateway.config import GatewayConfig
from specserve.config import parse_config
from specserve.logs import setup_logging
from specserve.models import load_tokenizer, tokenizer_fingerprint
from specserve.telemetry import setup_tracing
from specserve.v1 import draft_pb2_grpc, verify_pb2_grpc

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    config = parse_config(GatewayConfig, "gateway", argv, "specserve gateway", "Serve the OpenAI-compatible HTTP API.")
    setup_logging("gateway")
    tracing = setup_tracing("specserve-gateway", config.trace_console, config.trace_sample_ratio)
    tokenizer = load_tokenizer(config.tokenizer)
    try:
        security = config.channel_security
        target = wait_for_model_info(
            config.verify_address, verify_pb2_grpc.VerifyServiceStub, config.startup_timeout_s, security
        )
        draft = None
        if config.draft_address:
            try:
                draft = wait_for_model_info(
                    config.draft_address, draft_pb2_grpc.DraftServiceStub, config.draft_startup_wait_s, security
                )
            except TimeoutError as error:  # an outage of the drafts is no outage of the service
                log.warning("%s; serving target-only rounds until the draft service answers", error)
        check_pair(target, draft, tokenizer_fingerprint(tokenizer))
    except (IncompatibleModels, TimeoutError, ValueError) as error:
        log.error("refusing to start: %s", error)
        return 2
    served = served_model(target, draft, config.served_model_name, draft_service=bool(config.draft_address))
    drafts = [f"{', '.join(sorted(served.local_methods)) or 'none'} in the verifier"]
    if config.draft_address:
        name = draft.model_name if draft is not None else "not answering yet"
        drafts.append(f"{', '.join(sorted(served.remote_methods))} from the draft service ({name})")
    log.info("serving %s on http://%s:%d; drafts: %s", served.name, config.host, config.port, "; ".join(drafts))
    app = create_app(config, served, tokenizer, target, draft)
    https = {"ssl_certfile": config.http_tls_cert, "ssl_keyfile": config.http_tls_key} if config.http_tls_cert else {}
    uvicorn.run(app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=10, **https)
    if tracing is not None:
        tracing.shutdown()  # flushes spans still buffered
    return 0


if __name__ == "__main__":
    sys.exit(main())
