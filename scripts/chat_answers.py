"""A served chat model's own greedy answers, as text to train its Medusa heads on.

Medusa heads learn from the target's distribution over a text (specserve train-medusa); the
closer that text is to what the model writes when it serves, the more of their guesses it
keeps. This script asks a running OpenAI-compatible server (a specserve stack, say) chat
questions and writes each question with the model's greedy answer, in the model's chat
template, into text files for `specserve train-medusa --data DIR`.

The questions are built from text the model's package ships: templates ("Explain what {w}
means in a few sentences.") filled with words of its tokenizer's vocabulary, so no dataset is
needed. Answers are written every 30 s and at the end (10 a file, so that train-medusa's
held-out rule keeps about one file in 20 for scoring). Example, for SmolLM2:

    SPECSERVE_CACHE=/tmp/sscache specserve up --target smollm2 --port 8100 &
    python scripts/chat_answers.py --url http://127.0.0.1:8100 --tokenizer /tmp/sscache/models/smollm2 \\
        --out answers --minutes 25
    specserve train-medusa --target smollm2 --data answers --tokens 200000 --seq-len 256
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import httpx
from transformers import AutoTokenizer

from specserve.tools.workloads import chat_questions

PER_FILE = 10


def write(texts: list[str], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for start in range(0, len(texts), PER_FILE):
        (out / f"answers{start // PER_FILE:05d}.txt").write_text("\n".join(texts[start : start + PER_FILE]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="the server's base URL")
    parser.add_argument("--tokenizer", required=True, help="the model's directory (its tokenizer and chat template)")
    parser.add_argument("--out", required=True, type=Path, help="directory the text files go to")
    parser.add_argument("--model", default=None, help="the model's name on the server (default: its first)")
    parser.add_argument("--clients", type=int, default=16, help="requests at once")
    parser.add_argument("--minutes", type=float, default=25.0, help="how long to ask")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens an answer")
    parser.add_argument("--questions", type=int, default=5000, help="questions made (at most this many asked)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    model = args.model or httpx.get(f"{args.url}/v1/models", timeout=30).json()["data"][0]["id"]
    pending = chat_questions(tokenizer, args.questions, args.seed)[::-1]
    texts, made, lock = [], [0], threading.Lock()
    end = time.monotonic() + 60 * args.minutes

    def ask() -> None:
        with httpx.Client(timeout=600) as client:
            while time.monotonic() < end:
                with lock:
                    if not pending:
                        return
                    question = pending.pop()
                body = {"model": model, "messages": [{"role": "user", "content": question}],
                        "max_tokens": args.max_tokens, "temperature": 0}  # fmt: skip
                reply = client.post(f"{args.url}/v1/chat/completions", json=body)
                reply.raise_for_status()
                reply = reply.json()
                turns = [{"role": "user", "content": question},
                         {"role": "assistant", "content": reply["choices"][0]["message"]["content"]}]  # fmt: skip
                with lock:
                    texts.append(tokenizer.apply_chat_template(turns, tokenize=False))
                    made[0] += reply["usage"]["completion_tokens"]

    started = time.monotonic()
    threads = [threading.Thread(target=ask, daemon=True) for _ in range(args.clients)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        time.sleep(30)
        with lock:
            write(texts, args.out)
            print(f"{time.monotonic() - started:.0f} s: {len(texts)} answers, {made[0]} tokens", flush=True)
    write(texts, args.out)
    print(json.dumps({"answers": len(texts), "tokens": made[0], "out": str(args.out)}))


if __name__ == "__main__":
    main()
