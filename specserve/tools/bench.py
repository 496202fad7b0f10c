"""`specserve bench`: how much faster speculative decoding answers than the target alone,
measured side by side in one run, and explained with docs/design.md's model.

Rows per (workload, temperature, clients): target-only through the stack (method "none"),
requests that name no method ("default": what the server chooses), speculative through the
stack for each K (and adaptive K), and, with one client, what a user
would run instead, in this process (tools/baselines.py): transformers' generate() of the target
alone (in float32 and float16) and with the draft as its assistant model, and with --llama-cpp
llama-cpp-python on the target's GGUF file, plain and with its prompt-lookup drafting.
Requests of every row interleave prompt by prompt (with several clients, block by block of
one request per client), so load elsewhere on the machine hits all rows alike: compare
ratios within one run, not absolute figures across runs. With several client counts the
report adds total and per-request tokens/s and inter-token latency by clients, and a plot.

A target without a draft (--draft none) has no draft_model or assistant-model rows: rows of
a method the stack does not serve are skipped with a line saying so.

For each speculative row, docs/design.md's decomposition of a round, every cost relative to one
target step t (the verifier's forward time per token of the "none" row): alpha (acceptance
rate), E (tau: tokens per round), K (mean draft tokens per drafted round), c (a draft step:
drafting time per draft token / t), v (the verify forward / t) and h (the rest of a round:
the decision, the services' bookkeeping, the wire and the gateway, / t); the speedup the
model predicts for decoding, E (1 + h0) / (K c + v + h), where h0 is the "none" row's own
overhead per token, next to the measured one (which also counts the time to first token).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx

from specserve.methods import registry
from specserve.methods.trees import TreeShape
from specserve.model.gguf import log_conversions, resolve_model
from specserve.paths import DEMO_DRAFT, DEMO_TARGET
from specserve.tools.baselines import (
    LLAMA_CPP_ROWS,
    LOCAL,
    TRANSFORMERS_ROWS,
    LlamaCpp,
    Transformers,
    extra_buffers_decode,
    load_llama_cpp,
    prompt_lookup_class,
)
from specserve.tools.bench_report import markdown, plots, verdicts

WORKLOADS = ("code", "thirdparty", "edit", "chat", "mixed", "template", "assistant")
# Workload assistant: what people ask a general chat model, outside the demo's code domain.
ASSISTANT_QUESTIONS = (
    "Explain why the sky is blue in a few sentences.",
    "How do I make a good cup of pour-over coffee at home?",
    "List five habits that help people sleep better.",
    "Write a short email to my landlord asking when the broken heater will be repaired.",
    "What is inflation? Give a simple definition.",
    "What is the difference between a virus and a bacterium?",
    "How should I prepare for a job interview?",
    "Suggest three ideas for a weekend trip with young children.",
    "Explain how vaccines train the immune system.",
    "Compare renting and buying a home: what are the main pros and cons of each?",
    "Write a polite message declining an invitation to a friend's birthday dinner.",
    "What were the main causes of the French Revolution?",
)


# ----------------------------------------------------------------------------- prompts


def workload_prompts(workload: str, count: int) -> list:
    """Prompts of a workload: strings for completions, message lists for chat (workloads chat
    and assistant, sent to /v1/chat/completions)."""
    from specserve.tools import workloads

    if workload == "code":
        return workloads.code_completion_prompts(count)
    if workload == "thirdparty":  # code the demo never saw: installed packages'
        return workloads.code_completion_prompts(count, sources=workloads.third_party_sources())
    if workload == "edit":
        return workloads.edit_prompts(count)
    if workload == "chat":
        return workloads.chat_prompts(count)
    if workload == "template":
        return workloads.template_prompts(count)
    if workload == "assistant":
        return [[{"role": "user", "content": question}] for question in ASSISTANT_QUESTIONS[:count]]
    if workload == "mixed":  # the three interleaved: what one server sees from many users
        parts = [workload_prompts(w, -(-count // 3)) for w in ("code", "edit", "chat")]
        return [p for group in zip(*parts) for p in group][:count]
    raise ValueError(f"unknown workload {workload!r}; choose from {', '.join(WORKLOADS)}")


# ----------------------------------------------------------------------------- rows


@dataclass
class Row:
    workload: str
    temperature: float
    clients: int
    method: str  # none, default (requests that name no method), one of SPECULATIVE, or one of LOCAL
    k: int = 0  # draft tokens per round (llama_cpp_lookup: its num_pred_tokens)
    dtype: str = ""  # of the transformers rows' models
    adaptive: bool = False
    pipeline: bool = False
    min_draft_probability: float = 0.0
    tree: str = ""  # a token tree's shape as given (--tree); "": chains
    lookahead: str = ""  # method lookahead's "W,N,G" as given (--lookahead); "": the verifier's defaults
    key: str = ""  # the API key its requests send: a tenant of its own (what method suffix shares)
    requests: int = 0
    completion_tokens: int = 0
    wall_seconds: float = 0.0
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    request_rates: list[float] = field(default_factory=list)  # each request's tokens/s, from its start
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    rounds: int = 0
    rounds_by_k: dict[str, int] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    accepted_per_position: list[int] = field(default_factory=list)
    batch_sizes: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[int, float]] = field(default_factory=list)  # one client: (tokens, seconds) per prompt
    request: dict = field(default_factory=dict)  # fields every request of the row sends besides its own

    @property
    def label(self) -> str:
        label = row_label(self.method, self.k, self.adaptive, self.pipeline, self.min_draft_probability)
        if self.tree:
            label = f"{self.method} tree {self.tree}" + (" adaptive" if self.adaptive else "")
        if self.method == "lookahead":
            label = f"lookahead W,N,G={self.lookahead or 'default'}" + (" paced" if self.adaptive else "")
        if self.method == "llama_cpp":
            label = "llama.cpp"
        if self.method == "llama_cpp_lookup":
            label = f"llama.cpp prompt lookup K={self.k}"
        return f"{label} {self.dtype}" if self.dtype else label

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_seconds if self.wall_seconds else 0.0

    def add_sample(self, tokens: int, seconds: float) -> None:
        """One request of an in-process row: one client, so its time adds to the row's."""
        self.requests += 1
        self.completion_tokens += tokens
        self.wall_seconds += seconds
        self.samples.append((tokens, seconds))

    def per_round(self, key: str) -> float:
        return self.timings.get(key, 0.0) / self.rounds if self.rounds else 0.0

    def add_usage(self, usage: dict) -> None:
        self.requests += 1
        self.completion_tokens += usage["completion_tokens"]
        for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            setattr(self, key, getattr(self, key) + usage["speculation"][key])
        timings = usage.get("timings", {})
        self.rounds += timings.get("rounds", 0)
        for key, value in timings.items():
            if isinstance(value, (int, float)) and key != "rounds":
                self.timings[key] = self.timings.get(key, 0.0) + value
        for size, count in timings.get("batch_sizes", {}).items():
            self.batch_sizes[size] = self.batch_sizes.get(size, 0) + count
        for k, count in timings.get("rounds_by_k", {}).items():
            self.rounds_by_k[k] = self.rounds_by_k.get(k, 0) + count
        positions = timings.get("accepted_per_position", [])
        self.accepted_per_position.extend([0] * (len(positions) - len(self.accepted_per_position)))
        for i, count in enumerate(positions):
            self.accepted_per_position[i] += count


def row_label(method: str, k: int, adaptive: bool = False, pipeline: bool = False, min_p: float = 0.0) -> str:
    if method in SPECULATIVE:
        size = f"adaptive from K={k}" if adaptive else f"K={k}"
        return f"{method} {size}" + (f" p>={min_p:g}" if min_p else "") + (" pipelined" if pipeline else "")
    return method


SPECULATIVE = registry.names()  # the stack's speculative rows: a method each
# API keys of a stack the bench starts: the warm-up's, then one per row.
ROW_KEYS = ("bench-warm-up", *(f"bench-row-{i}" for i in range(256)))
ADAPTIVE_MIN_PROBABILITY = 0.0


def analyse(row: Row, baseline: Row | None) -> dict:
    """docs/design.md's quantities for a row, against the target-only row of its group."""
    out = {"tokens_per_s": row.tokens_per_s}
    out["ttft_p50_ms"] = _pct(row.ttft, 50) * 1000 if row.ttft else None
    out["itl_p50_ms"] = _pct(row.itl, 50) * 1000 if row.itl else None
    out["itl_p99_ms"] = _pct(row.itl, 99) * 1000 if row.itl else None
    out["bytes_per_round"] = row.timings.get("wire_bytes", 0.0) / row.rounds if row.rounds else None
    if row.request_rates:
        out["per_request_tokens_per_s"] = sum(row.request_rates) / len(row.request_rates)
    if baseline is None or not baseline.tokens_per_s:
        return out
    out["measured_speedup"] = row.tokens_per_s / baseline.tokens_per_s
    step = baseline.per_round("verify_forward_seconds")  # one target step, t
    if not step or not row.rounds:
        return out
    out["target_step_ms"] = step * 1000
    out["h"] = _rest_of_round(row) / step  # the none row: its own overhead per token, h0
    if row.method not in SPECULATIVE or not row.num_drafts:
        return out
    tau = (row.num_accepted_tokens + row.rounds) / row.rounds  # target-only rounds (K = 0) count 1
    k = row.num_draft_tokens / row.num_drafts  # mean K of the rounds that drafted
    c = row.timings.get("draft_server_seconds", 0.0) / row.num_draft_tokens / step
    v = row.per_round("verify_forward_seconds") / step
    h0 = _rest_of_round(baseline) / step
    drafted = row.num_drafts / row.rounds
    out.update(alpha=row.num_accepted_tokens / row.num_draft_tokens, tau=tau, mean_k=k, c=c, v=v,
               mean_accepted_length=(row.num_accepted_tokens + row.num_drafts) / row.num_drafts,
               predicted_speedup=tau * (1 + h0) / (drafted * k * c + v + out["h"]))  # fmt: skip
    return out


def _rest_of_round(row: Row) -> float:
    """Seconds per round outside the draft and the verify forward: the decision, the
    services' bookkeeping, the wire and the gateway."""
    total = row.per_round("draft_seconds") + row.per_round("verify_seconds")
    return total - row.per_round("draft_server_seconds") - row.per_round("verify_forward_seconds")


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


# ----------------------------------------------------------------------------- stack rows


class NotServed(RuntimeError):
    """The gateway's 400 for a speculation method its stack does not serve; the message names
    those it does."""


def stream_chunks(reply: httpx.Response):
    """The JSON chunks of a streamed completion (its SSE data lines); an error chunk raises."""
    if reply.status_code != 200:
        body = reply.read().decode()
        error = _error_of(body)
        if reply.status_code == 400 and error.get("param") == "speculation.method":
            raise NotServed(error.get("message", body))
        raise RuntimeError(f"{reply.request.url.path} answered {reply.status_code}: {body[:300]}")
    for line in reply.iter_lines():
        if not line.startswith("data: {"):
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise RuntimeError(f"stream error: {chunk['error']['message']}")
        yield chunk


def stream_one(
    client: httpx.Client, url: str, prompt, row: Row, max_tokens: int, seed: int
) -> tuple[dict, float, list[float], float]:
    """One streamed request: (usage, time to first token, per-token gaps after it, seconds)."""
    speculation = {"method": row.method, **({"num_speculative_tokens": row.k} if row.k else {})}
    if row.method == "default":  # what the server does for a request that does not say
        speculation = None
    if row.method in SPECULATIVE:
        speculation.update(
            adaptive=row.adaptive, pipeline=row.pipeline, min_draft_probability=row.min_draft_probability
        )
    if row.tree:
        speculation["tree"] = TreeShape.parse(row.tree).paths()
    if row.lookahead:
        speculation["lookahead"] = dict(zip(("window", "ngram", "guesses"), map(int, row.lookahead.split(","))))
    headers = {"Authorization": f"Bearer {row.key}"} if row.key else {}
    body = {**row.request, "max_tokens": max_tokens, "temperature": row.temperature, "seed": seed, "stream": True,
            "stream_options": {"include_usage": True}, "return_timings": True, "return_token_ids": True,
            "speculation": speculation}  # fmt: skip
    if (row.adaptive or row.method == "default") and row.temperature > 0:
        del body["seed"]  # a seeded sampled request keeps a fixed K: an adaptive row would not be one
    if speculation is None:
        del body["speculation"]
    path = "/v1/chat/completions" if isinstance(prompt, list) else "/v1/completions"
    body["messages" if isinstance(prompt, list) else "prompt"] = prompt
    started = time.perf_counter()
    arrivals, usage = [], None  # (seconds since the start, tokens) of each chunk with tokens
    with client.stream("POST", f"{url}{path}", json=body, headers=headers, timeout=600) as reply:
        for chunk in stream_chunks(reply):
            if chunk.get("usage"):
                usage = chunk["usage"]
            tokens = sum(len(c.get("token_ids", [])) for c in chunk.get("choices", []))
            if tokens:
                arrivals.append((time.perf_counter() - started, tokens))
    first, gaps = token_gaps(arrivals)
    return usage, first, gaps, time.perf_counter() - started


def _error_of(body: str) -> dict:
    """The "error" object of an answer in OpenAI's shape; {} where the body is not one."""
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return {}
    return error if isinstance(error, dict) else {}


BURST_S = 0.001  # chunks this close together came out of one round (the gateway sends a chunk per token)


def token_gaps(arrivals: list[tuple[float, int]]) -> tuple[float, list[float]]:
    """(time to the first token, per-token gaps after it) from the chunks' arrivals: the chunks
    of one round, a token each, arrive together, and a round's time is spread over its tokens."""
    bursts: list[list[float]] = []  # [first chunk's arrival, last chunk's, tokens]
    for at, tokens in arrivals:
        if bursts and at - bursts[-1][1] < BURST_S:
            bursts[-1][1], bursts[-1][2] = at, bursts[-1][2] + tokens
        else:
            bursts.append([at, at, tokens])
    if not bursts:
        return 0.0, []
    first, gaps = bursts[0][0], []
    for before, burst in zip(bursts, bursts[1:]):
        gaps.extend([(burst[0] - before[0]) / burst[2]] * int(burst[2]))
    return first, gaps


def run_stack_row(url: str, prompts: list, row: Row, max_tokens: int) -> None:
    with httpx.Client(limits=httpx.Limits(max_connections=row.clients)) as client:
        started = time.perf_counter()
        with ThreadPoolExecutor(row.clients) as pool:
            results = list(
                pool.map(lambda ip: stream_one(client, url, ip[1], row, max_tokens, ip[0]), enumerate(prompts))
            )
        row.wall_seconds += (time.perf_counter() - started) if row.clients > 1 else 0.0
    for usage, ttft, gaps, seconds in results:
        row.add_usage(usage)
        row.ttft.append(ttft)
        row.itl.extend(gaps)
        row.request_rates.append(usage["completion_tokens"] / seconds if seconds else 0.0)
        if row.clients == 1:  # one client: the sum of its request times
            row.wall_seconds += seconds
            row.samples.append((usage["completion_tokens"], seconds))


# ----------------------------------------------------------------------------- the run


def has_draft(args) -> bool:
    """Whether the target has a draft model: --draft none (or empty) serves it alone."""
    return default_draft(args) not in ("", "none")


def default_draft(args) -> str:
    """--draft as given, or what `specserve up` takes without one: the demo draft with the demo
    target, else none."""
    if args.draft is not None:
        return args.draft
    return str(DEMO_DRAFT) if Path(args.target).resolve() == DEMO_TARGET.resolve() else "none"


def plan_rows(args) -> list[Row]:
    rows = []
    for workload in args.workloads:
        for temperature in args.temperatures:
            for clients in args.concurrency:
                if getattr(args, "stack", True):
                    rows += stack_rows(args, workload, temperature, clients)
                if clients == 1:
                    rows += local_rows(args, workload, temperature)
    return rows


def stack_rows(args, workload: str, temperature: float, clients: int) -> list[Row]:
    """The rows of one group served by the stack: target-only, requests that name no method
    (what the server chooses, seeded when greedy only), then the speculative ones."""
    rows = [Row(workload, temperature, clients, "none"), Row(workload, temperature, clients, "default")]
    chains = [method for method in args.methods if method != "lookahead"]
    rows += [Row(workload, temperature, clients, method, k) for method in chains for k in args.k]
    if "lookahead" in args.methods:  # its rounds are its shape's, not a K's
        rows += [Row(workload, temperature, clients, "lookahead", lookahead=shape) for shape in args.lookahead]
    if args.adaptive:  # what a request that does not say gets: a row per method
        min_p = args.adaptive_min_probability
        rows += [
            Row(workload, temperature, clients, method, max(args.k), adaptive=True, min_draft_probability=min_p)
            for method in chains
        ]
        if "lookahead" in args.methods:  # paced: target-only stretches where it does not pay
            rows.append(Row(workload, temperature, clients, "lookahead", adaptive=True))
    if args.pipeline:
        rows += [Row(workload, temperature, clients, "draft_model", k, pipeline=True) for k in args.k]
    tree_methods = [m for m in args.methods if m in registry.tree_methods()] or ["draft_model"]
    for tree, method in ((tree, method) for tree in args.tree for method in tree_methods):
        size = len(TreeShape.parse(tree))
        rows.append(Row(workload, temperature, clients, method, size, tree=tree))
        if args.adaptive:
            rows.append(Row(workload, temperature, clients, method, max(args.k), adaptive=True, tree=tree))
    return rows


def local_rows(args, workload: str, temperature: float) -> list[Row]:
    """The in-process rows of one group (one client): transformers' generate(), with the
    draft as assistant where there is one, and llama.cpp with --llama-cpp."""
    rows = []
    if args.transformers:
        rows += [Row(workload, temperature, 1, "hf_target", dtype=dtype) for dtype in args.hf_dtypes]
        if has_draft(args):
            rows.append(Row(workload, temperature, 1, "hf_assisted", dtype=args.hf_dtypes[0]))
    if getattr(args, "llama_cpp", None):
        rows.append(Row(workload, temperature, 1, "llama_cpp"))
        if args.llama_cpp_lookup > 0:
            rows.append(Row(workload, temperature, 1, "llama_cpp_lookup", args.llama_cpp_lookup))
    return rows


def run(args, url: str | None, metrics_port: int | None = None) -> list[Row]:
    """Every row, interleaved prompt by prompt; metrics_port: the drafting service's metrics,
    where the bench started the stack; url None: no stack (--no-stack), in-process rows only."""
    from tqdm import tqdm

    rows = plan_rows(args)
    for row in rows:
        row.request = dict(getattr(args, "request", {}))
    if getattr(args, "row_keys", False):  # each row a tenant of its own: no row drafts from another's answers
        assert len(rows) < len(ROW_KEYS), f"at most {len(ROW_KEYS) - 1} rows"
        for row, key in zip(rows, ROW_KEYS[1:]):
            row.key = key
    prompts = {w: workload_prompts(w, args.prompts) for w in args.workloads}
    local = LocalRunners.load(args, [p for group in prompts.values() for p in group])
    local.warm_up(rows, prompts[args.workloads[0]][:1])
    if url is not None:
        rows = warm_up(args, url, rows, prompts[args.workloads[0]][0])
    if metrics_port is not None:
        wait_for_compiled_steps(metrics_port, time.monotonic() + 300)
    # Interleave: prompt by prompt, every row of a group gets its turn.
    steps = [(row, [p]) for i in range(args.prompts) for row in rows
             for p in [prompts[row.workload][i % len(prompts[row.workload])]] if row.clients == 1]  # fmt: skip
    steps += load_steps([row for row in rows if row.clients > 1], prompts)
    for row, batch in tqdm(steps, desc="bench", unit="step", file=sys.stderr):
        if row.method in LOCAL:
            for sample in local.run(batch, row, args.max_tokens):
                row.add_sample(*sample)
        else:
            run_stack_row(url, batch, row, args.max_tokens)
    return rows


def load_steps(rows: list[Row], prompts: dict[str, list]) -> list[tuple[Row, list]]:
    """The steps of the rows with several clients: each row's prompts (repeated to fill its
    clients at least once) in blocks of one request per client, the rows of a client count
    taking turns block by block, so that the machine's drift hits them alike. Each client
    count starts with every row's first block sent once for a spare copy of the row, whose
    figures are not kept: the first batches of a size pay for the verifier's lazy work, which
    made target-only, the first row of a group, up to 1.5x slower at 4 and 12 greedy
    clients on SmolLM2 (docs/benchmarks.md)."""
    steps = []
    for clients in sorted({row.clients for row in rows}):
        group = [row for row in rows if row.clients == clients]
        blocks = {}
        for row in group:
            asked = prompts[row.workload] * max(1, -(-clients // len(prompts[row.workload])))
            blocks[id(row)] = [asked[i : i + clients] for i in range(0, len(asked), clients)]
        steps += [(copy.deepcopy(row), blocks[id(row)][0]) for row in group]  # warm-up blocks, not kept
        for i in range(max(len(b) for b in blocks.values())):
            steps += [(row, blocks[id(row)][i]) for row in group if i < len(blocks[id(row)])]
    return steps


def warm_up(args, url: str, rows: list[Row], prompt) -> list[Row]:
    """The stack's rows that it serves, after a short request of each method and K, greedy and
    sampled where rows sample: the first calls pay for lazy initialisation, and a draft's
    first greedy or sampled rounds of each K start compiling its runs of that kind. A method
    the stack does not serve (the gateway's 400) drops its rows, with one line saying so."""
    key = ROW_KEYS[0] if getattr(args, "row_keys", False) else ""
    firsts = {(row.method, row.k, row.adaptive, row.temperature > 0): row for row in rows if row.method not in LOCAL}
    unserved: dict[str, str] = {}
    with httpx.Client() as client:
        for row in firsts.values():
            if row.method in unserved:
                continue
            try:
                stream_one(client, url, prompt, replace(row, clients=1, key=key), 16, 0)
            except NotServed as error:
                unserved[row.method] = str(error)
    for method, reason in unserved.items():
        print(f"skipping the {method} rows: {reason}", file=sys.stderr)
    return [row for row in rows if row.method not in unserved]


@dataclass
class LocalRunners:
    """What runs the in-process rows: transformers' models and llama.cpp's, where asked for."""

    transformers: Transformers | None = None
    llama_cpp: LlamaCpp | None = None

    @classmethod
    def load(cls, args, prompts: list) -> LocalRunners:
        """The runners of args' rows; prompts: every prompt of the run (llama.cpp's context
        holds the longest)."""
        hf = None
        if args.transformers:
            hf = Transformers(args.target, default_draft(args) if has_draft(args) else None, args.hf_dtypes)
        llama = None
        if getattr(args, "llama_cpp", None):
            args.llama_cpp_extra_buffers = extra_buffers_decode(args.llama_cpp)  # recorded in bench.json
            if not args.llama_cpp_extra_buffers:
                why = "llama.cpp's extra buffer types (AMX, repacked weights) crash a decode on this machine"
                print(f"{why}: the llama.cpp rows keep their weights in plain CPU buffers", file=sys.stderr)
            llama = load_llama_cpp(
                args.llama_cpp,
                args.target,
                args.llama_cpp_threads,
                args.llama_cpp_lookup,
                prompts,
                args.max_tokens,
                tokenizer=hf.tokenizer if hf else None,
                extra_buffers=args.llama_cpp_extra_buffers,
            )
            same = len(prompts) - llama.mismatched_prompts(prompts)
            note = f"llama.cpp's tokenizer splits {same} of {len(prompts)} prompts as the target's does"
            print(f"{note} (every row is fed the target's ids)", file=sys.stderr)
        return cls(hf, llama)

    def run(self, prompts: list, row: Row, max_tokens: int) -> list:
        """(completion tokens, seconds) of each prompt of an in-process row."""
        if row.method in TRANSFORMERS_ROWS:
            assisted = row.method == "hf_assisted"
            return self.transformers.run(prompts, row.dtype, assisted, row.temperature, max_tokens)
        return self.llama_cpp.run(prompts, row.method, row.temperature, max_tokens)

    def warm_up(self, rows: list[Row], prompts: list) -> None:
        """A short greedy request of each llama.cpp row: its first pays for mapping the file in."""
        for method in dict.fromkeys(row.method for row in rows if row.method in LLAMA_CPP_ROWS):
            self.llama_cpp.run(prompts, method, 0.0, 16)


def results(rows: list[Row]) -> list[dict]:
    out = []
    for row in rows:
        baseline = next((r for r in rows if (r.workload, r.temperature, r.clients, r.method) ==
                         (row.workload, row.temperature, row.clients, "none")), None)  # fmt: skip
        single = next((r for r in rows if (r.workload, r.temperature, r.label) ==
                       (row.workload, row.temperature, row.label) and r.clients == 1), None)  # fmt: skip
        record = {"workload": row.workload, "temperature": row.temperature, "clients": row.clients,
                  "method": row.method, "k": row.k, "dtype": row.dtype, "adaptive": row.adaptive,
                  "pipeline": row.pipeline, "min_draft_probability": row.min_draft_probability, "label": row.label,
                  "requests": row.requests, "completion_tokens": row.completion_tokens,
                  **analyse(row, baseline)}  # fmt: skip
        record["rounds"] = row.rounds
        generate = fastest(rows, row, ("hf_target",))
        if generate:
            record["vs_generate"] = row.tokens_per_s / generate
        if single is not None and single.tokens_per_s:
            record["vs_one_client"] = row.tokens_per_s / single.tokens_per_s
        if baseline is not None and row is not baseline and row.clients == 1:
            record["speedup_band"] = speedup_band(row, baseline)
        record["ms_per_round"] = {k: row.per_round(k) * 1000 for k in
                                  ("draft_server_seconds", "draft_seconds", "verify_forward_seconds",
                                   "verify_kernel_seconds", "verify_mask_seconds", "verify_seconds",
                                   "wire_seconds")}  # fmt: skip
        record["rounds_by_k"] = row.rounds_by_k
        positions = row.accepted_per_position
        record["acceptance_by_position"] = [n / row.num_drafts for n in positions] if row.num_drafts else []
        record["batch_sizes"] = row.batch_sizes
        if row.method in SPECULATIVE and row.rounds:  # the others: target-only stretches, or nothing to propose
            record["drafted_rounds"] = row.num_drafts / row.rounds
        if row.pipeline:  # the rounds whose drafts were ready: the guess held
            record["pipelined_fraction"] = row.per_round("pipelined_rounds")
        out.append(record)
    return out


def fastest(rows: list[Row], row: Row, methods: tuple[str, ...]) -> float:
    """The highest tokens/s of the rows of methods in row's group; 0 where there is none."""
    group = (row.workload, row.temperature, row.clients)
    speeds = [r.tokens_per_s for r in rows if r.method in methods and (r.workload, r.temperature, r.clients) == group]
    return max(speeds, default=0.0)


def speedup_band(row: Row, baseline: Row, draws: int = 2000) -> tuple[float, float] | None:
    """A 90% interval of row's tokens/s over baseline's, by resampling the prompts (each
    prompt ran in both rows, one after the other, so the machine's drift cancels)."""
    import random

    pairs = list(zip(row.samples, baseline.samples))
    if len(pairs) < 3 or len(row.samples) != len(baseline.samples):
        return None
    rng = random.Random(0)
    ratios = []
    for _ in range(draws):
        picked = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        seconds = (sum(a[1] for a, _ in picked), sum(b[1] for _, b in picked))
        theirs_tokens = sum(b[0] for _, b in picked)
        if not all(seconds) or not theirs_tokens:
            continue  # a resample of requests that made nothing
        ratios.append((sum(a[0] for a, _ in picked) / seconds[0]) / (theirs_tokens / seconds[1]))
    if len(ratios) < draws // 2:
        return None
    ratios.sort()
    return ratios[int(0.05 * len(ratios))], ratios[int(0.95 * len(ratios)) - 1]


def start_stack(args, with_ports: bool = False):
    """`specserve up` on free loopback ports; returns (process, url) (and the ports)."""
    import socket
    import subprocess

    def free() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    draft_service = getattr(args, "draft_service", False)
    ports = {"gateway": free(), "draft": free(), "verify": free(), "draft_metrics": free(), "verify_metrics": free()}
    command = [sys.executable, "-m", "specserve.cli", "up", "--port", str(ports["gateway"]),
               "--draft-port", str(ports["draft"]), "--verify-port", str(ports["verify"]),
               "--draft-metrics-port", str(ports["draft_metrics"]),
               "--verify-metrics-port", str(ports["verify_metrics"]),
               "--target", args.target, "--draft", args.draft or "none", "--device", args.device,
               "--max-speculating-requests", getattr(args, "max_speculating_requests", "auto"),
               *(["--draft-service"] if draft_service else []),
               *(["--copy-min-ngram", str(args.copy_min_ngram)] if getattr(args, "copy_min_ngram", None) is not None
                 else []),
               *(["--medusa", args.medusa] if getattr(args, "medusa", None) is not None else []),
               *(["--eagle", args.eagle] if getattr(args, "eagle", None) is not None else [])]  # fmt: skip
    keys = {"SPECSERVE_GATEWAY_API_KEYS": ",".join(ROW_KEYS)} if getattr(args, "row_keys", False) else {}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, env={**os.environ, **keys})
    url = f"http://127.0.0.1:{ports['gateway']}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit("the stack exited during start-up")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                wait_for_compiled_steps(ports["draft_metrics" if draft_service else "verify_metrics"], deadline)
                return (process, url, ports) if with_ports else (process, url)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    process.terminate()
    raise SystemExit("the stack did not become healthy")


def wait_for_compiled_steps(metrics_port: int, deadline: float) -> None:
    """Until the drafts have built their compiled steps (specserve:drafter_compiling_steps is 0
    on the metrics port of the service that drafts), which takes a core for seconds after
    start-up: measuring meanwhile skews every row."""
    said = False
    while time.monotonic() < deadline:
        text = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=2).text
        compiling = [line for line in text.splitlines() if line.startswith("specserve:drafter_compiling_steps ")]
        if not compiling or float(compiling[0].split()[1]) == 0:
            return
        if not said:
            print("waiting for the draft service to compile its steps", file=sys.stderr)
            said = True
        time.sleep(1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", help="a running gateway (its base URL); none: start the stack on --target/--draft")
    parser.add_argument(
        "--target",
        default=str(DEMO_TARGET),
        help="target model of a stack the bench starts: a directory or a named model (smollm2)",
    )
    parser.add_argument(
        "--draft",
        default=None,
        help="draft model of a stack the bench starts and of the assistant-model row, or none: the target alone, "
        "with no draft_model or hf_assisted rows (default: the demo draft with the demo target, else none)",
    )
    parser.add_argument(
        "--no-stack",
        dest="stack",
        action="store_false",
        help="start no stack and send nothing to one: the in-process rows only (transformers, llama.cpp)",
    )
    _add_stack_flags(parser)
    parser.add_argument(
        "--quick", action="store_true", help="code, T=0, K=4 and adaptive, one client: about a minute on the demo pair"
    )
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS, help="prompt sets")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8], help="0: greedy")
    parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8], help="fixed Ks, a row each")
    parser.add_argument(
        "--methods", nargs="+", default=["draft_model"], choices=SPECULATIVE, help="speculative methods"
    )
    parser.add_argument(
        "--adaptive", action="store_true", help="add a row per method with adaptive K (lookahead: paced)"
    )
    parser.add_argument("--adaptive-min-probability", type=float, default=ADAPTIVE_MIN_PROBABILITY,
                        help="the adaptive row's min_draft_probability: drafting stops below it")  # fmt: skip
    parser.add_argument("--pipeline", action="store_true", help="add pipelined draft_model rows for each K")
    parser.add_argument("--tree", nargs="+", default=[], metavar="SHAPE",
                        help="add a row per token tree (children per depth '2,1,1' or paths '[[0],[0,0],[1]]') "
                             "for each of --methods that drafts trees (else draft_model), and an adaptive one "
                             "with --adaptive")  # fmt: skip
    parser.add_argument("--lookahead", nargs="+", default=[""], metavar="W,N,G",
                        help="with --methods lookahead: a row per shape W,N,G ('' the verifier's)")  # fmt: skip
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="clients at once")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per workload")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    _add_baseline_flags(parser)
    parser.add_argument(
        "--request",
        type=_request_fields,
        default={},
        metavar="JSON",
        help="fields every request of the stack's rows sends, target-only's too, e.g. '{\"logprobs\": 1}' or a "
        "structured output '{\"response_format\": ...}' (transformers rows ignore them)",
    )
    parser.add_argument("--output", default="bench-results", help="directory for bench.json, bench.md and PNGs")
    return parser


def _add_stack_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a stack the bench starts, passed on to `specserve up`."""
    parser.add_argument("--medusa", default=None,
                        help="a stack the bench starts: `specserve up --medusa` "
                             "(default: the demo's heads with the demo target)")  # fmt: skip
    parser.add_argument("--eagle", default=None,
                        help="a stack the bench starts: `specserve up --eagle` (default: none)")  # fmt: skip
    parser.add_argument("--copy-min-ngram", type=int, default=None,
                        help="a stack the bench starts: `specserve up --copy-min-ngram` "
                             "(default: the services')")  # fmt: skip
    parser.add_argument("--device", default="auto", help="device of a stack the bench starts")
    parser.add_argument(
        "--max-speculating-requests",
        default="auto",
        help="of a stack the bench starts (`specserve up`'s): auto speculates on a CPU only while one request "
        "runs; 0 always speculates",
    )
    parser.add_argument("--draft-service", action="store_true",
                        help="a stack the bench starts drafts in a draft service of its own "
                             "(`specserve up --draft-service`)")  # fmt: skip


def _add_baseline_flags(parser: argparse.ArgumentParser) -> None:
    """The in-process rows' flags: transformers' generate() and llama.cpp."""
    parser.add_argument("--no-transformers", dest="transformers", action="store_false",
                        help="skip the in-process transformers rows")  # fmt: skip
    parser.add_argument(
        "--llama-cpp",
        metavar="GGUF_FILE",
        help="add llama-cpp-python rows on this GGUF file of the target (its tokenizer: --target's)",
    )
    parser.add_argument("--llama-cpp-threads", type=int, default=2, help="n_threads of the llama.cpp rows")
    parser.add_argument(
        "--llama-cpp-lookup",
        type=int,
        default=10,
        metavar="N",
        help="a llama.cpp row with prompt-lookup drafting of up to N tokens a round (0: none)",
    )
    parser.add_argument("--hf-dtypes", nargs="+", default=["float32", "float16"],
                        choices=["float32", "float16", "bfloat16"],
                        help="dtypes of the transformers rows' models (hf_assisted: the first)")  # fmt: skip


def check_local_rows(args) -> str:
    """Why args' in-process rows cannot run ("" where they can); says, in a line, which rows a
    target without a draft or an older llama-cpp-python leaves out."""
    if not args.stack and args.url:
        return "--no-stack sends nothing to --url: pass one or the other"
    if not args.stack and not args.transformers and not args.llama_cpp:
        return "--no-stack with --no-transformers and no --llama-cpp leaves no row to measure"
    if args.transformers and not has_draft(args):
        print("no draft: no transformers assistant-model (hf_assisted) row", file=sys.stderr)
    if not args.llama_cpp:
        return ""
    if not Path(args.llama_cpp).is_file():
        return f"--llama-cpp: no GGUF file at {args.llama_cpp}"
    if args.llama_cpp_threads < 1 or args.llama_cpp_lookup < 0:
        return "--llama-cpp-threads takes 1 or more, --llama-cpp-lookup 0 or more"
    try:
        lookup = prompt_lookup_class()
    except ImportError:
        return "--llama-cpp needs llama-cpp-python in this environment (pip install llama-cpp-python)"
    except (OSError, RuntimeError) as error:  # installed, but its shared library does not load
        return f"--llama-cpp: llama-cpp-python does not load: {error}"
    if lookup is None and args.llama_cpp_lookup > 0:
        print("this llama-cpp-python has no LlamaPromptLookupDecoding: no prompt-lookup row", file=sys.stderr)
        args.llama_cpp_lookup = 0
    return ""


def _request_fields(text: str) -> dict:
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("a JSON object of request fields")
    return fields


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    log_conversions()
    try:  # a named model (smollm2): its converted directory, which the in-process rows read too
        args.target = resolve_model(args.target)
    except ValueError as error:
        print(f"specserve bench: {error}", file=sys.stderr)
        return 2
    args.draft = default_draft(args)
    refused = check_local_rows(args)
    if refused:
        print(f"specserve bench: {refused}", file=sys.stderr)
        return 2
    if args.quick:
        args.workloads, args.temperatures, args.k, args.concurrency = ["code"], [0.0], [4], [1]
        args.adaptive = True
        args.prompts, args.max_tokens = min(args.prompts, 6), min(args.max_tokens, 64)
    if args.url:
        from specserve.ports import gateway_url

        args.url = gateway_url(args.url, "specserve bench")
        if args.url is None:
            return 2
    args.row_keys = not args.url  # a stack it starts serves each row under an API key of its own
    if args.url or not args.stack:  # --no-stack: url None
        process, url, ports = None, args.url, {}
    else:
        process, url, ports = start_stack(args, with_ports=True)
    try:
        records = results(
            run(args, url, ports.get("draft_metrics" if getattr(args, "draft_service", False) else "verify_metrics"))
        )
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=30)
    out_dir = Path(args.output)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = markdown(records)
    verdict = verdicts(records)
    table += f"\n\n{verdict}" if verdict else ""
    print(table)
    (out_dir / "bench.md").write_text(table + "\n")
    (out_dir / "bench.json").write_text(json.dumps({"args": vars(args), "rows": records}, indent=2))
    pictures = plots(records, out_dir)
    print(f"wrote {out_dir}/{', '.join(['bench.json', 'bench.md', *pictures])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
