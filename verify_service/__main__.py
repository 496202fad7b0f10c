"""`python -m verify_service`: load the target model and serve VerifyService."""

from __future__ import annotations

import sys
import threading
import time

from specserve.batching import Batcher
from specserve.config import parse_config, pin_to_cpus
from specserve.grpc_server import run_service
from specserve.logs import setup_logging
from specserve.metrics import ServiceMetrics
from specserve.models import load_for_service
from specserve.telemetry import setup_tracing
from specserve.v1 import verify_pb2_grpc
from verify_service.config import VerifyConfig
from verify_service.engine import SweepJob, Verifier
from verify_service.servicer import SERVICE_NAME, VerifyServicer


def start_sweeper(batcher: Batcher, ttl_s: float) -> None:
    """Submits a SweepJob a few times per TTL, so idle sessions expire even with no traffic."""

    def sweep_forever() -> None:
        while True:
            time.sleep(min(30.0, ttl_s / 4))
            batcher.submit(SweepJob(time.monotonic()))

    threading.Thread(target=sweep_forever, name="session-sweeper", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    config = parse_config(VerifyConfig, "verify", argv, "specserve verify", "Serve the target model (VerifyService).")
    pin_to_cpus(config.cpus)  # before the service starts its threads; they inherit it
    setup_logging("verify")
    tracing = setup_tracing("specserve-verify", config.trace_console, config.trace_sample_ratio)
    loaded = load_for_service(config, compile_steps=config.compile_steps)
    metrics = ServiceMetrics("verifier")
    metrics.serve(config.host, config.metrics_port)
    verifier = Verifier(loaded, config, metrics)
    batcher = Batcher(verifier.step, config.max_batch, config.max_wait_ms / 1000, name="verifier", own_thread=False)
    servicer = VerifyServicer(batcher, loaded, config, metrics)
    start_sweeper(batcher, config.session_ttl_s)
    register = lambda server: verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)  # noqa: E731
    run_service(SERVICE_NAME, register, config, batcher, tracing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
