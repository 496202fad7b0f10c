"""Detokenising rounds into text deltas: stop tokens, stop strings, held-back text."""

from __future__ import annotations

from gateway.text import TextAssembler
from specserve.tools.testing import byte_tokenizer

TOKENIZER = byte_tokenizer()


def ids(text: str) -> list[int]:
    return TOKENIZER(text)["input_ids"]


def assembler(stop=(), max_tokens=100) -> TextAssembler:
    return TextAssembler(TOKENIZER, frozenset({256}), tuple(stop), max_tokens)


def test_deltas_concatenate_to_the_text():
    a = assembler()
    parts = [a.add(ids(chunk)).text for chunk in ("def ", "f(x)", ":\n    return x")]
    assert "".join(parts) == "def f(x):\n    return x" and not a.finished


def test_stop_string_across_rounds_is_held_back_then_cut():
    a = assembler(stop=["END"])
    assert a.add(ids("abc E")).text == "abc "  # "E" might begin "END"
    delta = a.add(ids("NDxyz"))
    assert delta.text == "" and delta.finish_reason == "stop" and a.emitted_text == "abc "


def test_false_alarm_is_released():
    a = assembler(stop=["END"])
    assert a.add(ids("abc E")).text == "abc "
    assert a.add(ids("x")).text == "Ex"


def test_eos_stops_and_later_tokens_are_dropped():
    a = assembler()
    delta = a.add([*ids("hi"), 256, *ids("more")])
    assert delta.text == "hi" and delta.finish_reason == "stop" and a.token_ids == [*ids("hi"), 256]


def test_max_tokens_finishes_with_length():
    a = assembler(max_tokens=3)
    delta = a.add(ids("abcdef"))
    assert delta.text == "abc" and delta.finish_reason == "length"


def test_split_utf8_character_waits_for_its_second_byte():
    encoded = ids("é")
    assert len(encoded) == 2
    a = assembler()
    assert a.add(encoded[:1]).text == ""
    assert a.add(encoded[1:]).text == "é"


def test_incremental_text_is_the_whole_decode_and_decodes_only_a_window():
    """4,000 tokens in rounds of 1 to 5, split characters included: the text shown is the
    whole completion's decode, and no round decodes more than its own tokens and the last
    round's (the whole completion re-decoded each round had cost seconds)."""
    text = "déf f(x):\n    return x ✓ — ünïcode 🙂\n" * 110
    tokens = ids(text)[:4000]
    lengths = []

    class Counting:
        def decode(self, token_ids, **options):
            lengths.append(len(token_ids))
            return TOKENIZER.decode(token_ids, **options)

    a = TextAssembler(Counting(), frozenset({256}), (), 10_000)
    shown, i, size = "", 0, 1
    while i < len(tokens):
        shown += a.add(tokens[i : i + size]).text
        i, size = i + size, size % 5 + 1
    assert shown == TOKENIZER.decode(tokens, skip_special_tokens=True).rstrip("\ufffd")
    assert max(lengths) <= 4 * 5  # a few rounds' tokens (a split character widens it), never thousands


def test_stop_strings_wait_for_min_tokens():
    """vLLM's min_tokens: no stop string ends a completion shorter than it; one that begins
    before it and ends after it counts."""
    early = TextAssembler(TOKENIZER, frozenset({256}), ("b",), 10)
    assert early.add(ids("ab")).text == "a" and early.finish_reason == "stop"
    waiting = TextAssembler(TOKENIZER, frozenset({256}), ("b",), 10, min_tokens=3)
    waiting.add(ids("ab"))
    assert waiting.finish_reason is None
    waiting.add(ids("cb"))
    assert waiting.finish_reason == "stop" and waiting.emitted_text == "abc"
    straddling = TextAssembler(TOKENIZER, frozenset({256}), ("xy",), 10, min_tokens=2)
    straddling.add(ids("ax"))
    straddling.add(ids("yz"))
    assert straddling.finish_reason == "stop" and straddling.emitted_text == "a"


def test_a_stop_tokens_text_is_left_out_unless_asked_and_named_as_the_stop_reason():
    """vLLM's: the token that stops a completion (end-of-sequence, or one of stop_token_ids)
    is in its token ids, not in its text, unless include_stop_str_in_output; with
    skip_special_tokens off too. The stop reason names the request's own stop token."""
    x = ids("x")[0]
    for include, special in ((False, False), (False, True), (True, False)):
        a = TextAssembler(TOKENIZER, frozenset({256, x}), (), 100, include, skip_special_tokens=special,
                          stop_token_ids=frozenset({x}))  # fmt: skip
        text = a.add([*ids("ab"), x, *ids("cd")]).text
        assert a.token_ids == [*ids("ab"), x] and a.finish_reason == "stop" and a.stop_reason == x
        assert text == ("abx" if include else "ab")
        b = TextAssembler(TOKENIZER, frozenset({256}), (), 100, include, skip_special_tokens=special)
        shown = b.add([*ids("ab"), 256]).text
        assert shown == ("ab<|endoftext|>" if include and not special else "ab") and b.stop_reason is None
