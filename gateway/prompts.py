"""Prompts as token ids: a completion's prompts (strings or ids, one or a batch), chat
messages rendered by the model's chat template, vLLM's bad_words, and the tokenizer threads
that do this work off the event loop."""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

from jinja2 import TemplateError

from gateway.api import CompletionRequest, template_variables
from gateway.errors import bad_request

# Used when the tokenizer has no chat template of its own; documented in docs/api.md.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
MAX_PROMPTS = 16  # a completion's batch of prompts, and its choices (prompts times n) in all
TOKENIZER_THREADS = 2


def completion_prompts(request: CompletionRequest, tokenizer) -> tuple[list[list[int]], list]:
    """Each prompt's token ids, and its text (None: given as ids): a completion may carry a
    batch, strings or lists of token ids (vLLM's)."""
    prompts = request.prompt
    if isinstance(prompts, str) or not prompts or isinstance(prompts[0], int):
        prompts = [prompts]
    if len(prompts) > MAX_PROMPTS:
        raise bad_request(f"at most {MAX_PROMPTS} prompts per request", "prompt")
    texts = [p if isinstance(p, str) else None for p in prompts]
    return [list(tokenizer(p)["input_ids"]) if isinstance(p, str) else list(p) for p in prompts], texts


def chat_prompt(request, tokenizer, add_special_tokens: bool = False, tools=None) -> list[int]:
    """The messages rendered by the model's chat template, as token ids (request: a chat
    completion's or /tokenize's)."""
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message,
            chat_template=template,
            tools=tools,
            **template_variables(request.chat_template_kwargs),
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as error:
        raise bad_request(f"the model's chat template refused these messages: {error}", "messages") from None
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def bad_words(request, tokenizer) -> tuple[tuple[int, ...], ...]:
    """vLLM's bad_words as token sequences: each word as written and after a space."""
    words = request.bad_words or []
    variants = {w for word in words for w in (word, " " + word.lstrip()) if w.strip()}
    encoded = {tuple(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in sorted(variants)}
    return tuple(sorted(sequence for sequence in encoded if sequence))


class TokenizerThreads:
    """Threads for tokenizer work, each with a tokenizer of its own (a fast tokenizer set to
    truncate or pad is not to be shared): a long prompt's tokenization must not hold up the
    event loop (other requests' rounds, health probes)."""

    def __init__(self, tokenizer, threads: int = TOKENIZER_THREADS):
        self.tokenizer = tokenizer
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="tokenize")
        self._local = threading.local()

    async def run(self, work, request):
        """work(request, tokenizer) in one of the threads."""

        def call():
            tokenizer = getattr(self._local, "tokenizer", None)
            if tokenizer is None:
                tokenizer = self._local.tokenizer = copy.deepcopy(self.tokenizer)
            return work(request, tokenizer)

        return await asyncio.get_running_loop().run_in_executor(self.pool, call)
