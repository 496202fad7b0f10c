"""`specserve bench`'s rows beside the stack's: llama.cpp's (through a fake Llama, so that the
default test run needs no llama-cpp-python), a target without a draft, and the general chat
workload."""

from __future__ import annotations

import itertools
import json
import sys

import httpx
import pytest

from specserve.tools import bench
from specserve.tools.baselines import LlamaCpp, prompt_token_ids
from specserve.tools.bench_report import markdown, verdicts

BOS = 1
EOS = 2


class FakeTokenizer:
    """A character-level tokenizer with a chat template of its own."""

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [BOS] * add_special_tokens + [3 + ord(c) % 60 for c in text]}


class FakeLlama:
    """llama_cpp.Llama's surface that the bench uses: it answers `answer` over and over."""

    def __init__(self, answer: list[int]):
        self.answer = answer
        self.calls: list = []

    def reset(self):
        self.calls.append("reset")

    def set_seed(self, seed):
        self.calls.append(("seed", seed))

    def generate(self, tokens, **sampling):
        self.calls.append(("generate", list(tokens), sampling))
        yield from itertools.cycle(self.answer)

    def tokenize(self, text: bytes, add_bos: bool, special: bool):
        return FakeTokenizer()(text.decode(), add_special_tokens=False)["input_ids"]

    def token_bos(self):
        return BOS


def test_a_llama_cpp_row_is_fed_the_gateways_ids_and_counts_tokens_to_the_end_of_sequence():
    tokenizer = FakeTokenizer()
    plain, lookup = FakeLlama([10, 11, 12]), FakeLlama([10, EOS, 12])
    llama = LlamaCpp({"llama_cpp": plain, "llama_cpp_lookup": lookup}, tokenizer, (EOS,))
    chat = [{"role": "user", "content": "Why is the sky blue?"}]

    samples = llama.run([chat, "def f():"], "llama_cpp", 0.0, max_tokens=5)
    assert [s.tokens for s in samples] == [5, 5]  # no end of sequence: max_tokens each
    assert all(s.seconds >= 0 for s in samples)
    generated = [call for call in plain.calls if call[0] == "generate"]
    # chat: the template's text with no special tokens added; a completion: the tokenizer's own
    assert generated[0][1] == tokenizer("<user>Why is the sky blue?<assistant>", add_special_tokens=False)["input_ids"]
    assert generated[1][1] == [BOS, *tokenizer("def f():", add_special_tokens=False)["input_ids"]]
    assert generated[0][1] == prompt_token_ids(tokenizer, chat)
    # every request pays its whole prompt: the cache is forgotten before each
    assert [c for c in plain.calls if c == "reset" or c[0] == "generate"][::2] == ["reset", "reset"]
    assert generated[0][2] == {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0}

    sampled = llama.run([chat], "llama_cpp_lookup", 0.8, max_tokens=5)
    assert sampled[0].tokens == 2  # its end-of-sequence token counts, as generate()'s does
    assert [c for c in lookup.calls if c[0] == "generate"][0][2]["temp"] == 0.8
    assert ("seed", 0) in lookup.calls
    assert llama.mismatched_prompts([chat, "def f():"]) == 0


def args_of(*argv: str):
    return bench.build_parser().parse_args(list(argv))


def test_llama_cpp_rows_come_with_one_client_and_a_target_alone_has_no_assistant_row():
    group = ["--workloads", "assistant", "--temperatures", "0"]
    args = args_of("--llama-cpp", "m.gguf", "--draft", "none", *group, "--k", "4", "--concurrency", "1", "4")
    rows = bench.plan_rows(args)
    labels = [(row.clients, row.label) for row in rows]
    assert (1, "llama.cpp") in labels and (1, "llama.cpp prompt lookup K=10") in labels
    assert not [row for row in rows if row.clients == 4 and row.method in bench.LOCAL]
    assert "hf_assisted" not in {row.method for row in rows}
    assert {row.method for row in rows if row.clients == 4} == {"none", "default", "draft_model"}

    only = ["--no-stack", "--no-transformers", "--llama-cpp-lookup", "0"]
    alone = bench.plan_rows(args_of(*only, "--llama-cpp", "m.gguf", *group))
    assert [row.method for row in alone] == ["llama_cpp"]


def row_with(method: str, tokens: int, seconds: float, **fields) -> bench.Row:
    row = bench.Row("assistant", 0.0, 1, method, **fields)
    for _ in range(4):
        row.add_sample(tokens // 4, seconds / 4)
    return row


def test_the_records_and_the_table_give_llama_cpp_rows_their_ratios():
    rows = [
        row_with("none", 100, 10.0),
        row_with("draft_model", 300, 10.0, k=4),
        row_with("hf_target", 40, 10.0, dtype="float32"),
        row_with("hf_target", 80, 10.0, dtype="float16"),
        row_with("llama_cpp", 200, 10.0),
        row_with("llama_cpp_lookup", 240, 10.0, k=10),
    ]
    records = {r["label"]: r for r in bench.results(rows)}
    assert records["llama.cpp"]["tokens_per_s"] == pytest.approx(20.0)
    assert records["llama.cpp"]["measured_speedup"] == pytest.approx(2.0)  # against none
    assert records["llama.cpp"]["vs_generate"] == pytest.approx(2.5)  # against the faster generate() row
    assert records["llama.cpp prompt lookup K=10"]["vs_generate"] == pytest.approx(3.0)
    json.dumps(list(records.values()))

    table = markdown(list(records.values()))
    assert "vs generate()" in table.splitlines()[0]
    assert "| llama.cpp | 20.0 | 2.00x | 2.50x |" in table
    assert "| llama.cpp prompt lookup K=10 | 24.0 | 2.40x | 3.00x |" in table
    assert "1.25x the faster llama.cpp row" in verdicts(list(records.values()))  # draft_model 30 tokens/s over 24


def test_a_method_the_stack_does_not_serve_drops_its_rows_in_one_line(monkeypatch, capsys):
    message = "speculation.method 'draft_model' is not served here; available: ngram, none"
    answer = {
        "message": message,
        "type": "invalid_request_error",
        "param": "speculation.method",
        "code": "invalid_value",
    }
    reply = httpx.Response(400, json={"error": answer}, request=httpx.Request("POST", "http://gateway/v1/completions"))
    with pytest.raises(bench.NotServed, match="available: ngram, none"):
        list(bench.stream_chunks(reply))

    def stream_one(client, url, prompt, row, max_tokens, seed):
        if row.method == "draft_model":
            raise bench.NotServed(message)

    monkeypatch.setattr(bench, "stream_one", stream_one)
    group = ["--concurrency", "1", "--temperatures", "0", "--workloads", "assistant"]
    args = args_of("--draft", "none", "--methods", "draft_model", "ngram", "--k", "2", "4", "--adaptive", *group)
    kept = bench.warm_up(args, "http://gateway", bench.plan_rows(args), "prompt")
    assert {row.method for row in kept} == {"none", "default", "ngram", "hf_target"}
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"skipping the draft_model rows: {message}"]


def test_llama_cpp_rows_without_llama_cpp_python_are_a_clear_error(monkeypatch, tmp_path, capsys):
    gguf = tmp_path / "model.gguf"
    assert bench.main(["--llama-cpp", str(gguf)]) == 2
    assert "no GGUF file" in capsys.readouterr().err
    gguf.write_bytes(b"GGUF")
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # importing it raises ImportError
    assert bench.main(["--llama-cpp", str(gguf)]) == 2
    assert "needs llama-cpp-python" in capsys.readouterr().err


def test_the_assistant_workload_asks_general_questions_through_chat():
    prompts = bench.workload_prompts("assistant", 12)
    assert len(prompts) == 12 and len({p[0]["content"] for p in prompts}) == 12
    assert all(p == [{"role": "user", "content": p[0]["content"]}] for p in prompts)
    assert not any("def " in p[0]["content"] or "Python" in p[0]["content"] for p in prompts)
    assert len(bench.workload_prompts("assistant", 3)) == 3


def test_the_bench_measures_a_stack_and_an_in_process_row_side_by_side(stack, monkeypatch):
    group = ["--workloads", "assistant", "--temperatures", "0", "--concurrency", "1", "--prompts", "2"]
    args = args_of("--no-transformers", "--methods", "ngram", "--k", "2", *group, "--max-tokens", "4")
    args.llama_cpp, args.llama_cpp_lookup = "model.gguf", 0
    fake = LlamaCpp({"llama_cpp": FakeLlama([10, 11])}, FakeTokenizer(), (EOS,))
    monkeypatch.setattr(bench.LocalRunners, "load", classmethod(lambda cls, args, prompts: cls(None, fake)))
    rows = bench.run(args, stack.url)
    labels = [(row.label, row.requests) for row in rows]
    assert labels == [("none", 2), ("default", 2), ("ngram K=2", 2), ("llama.cpp", 2)]
    assert all(0 < row.completion_tokens <= 8 and row.wall_seconds > 0 for row in rows)
    assert rows[3].completion_tokens == 8  # the fake never ends its answer
    records = {r["label"]: r for r in bench.results(rows)}
    assert records["llama.cpp"]["measured_speedup"] == pytest.approx(rows[3].tokens_per_s / rows[0].tokens_per_s)


def test_a_default_row_names_no_method_and_a_sampled_one_no_seed(monkeypatch):
    """What a user sends: no speculation field; sampled without a seed, so the server may
    choose each round's K by the load."""
    sent = []

    class Reply:
        status_code = 200

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def iter_lines(self):
            usage = {"completion_tokens": 1, "speculation": {}}
            yield "data: " + json.dumps({"choices": [{"token_ids": [5]}], "usage": usage})

    class Client:
        def stream(self, method, url, json, headers, timeout):
            sent.append(json)
            return Reply()

    for temperature in (0.0, 0.8):
        bench.stream_one(Client(), "http://x", "def f():", bench.Row("code", temperature, 1, "default"), 4, 7)
    assert "speculation" not in sent[0] and sent[0]["seed"] == 7
    assert "speculation" not in sent[1] and "seed" not in sent[1]


def test_the_load_table_and_plot_follow_each_row_over_the_clients(tmp_path):
    from specserve.tools.bench_report import load_table, plots

    rows = []
    for clients, none_s, default_s in ((1, 10.0, 5.0), (4, 4.0, 4.0)):
        for method, seconds in (("none", none_s), ("default", default_s)):
            row = bench.Row("code", 0.8, clients, method, completion_tokens=100, wall_seconds=seconds)
            row.request_rates = [100 / seconds / clients] * clients
            row.itl = [0.01, 0.02, 0.03]
            rows.append(row)
    records = bench.results(rows)
    table = load_table(records)
    assert "| code | 0.8 | default | 4 | 25.0 | 1.00x | 6.2 |" in table
    assert "| code | 0.8 | default | 1 | 20.0 | 2.00x | 20.0 |" in table
    assert "throughput_vs_clients.png" in plots(records, tmp_path)
    assert (tmp_path / "throughput_vs_clients.png").stat().st_size > 0


def test_the_thirdparty_workload_continues_installed_packages_code():
    prompts = bench.workload_prompts("thirdparty", 5)
    assert len(prompts) == 5 and len(set(prompts)) == 5
    assert all(isinstance(p, str) and p.count("\n") >= 10 for p in prompts)


def test_rows_with_several_clients_take_turns_block_by_block():
    """After a warm-up block of each row of a client count, sent for a spare copy whose
    figures are not kept, the rows take turns block by block."""
    rows = [bench.Row("code", 0.8, clients, method) for clients in (4, 2) for method in ("none", "default")]
    every = bench.load_steps(rows, {"code": list("abcdefgh")})
    spares = [
        (i, row.clients, row.method, "".join(block))
        for i, (row, block) in enumerate(every)
        if all(row is not kept for kept in rows)
    ]
    assert spares == [
        (0, 2, "none", "ab"),
        (1, 2, "default", "ab"),
        (10, 4, "none", "abcd"),
        (11, 4, "default", "abcd"),
    ]
    assert all(
        row == original and row is not original for row, original in zip((every[i][0] for i in (0, 1)), rows[2:])
    )
    steps = [(row, block) for row, block in every if any(row is kept for kept in rows)]
    assert [(row.clients, row.method, block) for row, block in steps[:4]] == [
        (2, "none", ["a", "b"]), (2, "default", ["a", "b"]), (2, "none", ["c", "d"]), (2, "default", ["c", "d"]),
    ]  # fmt: skip
    assert [(row.method, "".join(block)) for row, block in steps if row.clients == 4] == [
        ("none", "abcd"), ("default", "abcd"), ("none", "efgh"), ("default", "efgh"),
    ]  # fmt: skip
