"""Logprobs in OpenAI's and vLLM's shapes, from the TokenLogprob messages the verifier sends
(specserve/logprobs.py): a completion's `logprobs` (tokens, token_logprobs, top_logprobs,
text_offset; with echo the prompt's tokens first, the first of them without a logprob), a
chat completion's `logprobs.content`, and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprobs:
    """A request's logprobs as its rounds bring them: the prompt's tokens' from the second on
    (where asked), and each generated token's, in the order of the tokens."""

    prompt: list = field(default_factory=list)
    tokens: list = field(default_factory=list)


class LogprobFormat:
    """One request's logprobs formatting: top is the likeliest tokens shown per position."""

    def __init__(self, tokenizer, chat: bool, top: int, as_ids: bool = False):
        """as_ids: vLLM's return_tokens_as_token_ids, each token named "token_id:N"."""
        self.tokenizer = tokenizer
        self.chat = chat
        self.top = top
        self.as_ids = as_ids
        self._text: dict[int, str] = {}

    def text(self, token: int) -> str:
        if token not in self._text:
            self._text[token] = f"token_id:{token}" if self.as_ids else self.tokenizer.decode([token])
        return self._text[token]

    def decoded(self, token: int) -> str:
        """The token's text (prompt_logprobs' decoded_token), whatever the naming."""
        return self.tokenizer.decode([token])

    def completion(self, token_ids: list[int], records: list, offset: int) -> dict:
        """A completions `logprobs` object for token_ids (records: theirs, None for a token
        without one: echo's first prompt token); offset: the text's length before them."""
        tokens = [self.text(t) for t in token_ids]
        offsets = []
        for token in tokens:
            offsets.append(offset)
            offset += len(token)
        top = []
        for token, record in zip(token_ids, records):
            if record is None:
                top.append(None)
                continue
            shown = {self.text(token): record.logprob}  # the chosen token first, always there (vLLM's)
            for i, v in zip(record.top_token_ids[: self.top], record.top_logprobs):
                shown.setdefault(self.text(i), v)
            top.append(shown)
        return {
            "tokens": tokens,
            "token_logprobs": [None if r is None else r.logprob for r in records],
            "top_logprobs": top,  # with logprobs 0, each the chosen token's alone (vLLM's)
            "text_offset": offsets,
        }

    def chat_content(self, token_ids: list[int], records: list) -> list[dict]:
        """A chat completion's `logprobs.content` entries for token_ids."""
        out = []
        for token, record in zip(token_ids, records):
            text = self.text(token)
            alternatives = [
                {"token": self.text(i), "logprob": v, "bytes": list(self.text(i).encode())}
                for i, v in zip(record.top_token_ids[: self.top], record.top_logprobs)
            ]
            out.append(
                {"token": text, "logprob": record.logprob, "bytes": list(text.encode()), "top_logprobs": alternatives}
            )
        return out

    def prompt_logprobs(self, prompt_ids: list[int], records: list, top: int) -> list:
        """vLLM's `prompt_logprobs`: per prompt token, None for the first, then {token id:
        {logprob, rank, decoded_token}} for it and the top likeliest."""
        out: list = [None] if prompt_ids else []
        for token, record in zip(prompt_ids[1:], records):
            entry = {
                str(i): _vllm(self.decoded(i), v, rank)
                for rank, (i, v) in enumerate(zip(record.top_token_ids[:top], record.top_logprobs), start=1)
            }
            entry[str(token)] = _vllm(self.decoded(token), record.logprob, record.rank)
            out.append(entry)
        return out


def _vllm(text: str, logprob: float, rank: int) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": text}


class ChoiceOutputs:
    """What a choice carries beside its text, where the request asks: its tokens' logprobs
    (in a stream, each chunk those of the tokens since the one before), echo's prompt first,
    vLLM's prompt_logprobs and prompt_token_ids (with the first chunk)."""

    def __init__(self, tokenizer, request, plan, chat: bool, prompt_text: str | None = None):
        """prompt_text: the prompt as the request wrote it (echo); None: decoded from its ids."""
        self.chat = chat
        self.asked = plan.sampling.logprobs
        self.prompt_ids = list(plan.prompt_token_ids)
        self.logprobs = Logprobs() if self.asked or plan.prompt_logprobs is not None else None
        self.format = LogprobFormat(tokenizer, chat, plan.sampling.top_logprobs, request.return_tokens_as_token_ids)
        self.echo = bool(getattr(request, "echo", False))
        whole = prompt_text is not None and request.truncate_prompt_tokens is None
        if chat:  # vLLM's: the last message's content, where it has the reply's role
            self.echo_text = request.echoed()
        else:
            self.echo_text = prompt_text if whole else tokenizer.decode(self.prompt_ids) if self.echo else ""
        self.vllm_prompt = request.prompt_logprobs
        self.prompt_token_ids = request.return_token_ids
        self.sent = 0  # tokens whose logprobs went out
        self.offset = 0  # text_offset of the next token

    def echoed(self, text: str) -> str:
        """The choice's first text: the prompt's before it, with echo."""
        return self.echo_text + text if self.echo else text

    def extra(self, token_ids: list[int], first: bool) -> dict:
        """The choice's fields for the tokens of token_ids not yet sent (first: the choice's first)."""
        out: dict = {}
        if first and self.prompt_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        if first and self.vllm_prompt is not None:
            out["prompt_logprobs"] = self.format.prompt_logprobs(
                self.prompt_ids, self.logprobs.prompt, self.vllm_prompt
            )
        if not self.asked:
            return out
        ids, records = token_ids[self.sent :], self.logprobs.tokens[self.sent : len(token_ids)]
        self.sent = len(token_ids)
        if self.chat:
            out["logprobs"] = {"content": self.format.chat_content(ids, records)}
            return out
        if (
            first and self.echo and self.prompt_ids and not self.chat
        ):  # the prompt's tokens first, its first without a logprob
            ids, records = self.prompt_ids + ids, [None, *self.logprobs.prompt, *records]
        out["logprobs"] = self.format.completion(ids, records, self.offset)
        self.offset += sum(len(token) for token in out["logprobs"]["tokens"])
        return out
