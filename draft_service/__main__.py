"""`python -m draft_service`: load the draft model and serve DraftService."""

from __future__ import annotations

import logging
import sys

from draft_service.config import DraftConfig
from draft_service.servicer import SERVICE_NAME, DraftServicer
from specserve.config import parse_config, pin_to_cpus
from specserve.drafting import Drafter, DraftOptions
from specserve.model.loading import load_for_service
from specserve.model.runner import UnsupportedModel
from specserve.serving.batching import Batcher
from specserve.serving.grpc_server import busy_port, run_service
from specserve.serving.logs import setup_logging
from specserve.serving.metrics import ServiceMetrics
from specserve.serving.telemetry import setup_tracing
from specserve.v1 import draft_pb2_grpc

log = logging.getLogger("draft_service")


def main(argv: list[str] | None = None) -> int:
    config = parse_config(DraftConfig, "draft", argv, "specserve draft", "Serve the draft model (DraftService).")
    pin_to_cpus(config.cpus)  # before the service starts its threads; they inherit it
    setup_logging("draft")
    busy = busy_port(config, "specserve draft")
    if busy:
        log.error("%s", busy)
        return 2
    tracing = setup_tracing("specserve-draft", config.trace_console, config.trace_sample_ratio)
    # A draft need not be bitwise row-independent: verification keeps the output exact.
    try:
        models = {"draft_model": load_for_service(config, row_invariant=False, compile_steps=config.compile_steps)}
        if config.early_exit_model:
            models["early_exit"] = load_for_service(
                config,
                config.early_exit_model,
                config.early_exit_layers,
                row_invariant=False,
                compile_steps=config.compile_steps,
            )
    except (ValueError, OSError, UnsupportedModel) as error:  # no model, no tokenizer, an architecture not served
        log.error("refusing to start: %s", str(error).splitlines()[0])
        return 2
    loaded = models["draft_model"]
    metrics = ServiceMetrics("drafter")
    metrics.count_compiling(models)
    metrics.measure_kv_cache([m.backend for m in models.values()])
    metrics.serve(config.host, config.metrics_port)
    drafter = Drafter(models, DraftOptions.of(config, loaded), metrics)
    batcher = Batcher(drafter.step, config.max_batch, config.max_wait_ms / 1000, name="drafter", own_thread=False)
    servicer = DraftServicer(drafter, batcher, loaded, config, metrics)
    register = lambda server: draft_pb2_grpc.add_DraftServiceServicer_to_server(servicer, server)  # noqa: E731
    ready = lambda: all(m.backend.steps_built for m in models.values())  # noqa: E731 - health waits for compiles
    run_service(SERVICE_NAME, register, config, batcher, tracing, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
