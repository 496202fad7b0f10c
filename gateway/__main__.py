"""`python -m gateway`: check the model pair, then serve the HTTP API."""

from __future__ import annotations

import logging
import sys

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from specserve.config import parse_config
from specserve.model.loading import load_tokenizer, tokenizer_fingerprint
from specserve.ports import busy_port_message
from specserve.serving.logs import setup_logging
from specserve.serving.telemetry import setup_tracing

log = logging.getLogger("gateway")


def main(argv: list[str] | None = None) -> int:
    config = parse_config(GatewayConfig, "gateway", argv, "specserve gateway", "Serve the OpenAI-compatible HTTP API.")
    setup_logging("gateway")
    busy = busy_port_message("specserve gateway", config.host, config.port, "--port")
    if busy:
        log.error("%s", busy)
        return 2
    tracing = setup_tracing("specserve-gateway", config.trace_console, config.trace_sample_ratio)
    try:
        tokenizer = load_tokenizer(config.tokenizer)
    except (OSError, ValueError) as error:
        log.error(
            "refusing to start: no tokenizer in %s (%s); point --tokenizer at the target's directory",
            config.tokenizer,
            str(error).splitlines()[0],
        )
        return 2
    https = {"ssl_certfile": config.http_tls_cert, "ssl_keyfile": config.http_tls_key} if config.http_tls_cert else {}
    server = None

    def stop() -> None:
        server.should_exit = True

    app = create_app(config, tokenizer, tokenizer_fingerprint(tokenizer), on_fatal=stop)
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level="warning", timeout_graceful_shutdown=10, **https
        )
    )
    log.info("listening on http://%s:%d (503 until the verify service answers)", config.host, config.port)
    server.run()
    if tracing is not None:
        tracing.shutdown()  # flushes spans still buffered
    return 2 if app.state.gateway.fatal is not None else 0


if __name__ == "__main__":
    sys.exit(main())
