"""Structured outputs through a running gateway, per method: whether every output parses and
validates against its schema, whether greedy speculative output equals greedy target-only
output token for token under the same schema, choices and a regex, and the speed: tokens
per second against target-only (the rows interleaved prompt by prompt), tokens a round, and
the grammar masks' ms a round beside the forward's. Prints a table and writes JSON.

    specserve up &        # or any stack: --target smollm2, ...
    python scripts/structured_check.py [--url http://127.0.0.1:8000] [--output structured.json]
"""

from __future__ import annotations

import argparse
import json
import re
import time

import httpx
import jsonschema

SCHEMAS = {
    "record": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "version": {"type": "integer", "minimum": 0, "maximum": 100},
            "stable": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["io", "net", "math", "text"]}, "maxItems": 4},
        },
        "required": ["name", "version", "stable", "tags"],
        "additionalProperties": False,
    },
    "call": {
        "type": "object",
        "properties": {
            "function": {"enum": ["open", "read", "write", "close"]},
            "arguments": {
                "type": "object",
                "properties": {"path": {"type": "string", "maxLength": 60}, "mode": {"enum": ["r", "w", "a"]}},
                "required": ["path", "mode"],
                "additionalProperties": False,
            },
        },
        "required": ["function", "arguments"],
        "additionalProperties": False,
    },
}
ASKS = {
    "response_format": lambda s: {
        "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": s}}
    },
    "structured_outputs": lambda s: {"structured_outputs": {"json": s}},
    "guided_json": lambda s: {"guided_json": s},
}
METHODS = {
    "none": {"method": "none"},
    "draft_model K=4": {"method": "draft_model", "num_speculative_tokens": 4, "adaptive": False},
    "draft_model": {"method": "draft_model"},
    "ngram K=4": {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False},
    "medusa K=3": {"method": "medusa", "num_speculative_tokens": 3, "adaptive": False},
    "lookahead": {"method": "lookahead"},
    "default": None,
}
PROMPTS = [
    "Describe the package in JSON. Package: requests, the HTTP library.\n",
    "import json\n\nCONFIG = ",
    "# The function call that opens the log file for appending, as JSON:\n",
    "def parse(text):\n    '''Return the record as a dict.'''\n",
    "Q: Give the metadata of numpy as JSON.\nA: ",
    "# settings.json\n",
]


def complete(client: httpx.Client, url: str, body: dict) -> dict:
    reply = client.post(f"{url}/v1/completions", json=body, timeout=600)
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.status_code}: {reply.text[:300]}")
    return reply.json()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.8])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--output", default="structured.json")
    args = parser.parse_args()
    served = httpx.get(f"{args.url}/v1/models").json()["data"][0]["id"]
    rows = {(m, t): {"tokens": 0, "seconds": 0.0, "rounds": 0, "mask": 0.0, "forward": 0.0, "valid": 0, "outputs": 0,
                     "finished": 0} for m in args.methods for t in args.temperatures}  # fmt: skip
    greedy: dict[tuple, dict[str, list[int]]] = {}
    with httpx.Client() as client:
        for prompt in PROMPTS:
            for schema_name, schema in SCHEMAS.items():
                for ask_name, ask in ASKS.items():
                    for temperature in args.temperatures:
                        for method in args.methods:  # interleaved: each prompt's rows one after another
                            body = {"model": served, "prompt": prompt, "max_tokens": args.max_tokens, "seed": 1,
                                    "temperature": temperature, "return_token_ids": True, "return_timings": True,
                                    **ask(schema)}  # fmt: skip
                            if METHODS[method] is not None:
                                body["speculation"] = METHODS[method]
                            started = time.perf_counter()
                            reply = complete(client, args.url, body)
                            seconds = time.perf_counter() - started
                            choice, usage = reply["choices"][0], reply["usage"]
                            row = rows[(method, temperature)]
                            row["outputs"] += 1
                            row["finished"] += choice["finish_reason"] == "stop"
                            row["valid"] += _valid(choice["text"], schema)
                            row["tokens"] += usage["completion_tokens"]
                            row["seconds"] += seconds
                            timings = usage.get("timings", {})
                            row["rounds"] += timings.get("rounds", 0)
                            row["mask"] += timings.get("verify_mask_seconds", 0.0)
                            row["forward"] += timings.get("verify_forward_seconds", 0.0)
                            if temperature == 0:
                                key = (prompt, schema_name, ask_name)
                                greedy.setdefault(key, {})[method] = choice["token_ids"]
        extras = _choices_and_regex(client, args.url, served, [METHODS[m] for m in args.methods])
    mismatched = [
        (key, method) for key, by in greedy.items() for method, ids in by.items() if ids != by.get("none", ids)
    ]
    _report(rows, mismatched, extras, len(greedy))
    with open(args.output, "w") as f:
        json.dump({"rows": [{"method": m, "temperature": t, **r} for (m, t), r in rows.items()],
                   "greedy_mismatches": [list(k) + [m] for k, m in mismatched], **extras}, f, indent=1)  # fmt: skip


def _valid(text: str, schema: dict) -> bool:
    try:
        jsonschema.validate(json.loads(text), schema)
    except (json.JSONDecodeError, jsonschema.ValidationError):
        return False
    return True


def _choices_and_regex(client: httpx.Client, url: str, served: str, methods: list) -> dict:
    choices = ["positive", "negative", "neutral"]
    made, matched = 0, 0
    for temperature in (0.0, 0.8, 1.0):
        for method in methods:
            for extra in ({"structured_outputs": {"choice": choices}}, {"guided_choice": choices},
                          {"guided_regex": r"[0-9]{3}-[0-9]{4}"}):  # fmt: skip
                body = {"model": served, "prompt": "The answer: ", "max_tokens": 16, "temperature": temperature,
                        **({"speculation": method} if method else {}), **extra}  # fmt: skip
                text = complete(client, url, body)["choices"][0]["text"]
                made += 1
                matched += (
                    text in choices if "regex" not in str(extra) else bool(re.fullmatch(r"[0-9]{3}-[0-9]{4}", text))
                )
    return {"choice_and_regex_outputs": made, "choice_and_regex_matched": matched}


def _report(rows: dict, mismatched: list, extras: dict, greedy_cases: int) -> None:
    print("| method | T | tok/s | vs none | tokens/round | forward ms/round | masks ms/round | valid | finished |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (method, temperature), r in rows.items():
        rate = r["tokens"] / r["seconds"] if r["seconds"] else 0.0
        base = rows.get(("none", temperature))
        ratio = rate / (base["tokens"] / base["seconds"]) if base and base["seconds"] else float("nan")
        rounds = max(1, r["rounds"])
        print(f"| {method} | {temperature} | {rate:.1f} | {ratio:.2f}x | {r['tokens'] / rounds:.2f} | "
              f"{1000 * r['forward'] / rounds:.2f} | {1000 * r['mask'] / rounds:.3f} | {r['valid']}/{r['outputs']} | "
              f"{r['finished']}/{r['outputs']} |")  # fmt: skip
    print(f"greedy outputs unlike target-only's: {len(mismatched)} of {greedy_cases} cases x methods")
    print(f"choices and regexes matched: {extras['choice_and_regex_matched']} of {extras['choice_and_regex_outputs']}")


if __name__ == "__main__":
    main()
