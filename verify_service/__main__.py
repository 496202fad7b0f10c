"""`python -m verify_service`: load the target model and serve VerifyService."""

from __future__ import annotations

import logging
import sys
import threading
import time

import torch

from specserve.config import parse_config, pin_to_cpus
from specserve.drafting import Drafter, DraftOptions
from specserve.methods.eagle import load_head
from specserve.methods.eagle_drafts import EagleDrafting
from specserve.methods.early_exit import choose_layers
from specserve.methods.medusa import load_heads
from specserve.methods.medusa_drafts import MedusaDrafting
from specserve.model.linear import cpu_has_bf16
from specserve.model.loading import LoadedModel, load_for_service, load_tokenizer, tokenizer_fingerprint
from specserve.model.runner import UnsupportedModel
from specserve.serving.batching import Batcher
from specserve.serving.grpc_server import busy_port, run_service
from specserve.serving.logs import setup_logging
from specserve.serving.metrics import ServiceMetrics
from specserve.serving.telemetry import setup_tracing
from specserve.v1 import verify_pb2_grpc
from verify_service.config import VerifyConfig
from verify_service.engine import Verifier
from verify_service.jobs import SweepJob
from verify_service.local_drafts import LocalDrafting
from verify_service.servicer import SERVICE_NAME, VerifyServicer

log = logging.getLogger("verify_service")


def start_sweeper(batcher: Batcher, ttl_s: float) -> None:
    """Submits a SweepJob a few times per TTL, so idle sessions expire even with no traffic."""

    def sweep_forever() -> None:
        while True:
            time.sleep(min(30.0, ttl_s / 4))
            batcher.submit(SweepJob(time.monotonic()))

    threading.Thread(target=sweep_forever, name="session-sweeper", daemon=True).start()


class RefusedDraft(Exception):
    """A draft model the verifier cannot draft with for its target."""


def check_draft_tokenizer(config: VerifyConfig) -> None:
    """Before any model loads (the target may compile for half a minute): the draft model must
    share the target's tokenizer."""
    if not config.draft_model:
        return
    draft, target = (tokenizer_fingerprint(load_tokenizer(path)) for path in (config.draft_model, config.model))
    if draft != target:
        raise RefusedDraft(
            f"the draft model {config.draft_model} and the target model {config.model} have different vocabularies "
            f"(tokenizer fingerprints {draft} and {target}); speculative decoding needs a draft that shares the "
            "target's tokenizer"
        )


def colocated_drafting(config: VerifyConfig, target: LoadedModel, metrics: ServiceMetrics) -> LocalDrafting:
    """The verifier's own drafter: n-gram and suffix always, lookahead on the runner backend,
    the draft model, early exit and Medusa heads when asked."""
    models = {}
    if config.draft_model:
        # A draft need not be bitwise row-independent: verification keeps the output exact.
        models["draft_model"] = load_for_service(
            config, config.draft_model, row_invariant=False, compile_steps=config.compile_steps
        )
    layers = early_exit_layers(config, target)
    if layers:
        models["early_exit"] = load_for_service(
            config, config.model, layers, row_invariant=False, compile_steps=config.compile_steps
        )
    options = DraftOptions.of(config, target)  # the target's vocabulary: drafts are verified against it
    drafter_metrics = ServiceMetrics("drafter", metrics.registry)
    drafter_metrics.count_compiling(models)
    drafter = Drafter(models, options, drafter_metrics)
    lookahead = config.lookahead if target.backend.supports_trees else None  # its window is a token tree
    every_round = {"all": True, "uncopied": False}.get(config.lookahead_window_rounds, target.device.type == "cuda")
    medusa = medusa_drafting(config, target)
    eagle = eagle_drafting(config, target, options.support_size)
    return LocalDrafting(drafter, config.max_speculative_tokens, medusa, lookahead, every_round, eagle)


def early_exit_layers(config: VerifyConfig, target: LoadedModel) -> int:
    """The first layers method early_exit drafts with: as configured, or (-1) the count that
    measured agreement predicts pays best (specserve/methods/early_exit.py)."""
    if config.early_exit_layers >= 0:
        return config.early_exit_layers
    runner = getattr(target.backend, "runner", None)
    if runner is None or runner.spec.num_layers < 2:
        return 0  # early exit needs the runner, and a layer to leave out
    return choose_layers(runner, target.tokenizer).layers


def medusa_drafting(config: VerifyConfig, target: LoadedModel) -> MedusaDrafting | None:
    """The Medusa heads in config.medusa, checked against the target (HeadsMismatch, a
    ValueError, names the difference)."""
    if not config.medusa:
        return None
    runner = runner_for(target, "Medusa heads need")
    heads = load_heads(config.medusa, config.model, dtype=runner.dtype)
    log.info("Medusa heads: %d from %s", heads.config.num_heads, config.medusa)
    copy = config.copy_min_ngram > 0
    return MedusaDrafting(heads, runner.lm_head, config.ngram_max, copy, target.eos_token_ids)


def eagle_drafting(config: VerifyConfig, target: LoadedModel, support_size: int) -> EagleDrafting | None:
    """The EAGLE head in config.eagle, checked against the target (HeadsMismatch, a
    ValueError, names the difference)."""
    if not config.eagle:
        return None
    runner = runner_for(target, "an EAGLE head needs")
    head = load_head(config.eagle, config.model)
    log.info("EAGLE head from %s, drafting among %d tokens", config.eagle, head.config.draft_vocab)
    # A draft's dtype, not the target's: bfloat16 (int8 matrices on a CPU) where it is native.
    dtype = torch.bfloat16 if runner.device.type != "cpu" or cpu_has_bf16() else torch.float32
    return EagleDrafting(head, runner.embed, support_size, dtype)


def runner_for(target: LoadedModel, needs: str):
    """The target's runner, which the verifier's heads draft beside (ValueError without one)."""
    runner = getattr(target.backend, "runner", None)
    if runner is None:
        raise ValueError(f"{needs} the runner backend (this target is served by transformers)")
    return runner


def main(argv: list[str] | None = None) -> int:
    config = parse_config(VerifyConfig, "verify", argv, "specserve verify", "Serve the target model (VerifyService).")
    pin_to_cpus(config.cpus)  # before the service starts its threads; they inherit it
    setup_logging("verify")
    busy = busy_port(config, "specserve verify")
    if busy:
        log.error("%s", busy)
        return 2
    tracing = setup_tracing("specserve-verify", config.trace_console, config.trace_sample_ratio)
    try:
        check_draft_tokenizer(config)
    except (RefusedDraft, ValueError, OSError) as error:  # a mismatched pair, or no model at the path
        log.error("refusing to start: %s", error)
        return 2
    try:
        loaded = load_for_service(config, compile_steps=config.compile_steps)
    except (ValueError, OSError, UnsupportedModel) as error:  # no model, no tokenizer, an architecture not served
        log.error("refusing to start: %s", str(error).splitlines()[0])
        return 2
    metrics = ServiceMetrics("verifier")
    try:
        local = colocated_drafting(config, loaded, metrics)
    except (ValueError, OSError, UnsupportedModel) as error:  # e.g. early exit on the transformers backend
        log.error("refusing to start: %s", error)
        return 2
    metrics.measure_kv_cache([loaded.backend])
    metrics.serve(config.host, config.metrics_port)
    verifier = Verifier(loaded, config, metrics, local)
    batcher = Batcher(verifier.step, config.max_batch, config.max_wait_ms / 1000, name="verifier", own_thread=False)
    servicer = VerifyServicer(batcher, loaded, config, metrics, local.methods)
    start_sweeper(batcher, config.session_ttl_s)
    register = lambda server: verify_pb2_grpc.add_VerifyServiceServicer_to_server(servicer, server)  # noqa: E731
    drafts = list(local.drafter.models.values())
    ready = lambda: all(m.backend.steps_built for m in drafts)  # noqa: E731 - health waits for the drafts' steps
    run_service(SERVICE_NAME, register, config, batcher, tracing, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
