"""What a `specserve bench` run's records say: the results table, where each stack row's
rounds spent their time, a verdict line per group, and the plots."""

from __future__ import annotations

from pathlib import Path

from specserve.methods import registry
from specserve.tools.baselines import LLAMA_CPP_ROWS, LOCAL


def verdicts(records: list[dict]) -> str:
    """One line per group of one client: the fastest speculative row against target-only,
    against the faster transformers row and the faster llama.cpp row, with its noise band and
    its decomposition."""
    lines = []
    groups = {(r["workload"], r["temperature"]) for r in records if r["clients"] == 1}
    for workload, temperature in sorted(groups):
        group = [r for r in records if (r["workload"], r["temperature"], r["clients"]) == (workload, temperature, 1)]
        speculative = [r for r in group if r["method"] in registry.names() and r.get("measured_speedup")]
        if not speculative:
            continue
        best = max(speculative, key=lambda r: r["tokens_per_s"])  # the fastest of noisy rows: its band says how sure
        band = best.get("speedup_band")
        line = f"verdict: {workload}, T={temperature}: {best['label']} {best['measured_speedup']:.2f}x target-only"
        if band:
            line += f" (90% band {band[0]:.2f}-{band[1]:.2f} over the prompts)"
        hf = [r["tokens_per_s"] for r in group if r["method"] == "hf_target" and r["tokens_per_s"]]
        if hf:
            line += f", {best['tokens_per_s'] / max(hf):.2f}x the faster transformers generate()"
        llama = [r["tokens_per_s"] for r in group if r["method"] in LLAMA_CPP_ROWS and r["tokens_per_s"]]
        if llama:
            line += f", {best['tokens_per_s'] / max(llama):.2f}x the faster llama.cpp row"
        if best.get("tau") is not None and best.get("c") is not None:
            line += (
                f"; a round makes {best['tau']:.2f} tokens and costs {best['mean_k']:.1f} draft steps of "
                f"{best['c']:.3f}, a verify of {best['v']:.2f} and {best['h']:.2f} of overhead, in target steps "
                f"(predicted {best['predicted_speedup']:.2f}x)"
            )
        lines.append(line)
    return "\n".join(lines)


def markdown(records: list[dict]) -> str:
    """The results table, then where each row's rounds spent their time."""
    header = "workload|T|clients|method|tokens/s|vs none|vs generate()|TTFT p50 ms|ITL p50/p99 ms|alpha|tau|K|c|v|h"
    header = [*header.split("|"), "predicted", "bytes/round"]
    lines = [_cells(header), "|" + "---|" * len(header)]
    for r in records:
        method = r["label"]
        if r.get("drafted_rounds", 1) < 0.9:
            method += f" ({r['drafted_rounds']:.0%} of rounds drafted)"
        cells = [r["workload"], r["temperature"], r["clients"], method, f"{r['tokens_per_s']:.1f}"]
        cells += [_f(r.get("measured_speedup"), unit="x"), _f(r.get("vs_generate"), unit="x")]
        cells += [_f(r.get("ttft_p50_ms"), 1), f"{_f(r.get('itl_p50_ms'), 1)}/{_f(r.get('itl_p99_ms'), 1)}"]
        cells += [_f(r.get("alpha")), _f(r.get("tau")), _f(r.get("mean_k"), 1), _f(r.get("c"), 3), _f(r.get("v"))]
        cells += [_f(r.get("h")), _f(r.get("predicted_speedup"), unit="x"), _f(r.get("bytes_per_round"), 0)]
        lines.append(_cells(cells))
    load = load_table(records)
    return "\n".join(lines) + "\n\n" + round_split(records) + (f"\n\n{load}" if load else "")


def load_table(records: list[dict]) -> str:
    """Each stack row's throughput as the clients grow, where a run measured several counts:
    total tokens/s (and against target-only at that count), a request's own tokens/s and the
    inter-token latency a client saw."""
    stack = [r for r in records if r["method"] not in LOCAL]
    if len({r["clients"] for r in stack}) < 2:
        return ""
    header = "workload|T|method|clients|total tokens/s|vs none|a request's tokens/s|ITL p50 ms|ITL p99 ms".split("|")
    lines = [_cells(header), "|" + "---|" * len(header)]
    for r in sorted(stack, key=lambda r: (r["workload"], r["temperature"], r["label"], r["clients"])):
        cells = [r["workload"], r["temperature"], r["label"], r["clients"], f"{r['tokens_per_s']:.1f}"]
        cells += [_f(r.get("measured_speedup"), unit="x"), _f(r.get("per_request_tokens_per_s"), 1)]
        lines.append(_cells([*cells, _f(r.get("itl_p50_ms"), 1), _f(r.get("itl_p99_ms"), 1)]))
    return "\n".join(lines)


def _cells(values) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(value) for value in values) + " |"


def round_split(records: list[dict]) -> str:
    """ms per round of each stack row: drafting, the verify forward, the rest (decision,
    bookkeeping, wire, gateway), and the K each round verified; with structured outputs, the
    grammar's masks, made alongside the forward (not a part of the round's sum)."""
    header = "workload|T|clients|method|target step ms|draft|verify forward|rest|round|masks|rounds by K".split("|")
    lines = [_cells(header), "|" + "---|" * len(header)]
    for r in records:
        if r["method"] in LOCAL or not r.get("ms_per_round"):
            continue
        ms = r["ms_per_round"]
        total = ms["draft_seconds"] + ms["verify_seconds"]
        rest = total - ms["draft_server_seconds"] - ms["verify_forward_seconds"]
        by_k = " ".join(f"{k}:{n}" for k, n in sorted(r.get("rounds_by_k", {}).items(), key=lambda kv: int(kv[0])))
        cells = [r["workload"], r["temperature"], r["clients"], r["label"], _f(r.get("target_step_ms"))]
        cells += [f"{ms['draft_server_seconds']:.2f}", f"{ms['verify_forward_seconds']:.2f}", f"{rest:.2f}"]
        lines.append(_cells([*cells, f"{total:.2f}", f"{ms.get('verify_mask_seconds', 0.0):.2f}", by_k]))
    return "\n".join(lines)


def plots(records: list[dict], out_dir: Path) -> list[str]:
    """speedup_vs_k.png and acceptance_by_position.png where there are draft_model rows, and
    latency_split.png where there are stack rows, in out_dir; the names of those written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = _plot_speculation(records, out_dir, plt) + _plot_latency_split(records, out_dir, plt)
    return made + _plot_throughput(records, out_dir, plt)


def _plot_throughput(records: list[dict], out_dir: Path, plt) -> list[str]:
    """Total tokens/s against clients, a line per stack row, a panel per (workload, T), where
    a run measured several client counts."""
    stack = [r for r in records if r["method"] not in LOCAL]
    groups = sorted({(r["workload"], r["temperature"]) for r in stack})
    if len({r["clients"] for r in stack}) < 2 or not groups:
        return []
    fig, axes = plt.subplots(1, len(groups), figsize=(6 * len(groups), 4), squeeze=False)
    for ax, (workload, temperature) in zip(axes[0], groups):
        group = [r for r in stack if (r["workload"], r["temperature"]) == (workload, temperature)]
        for label in dict.fromkeys(r["label"] for r in group):
            points = sorted((r["clients"], r["tokens_per_s"]) for r in group if r["label"] == label)
            ax.plot([c for c, _ in points], [t for _, t in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["clients"] for r in group}), [str(c) for c in sorted({r["clients"] for r in group})])
        ax.set_title(f"{workload}, T={temperature}")
        ax.set_xlabel("clients at once")
        ax.set_ylabel("total tokens/s")
        ax.legend(fontsize=7)
    return _saved(fig, out_dir / "throughput_vs_clients.png", plt)


def _saved(fig, path: Path, plt) -> list[str]:
    """Writes fig to path and closes it: [its file name]."""
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path.name]


def _plot_speculation(records: list[dict], out_dir: Path, plt) -> list[str]:
    """Speedup by K, and acceptance by draft position, of the one-client fixed-K draft_model
    rows, where there are any."""
    single = [
        r
        for r in records
        if r["clients"] == 1 and r["method"] == "draft_model" and not r["adaptive"] and not r["pipeline"]
    ]
    if not single:
        return []
    groups = sorted({(r["workload"], r["temperature"]) for r in single})
    fig, ax = plt.subplots(figsize=(6, 4))
    for workload, temperature in groups:
        points = sorted(
            (r["k"], r.get("measured_speedup", 0))
            for r in single
            if (r["workload"], r["temperature"]) == (workload, temperature)
        )
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=f"{workload}, T={temperature}")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(sorted({r["k"] for r in single}))  # the Ks measured, as integers
    ax.set_title("Speedup against target-only by K (one client)")
    ax.set_xlabel("K (draft tokens per round)")
    ax.set_ylabel("speedup vs target-only (same run)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "speedup_vs_k.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in single:
        if r["k"] == max(x["k"] for x in single) and r["acceptance_by_position"]:
            ax.plot(
                range(1, len(r["acceptance_by_position"]) + 1),
                r["acceptance_by_position"],
                marker="o",
                label=f"{r['workload']}, T={r['temperature']}",
            )
    ax.set_title("Acceptance by draft position (largest fixed K)")
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of rounds accepting it")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "acceptance_by_position.png", dpi=120)
    plt.close(fig)
    return ["speedup_vs_k.png", "acceptance_by_position.png"]


def _plot_latency_split(records: list[dict], out_dir: Path, plt) -> list[str]:
    """Where a round's time goes in each one-client stack row, per round and per token, where
    there are any."""
    stack_rows = [r for r in records if r["method"] not in LOCAL and r["clients"] == 1 and r.get("rounds")]
    if not stack_rows:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(12, max(3, 0.35 * len(stack_rows))), sharey=True)
    parts = [
        ("drafting", lambda m: m["draft_server_seconds"]),
        ("target forward", lambda m: m["verify_forward_seconds"]),
        ("decision", lambda m: m["verify_kernel_seconds"]),
        ("wire, queues, bookkeeping", _wire_and_bookkeeping),
    ]
    # A round of speculation makes several tokens: per token is what a user waits for.
    per_token = [r["rounds"] / max(1, r["completion_tokens"]) for r in stack_rows]
    for ax, scale, title in ((axes[0], [1.0] * len(stack_rows), "ms per round"), (axes[1], per_token, "ms per token")):
        for i, (name, value) in enumerate(parts):
            widths = [value(r["ms_per_round"]) * f for r, f in zip(stack_rows, scale)]
            lefts = [sum(p[1](r["ms_per_round"]) for p in parts[:i]) * f for r, f in zip(stack_rows, scale)]
            ax.barh(range(len(stack_rows)), widths, left=lefts, label=name)
        ax.set_title(title)
        ax.set_xlabel(title)
    names = [f"{r['workload']} T={r['temperature']} {r['label']}" for r in stack_rows]
    made = [f"{r['completion_tokens'] / r['rounds']:.1f} tokens/round" for r in stack_rows]
    axes[0].set_yticks(range(len(stack_rows)), [f"{name} ({tokens})" for name, tokens in zip(names, made)], fontsize=7)
    axes[1].legend(fontsize=8)
    fig.suptitle("Where a round's time goes, one client")
    fig.tight_layout()
    fig.savefig(out_dir / "latency_split.png", dpi=120)
    plt.close(fig)
    return ["latency_split.png"]


def _wire_and_bookkeeping(ms: dict) -> float:
    """ms of a round outside the drafting, the target's forward and the decision."""
    inside = ms["draft_server_seconds"] + ms["verify_forward_seconds"] + ms["verify_kernel_seconds"]
    return ms["draft_seconds"] + ms["verify_seconds"] - inside


def _f(value, digits=2, unit="") -> str:
    """A table cell: blank where there is no value."""
    return "" if value is None else f"{value:.{digits}f}{unit}"
