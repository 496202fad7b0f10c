"""Detokenising rounds into text deltas: stop tokens, stop strings, held-back text."""

from __future__ import annotations

from gateway.text import TextAssembler
from specserve.testing import byte_tokenizer

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
