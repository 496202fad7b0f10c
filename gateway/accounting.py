"""What a request's rounds add up to: usage.speculation and usage.timings of its response,
and the gateway's metrics of every round."""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.rounds import Round
from specserve.serving.metrics import GatewayMetrics


@dataclass
class RoundTimings:
    """Where a request's round time went (usage.timings with return_timings): seconds as the
    gateway saw each call, the services' own share of it, and the verifier's batch sizes."""

    rounds: int = 0
    draft_seconds: float = 0.0
    draft_server_seconds: float = 0.0
    verify_seconds: float = 0.0
    verify_server_seconds: float = 0.0
    verify_forward_seconds: float = 0.0
    verify_kernel_seconds: float = 0.0
    verify_mask_seconds: float = 0.0  # structured outputs' grammar masks, alongside the forward
    wire_bytes: int = 0  # serialized draft and verify messages, both ways
    pipelined_rounds: int = 0  # rounds whose drafts were made while the previous one was verified
    batch_sizes: dict[int, int] = field(default_factory=dict)
    rounds_by_k: dict[int, int] = field(default_factory=dict)  # the K each round verified (0: target-only)
    accepted_per_position: list[int] = field(default_factory=list)  # rounds whose draft i was accepted

    def as_dict(self) -> dict:
        wire = (self.draft_seconds - self.draft_server_seconds) + (self.verify_seconds - self.verify_server_seconds)
        histograms = ("batch_sizes", "rounds_by_k")
        values = {name: getattr(self, name) for name in self.__dataclass_fields__ if name not in histograms}
        values.update({name: {str(k): v for k, v in sorted(getattr(self, name).items())} for name in histograms})
        return {**values, "wire_seconds": wire}


@dataclass
class SpeculationStats:
    """usage.speculation of a response: rounds with drafts, drafts sent, drafts kept."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    timings: RoundTimings = field(default_factory=RoundTimings)

    def as_dict(self) -> dict[str, int]:
        return {
            "num_drafts": self.num_drafts,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
        }


def account(round_: Round, stats: SpeculationStats, metrics: GatewayMetrics | None) -> None:
    timings = stats.timings
    timings.rounds += 1
    timings.draft_seconds += round_.draft_seconds
    timings.draft_server_seconds += round_.draft_server_seconds
    timings.verify_seconds += round_.verify_seconds
    timings.verify_server_seconds += round_.verify_server_seconds
    timings.verify_forward_seconds += round_.verify_forward_seconds
    timings.verify_kernel_seconds += round_.verify_kernel_seconds
    timings.verify_mask_seconds += round_.verify_mask_seconds
    timings.wire_bytes += round_.wire_bytes
    timings.pipelined_rounds += int(round_.pipelined)
    timings.batch_sizes[round_.batch_size] = timings.batch_sizes.get(round_.batch_size, 0) + 1
    timings.rounds_by_k[round_.k] = timings.rounds_by_k.get(round_.k, 0) + 1
    accepted = timings.accepted_per_position
    accepted.extend([0] * (round_.k - len(accepted)))
    for position in range(round_.num_accepted):
        accepted[position] += 1
    if round_.k:
        stats.num_drafts += 1
        stats.num_draft_tokens += round_.k
        stats.num_accepted_tokens += round_.num_accepted
    if metrics is not None:
        metrics.observe_round(
            round_.k, round_.num_accepted, round_.draft_seconds, round_.verify_seconds, round_.wire_seconds
        )
