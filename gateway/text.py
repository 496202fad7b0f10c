"""Turning generated token ids into text deltas: stop tokens, stop strings, and holding back
text that might still turn out to be a stop string or half of a UTF-8 character."""

from __future__ import annotations

from dataclasses import dataclass, field

REPLACEMENT_CHAR = "\ufffd"


@dataclass
class TextDelta:
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


@dataclass
class TextAssembler:
    """One completion's text, decoded incrementally: each round decodes only a window of the
    last tokens (a round's before and after its new ones), not the whole completion."""

    tokenizer: object
    eos_token_ids: frozenset[int]
    stop: tuple[str, ...]
    max_tokens: int
    include_stop: bool = False  # vLLM's include_stop_str_in_output: the stop string ends the text
    min_tokens: int = 0  # stop strings count only once the completion has this many tokens (vLLM's)
    skip_special_tokens: bool = True  # vLLM's: special tokens' text is left out of the completion's
    stop_token_ids: frozenset[int] = frozenset()  # the request's own (of eos_token_ids): their id is the stop_reason
    token_ids: list[int] = field(default_factory=list)
    emitted_text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's: the stop string or stop token id that ended it
    text: str = ""  # all decoded so far (what is shown, and what is held back)
    _stop_horizon: int = 0  # text decoded before min_tokens, where no stop string may start
    _prefix: int = 0  # the window: tokens [_prefix, _read) are decoded into text already, as
    _read: int = 0  # context for the ones after them (a token's text may depend on the one before)
    _stopped_by_token: bool = False  # the last token is a stop token: its text is left out

    def add(self, new_tokens: list[int]) -> TextDelta:
        """Consumes one round's tokens; returns what may be shown now."""
        taken = self._take(new_tokens)
        self.text += self._decode_new()
        text = self.text
        if len(self.token_ids) < self.min_tokens:  # no stop yet: what is decoded so far cannot hold one
            stop_at, self._stop_horizon = None, len(text)
        else:
            stop_at = self._find_stop(text)
        if stop_at is not None:
            text, self.finish_reason = text[: stop_at[0] + (len(stop_at[1]) if self.include_stop else 0)], "stop"
            self.stop_reason = stop_at[1]
        if self.finish_reason is None:
            text = self._safe_prefix(text)
        delta = text[len(self.emitted_text) :] if text.startswith(self.emitted_text) else ""
        self.emitted_text += delta
        return TextDelta(delta, taken, self.finish_reason)

    def _decode_new(self) -> str:
        """The text of the tokens after the window, decoded with the window's tokens before
        them; nothing while it ends in half a character (unless the completion is over)."""
        decode, ids = self.tokenizer.decode, self.shown_ids
        known = decode(ids[self._prefix : self._read], skip_special_tokens=self.skip_special_tokens)
        whole = decode(ids[self._prefix :], skip_special_tokens=self.skip_special_tokens)
        if whole.endswith(REPLACEMENT_CHAR) and not self.finished:
            return ""
        self._prefix, self._read = self._read, len(ids)
        if whole.startswith(known):
            return whole[len(known) :]
        # The new tokens changed the text before them (a tokenizer's clean-up of spaces):
        # what the whole completion decodes to, past what is decoded already, this once.
        everything = decode(ids, skip_special_tokens=self.skip_special_tokens)
        return everything[len(self.text) :] if everything.startswith(self.text) else ""

    @property
    def shown_ids(self) -> list[int]:
        """The tokens whose text is the completion's: all but a stop token that ended it (its
        text too with include_stop, vLLM's include_stop_str_in_output)."""
        return self.token_ids[:-1] if self._stopped_by_token else self.token_ids

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def _take(self, new_tokens: list[int]) -> list[int]:
        taken: list[int] = []
        for token in new_tokens:
            if self.finished:
                break
            taken.append(token)
            self.token_ids.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "stop"
                self.stop_reason = token if token in self.stop_token_ids else None
                self._stopped_by_token = not self.include_stop
            elif len(self.token_ids) >= self.max_tokens:
                self.finish_reason = "length"
        return taken

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """Where the first stop string starts, and which (the longest there)."""
        # Only text after what was already shown can hold a new stop string (plus overlap).
        longest = max((len(s) for s in self.stop), default=0)
        horizon = max(0, len(self.emitted_text) - longest, self._stop_horizon - longest + 1)
        hits = [(i, -len(s), s) for s in self.stop if (i := text.find(s, horizon)) >= 0]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def _safe_prefix(self, text: str) -> str:
        """Text minus a trailing incomplete character and any tail that begins a stop string."""
        text = text.rstrip(REPLACEMENT_CHAR)
        hold = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return text[: len(text) - hold] if hold else text
