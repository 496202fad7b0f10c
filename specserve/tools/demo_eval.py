"""`specserve eval-demo`: the demo pair's model-card figures, measured through a running
gateway on held-out stdlib code: mean accepted length per K and temperature, and how many
of the target's greedy continuations of held-out function headers tokenize as Python."""

from __future__ import annotations

import argparse
import io
import json
import sys
import tokenize
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from specserve.tools.workloads import code_completion_prompts, function_headers


def complete(client: httpx.Client, url: str, prompt: str, **body) -> dict:
    reply = client.post(f"{url}/v1/completions", json={"prompt": prompt, **body}, timeout=600)
    reply.raise_for_status()
    return reply.json()


def acceptance(url: str, prompts: list[str], k: int, temperature: float, max_tokens: int) -> dict:
    """Rounds of K drafts (adaptive K off), one request at a time: a stack on a CPU speculates
    only while a single request runs (--max-speculating-requests), so concurrent requests
    would measure target-only rounds."""
    speculation = {"num_speculative_tokens": k, "adaptive": False}
    body = {"max_tokens": max_tokens, "temperature": temperature, "speculation": speculation}
    with httpx.Client() as client:
        replies = [complete(client, url, prompt, seed=i, **body) for i, prompt in enumerate(prompts)]
    drafts = sum(r["usage"]["speculation"]["num_drafts"] for r in replies)
    draft_tokens = sum(r["usage"]["speculation"]["num_draft_tokens"] for r in replies)
    accepted = sum(r["usage"]["speculation"]["num_accepted_tokens"] for r in replies)
    return {
        "k": k,
        "temperature": temperature,
        "rounds": drafts,
        "mean_accepted_length": (accepted + drafts) / drafts if drafts else None,
        "acceptance_rate": accepted / draft_tokens if draft_tokens else None,
    }


def tokenize_check(source: str) -> str:
    """How the complete lines of source tokenize with the stdlib tokenizer: "ok"; "cut" where
    the only error is the end of the text inside an open string or bracket (a docstring
    longer than the token budget: Python so far, stopped by the cut); "error" otherwise."""
    complete_lines = source[: source.rfind("\n") + 1]
    try:
        list(tokenize.generate_tokens(io.StringIO(complete_lines).readline))
    except tokenize.TokenError as error:
        return "cut" if str(error.args[0]).startswith("EOF in multi-line") else "error"
    except (IndentationError, SyntaxError):
        return "error"
    return "ok"


def header_check(url: str, headers: list[str], max_tokens: int) -> dict:
    body = {"max_tokens": max_tokens, "temperature": 0}
    with httpx.Client() as client, ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda h: h + complete(client, url, h, **body)["choices"][0]["text"], headers))
    checks = [tokenize_check(text) for text in texts]
    return {
        "headers": len(headers),
        "tokenize_ok": checks.count("ok"),
        "cut_inside_string_or_bracket": checks.count("cut"),
        "errors": checks.count("error"),
        "samples": texts[:3],
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specserve eval-demo",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="a running gateway's base URL")
    parser.add_argument("--prompts", type=int, default=24, help="held-out code prompts per setting")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion")
    parser.add_argument("--output", default="bench-results/demo_eval.json", help="where the JSON goes")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    from specserve.ports import gateway_url

    args.url = gateway_url(args.url, "specserve eval-demo")
    if args.url is None:
        return 2
    prompts = code_completion_prompts(args.prompts)
    rows = []
    for temperature in (0.0, 0.8):
        for k in (2, 4, 8):
            rows.append(acceptance(args.url, prompts, k, temperature, args.max_tokens))
            row = rows[-1]
            if row["rounds"] == 0:
                print(f"K={k} T={temperature}: no speculative rounds (does the stack draft?)", flush=True)
                continue
            print(
                f"K={k} T={temperature}: mean accepted length {row['mean_accepted_length']:.2f} "
                f"(acceptance {row['acceptance_rate']:.2f}, {row['rounds']} rounds)",
                flush=True,
            )
    headers = header_check(args.url, function_headers(50), 64)
    print(
        f"greedy 64-token continuations of {headers['headers']} held-out headers that tokenize: "
        f"{headers['tokenize_ok']} "
        f"({headers['cut_inside_string_or_bracket']} more end inside an open string or bracket at the cut, "
        f"{headers['errors']} have other errors)"
    )
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"args": vars(args), "acceptance": rows, "headers": headers}, indent=2))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
