"""`specserve trace`: where a request's time goes, from the spans of a run.

Either listens for spans itself (an OTLP/gRPC endpoint: point the services'
OTEL_EXPORTER_OTLP_ENDPOINT at it, run some requests, stop it with Ctrl-C or --duration) or
reads spans it saved before (--input spans.json). Prints a per-hop latency table and writes
two PNGs: the waterfall of one request, and the mean time per round split by hop.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import threading
import time
from collections import defaultdict
from concurrent import futures
from pathlib import Path

import grpc

ROUND = "round"
DRAFT_CLIENT = "specserve.v1.DraftService/Draft propose"


class SpanCollector:
    """An OTLP/gRPC trace receiver that keeps the spans it is sent, as plain dicts."""

    def __init__(self, address: str):
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self
        self.spans: list[dict] = []
        self._lock = threading.Lock()

        class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                collector._add(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), self._server)
        self.port = self._server.add_insecure_port(address)
        if self.port == 0:
            raise SystemExit(f"could not listen on {address}")

    def start(self) -> SpanCollector:
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(1).wait()

    def snapshot(self) -> list[dict]:
        with self._lock:
            return list(self.spans)

    def _add(self, request) -> None:
        converted = [span for resource_spans in request.resource_spans for span in _spans_of(resource_spans)]
        with self._lock:
            self.spans.extend(converted)


def _spans_of(resource_spans) -> list[dict]:
    service = next(
        (a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"), "unknown"
    )
    out = []
    for scope_spans in resource_spans.scope_spans:
        for span in scope_spans.spans:
            out.append(
                {
                    "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(),
                    "parent_span_id": span.parent_span_id.hex(),
                    "name": span.name,
                    "kind": span.kind,
                    "service": service,
                    "start_ns": span.start_time_unix_nano,
                    "end_ns": span.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                }
            )
    return out


def _value(any_value):
    kind = any_value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    return getattr(any_value, kind) if kind else None


def duration_ms(span: dict) -> float:
    return (span["end_ns"] - span["start_ns"]) / 1e6


def hop_samples(spans: list[dict]) -> dict[str, list[float]]:
    """Milliseconds per hop. Hops are named by span, plus wire (draft and verify calls as the
    gateway saw them minus the services' own spans) and gateway (round minus both calls)."""
    children = defaultdict(list)
    for span in spans:
        children[span["parent_span_id"]].append(span)
    samples: dict[str, list[float]] = defaultdict(list)
    for span in spans:
        samples[f"{span['service']}: {span['name']}"].append(duration_ms(span))
    for round_span in (s for s in spans if s["name"] == ROUND):
        calls = children[round_span["span_id"]]
        client_ms = sum(duration_ms(c) for c in calls)
        server_ms = sum(duration_ms(s) for c in calls for s in children[c["span_id"]])
        samples["wire (calls minus service spans)"].append(client_ms - server_ms)
        samples["gateway (round minus calls)"].append(duration_ms(round_span) - client_ms)
    return samples


def table(samples: dict[str, list[float]]) -> str:
    lines = ["| hop | count | mean ms | p50 ms | p99 ms |", "|---|---|---|---|---|"]
    for name in sorted(samples, key=lambda n: -statistics.fmean(samples[n])):
        values = sorted(samples[name])
        p99 = values[min(len(values) - 1, int(0.99 * len(values)))]
        lines.append(
            f"| {name} | {len(values)} | {statistics.fmean(values):.2f} | {statistics.median(values):.2f} | {p99:.2f} |"
        )
    return "\n".join(lines)


def per_round_split(spans: list[dict]) -> dict[str, float]:
    """Mean ms per round: the draft service, the verifier's queue, forward and kernel, the
    rest of the verifier's call, the wire, and the gateway's own share."""
    children = defaultdict(list)
    for span in spans:
        children[span["parent_span_id"]].append(span)
    totals: dict[str, float] = defaultdict(float)
    rounds = [s for s in spans if s["name"] == ROUND]
    for round_span in rounds:
        calls = children[round_span["span_id"]]
        client_ms = 0.0
        for call in calls:
            client_ms += duration_ms(call)
            for server in children[call["span_id"]]:
                name = "draft service" if call["name"] == DRAFT_CLIENT else "verifier"
                inner = children[server["span_id"]]
                parts = {c["name"]: duration_ms(c) for c in inner}
                if name == "verifier":
                    for part in ("verifier.queue", "target.forward", "kernel.rejection_sample"):
                        totals[f"verifier: {part}"] += parts.get(part, 0.0)
                    totals["verifier: other"] += duration_ms(server) - sum(parts.values())
                else:
                    totals[name] += duration_ms(server)
            totals["wire"] += duration_ms(call) - sum(duration_ms(s) for s in children[call["span_id"]])
        totals["gateway"] += duration_ms(round_span) - client_ms
    return {name: value / len(rounds) for name, value in totals.items()} if rounds else {}


def plot_waterfall(spans: list[dict], trace_id: str, path: Path, max_spans: int = 60) -> None:
    """The request's spans on a time line (its first max_spans, by start time)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace_spans = sorted((s for s in spans if s["trace_id"] == trace_id), key=lambda s: s["start_ns"])
    chosen = trace_spans[:max_spans]
    origin = chosen[0]["start_ns"]
    services = sorted({s["service"] for s in chosen})
    colours = {service: plt.cm.tab10(i) for i, service in enumerate(services)}
    fig, ax = plt.subplots(figsize=(11, max(3, 0.22 * len(chosen))))
    for row, span in enumerate(chosen):
        ax.barh(row, duration_ms(span), left=(span["start_ns"] - origin) / 1e6, color=colours[span["service"]])
    ax.set_yticks(range(len(chosen)), [s["name"] for s in chosen], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the request arrived")
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=colours[s]) for s in services], services, fontsize=7)
    ax.set_title(f"one request: the first {len(chosen)} of its {len(trace_spans)} spans")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_round_split(split: dict[str, float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 2.6))
    left = 0.0
    for i, (name, value) in enumerate(sorted(split.items())):
        ax.barh(0, value, left=left, color=plt.cm.tab10(i % 10), label=f"{name} {value:.2f} ms")
        left += value
    ax.set_yticks([])
    ax.set_xlabel("mean ms per round")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def report(spans: list[dict], out_dir: Path) -> str:
    out_dir.mkdir(parents=True, exist_ok=True)
    samples = hop_samples(spans)
    text = table(samples)
    requests = [s for s in spans if s["attributes"].get("gen_ai.operation.name")]
    if requests:
        longest = max(requests, key=duration_ms)
        plot_waterfall(spans, longest["trace_id"], out_dir / "waterfall.png")
    split = per_round_split(spans)
    if split:
        plot_round_split(split, out_dir / "round_split.png")
        text += "\n\nmean ms per round: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(split.items()))
    return text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve trace",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--listen", default="127.0.0.1:4317", help="OTLP/gRPC address to receive spans on")
    parser.add_argument("--duration", type=float, default=0, help="seconds to listen (0: until Ctrl-C)")
    parser.add_argument("--input", help="read spans saved by an earlier run instead of listening")
    parser.add_argument("--out", default="bench-results/trace", help="directory for spans.json and the PNGs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    out_dir = Path(args.out)
    if args.input:
        try:
            spans = json.loads(Path(args.input).read_text())
        except (OSError, ValueError) as error:
            print(f"specserve trace: cannot read spans from {args.input}: {error}", file=sys.stderr)
            return 2
    else:
        from specserve.ports import busy_port_message

        host, _, port = args.listen.rpartition(":")
        busy = busy_port_message("specserve trace", host, int(port), "--listen") if port.isdigit() else None
        if busy:
            print(busy, file=sys.stderr)
            return 2
        spans = _listen(args.listen, args.duration)
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "spans.json").write_text(json.dumps(spans))
    if not spans:
        print("no spans received", file=sys.stderr)
        return 1
    print(report(spans, out_dir))
    print(f"wrote {out_dir}")
    return 0


def _listen(address: str, duration: float) -> list[dict]:
    collector = SpanCollector(address).start()
    print(f"listening for OTLP spans on {address}; set OTEL_EXPORTER_OTLP_ENDPOINT=http://{address}", file=sys.stderr)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait(duration or None)
    time.sleep(0.5)
    collector.stop()
    return collector.snapshot()


if __name__ == "__main__":
    sys.exit(main())
