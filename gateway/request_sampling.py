"""A request's sampling as the verifier takes it (SamplingParams): temperature, top-p, top-k,
min-p and the seed, its logprobs, and its logits processing; a 400 naming the field for a
value out of range."""

from __future__ import annotations

import dataclasses
import re
import secrets

from gateway.errors import bad_request
from specserve.errors import InvalidArgument
from specserve.logit_processing import MAX_BIAS, LogitProcessing
from specserve.logprobs import MAX_TOP_LOGPROBS
from specserve.sampling import SamplingParams, sampling_problem


def _chat(request) -> bool:
    return getattr(request, "messages", None) is not None


def logprob_settings(request) -> tuple[bool, int, int | None]:
    """(each token's logprob asked, the likeliest tokens' shown beside it, the prompt tokens'
    logprobs' top ones or None where not asked): completions' logprobs N; chat's logprobs and
    top_logprobs; echo with logprobs and vLLM's prompt_logprobs ask for the prompt's."""
    if _chat(request):
        if request.logprobs not in (None, True, False):
            raise bad_request("logprobs is true or false in a chat completion (top_logprobs: how many)", "logprobs")
        asked, top, param = bool(request.logprobs), request.top_logprobs or 0, "top_logprobs"
        if top and not asked:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")
    else:
        asked = request.logprobs is not None and request.logprobs is not False
        top, param = (0 if isinstance(request.logprobs, bool) else request.logprobs or 0), "logprobs"
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise bad_request(f"{param} must lie in 0..{MAX_TOP_LOGPROBS}", param)
    prompt = request.prompt_logprobs
    if prompt is not None and not 0 <= prompt <= MAX_TOP_LOGPROBS:
        raise bad_request(f"prompt_logprobs must lie in 0..{MAX_TOP_LOGPROBS}", "prompt_logprobs")
    if not _chat(request) and getattr(request, "echo", False) and asked:  # chat's echo is text only
        prompt = max(prompt or 0, top)
    return asked, top, prompt


def sampling_for(request, vocab_size: int, bad_words: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
    """bad_words: the request's, as token sequences."""
    temperature = 1.0 if request.temperature is None else request.temperature
    top_p = 1.0 if request.top_p is None else request.top_p
    top_k = 0 if request.top_k in (None, -1) else request.top_k
    seed = (
        secrets.randbits(63) if request.seed is None else request.seed % 2**64
    )  # a negative one: its two's complement
    problem = sampling_problem(temperature, top_p, top_k, seed)
    if problem is not None:
        raise bad_request(*problem)
    if top_k >= vocab_size:
        top_k = 0  # keeps every token, as 0 does
    logprobs, top, _ = logprob_settings(request)
    min_p = request.min_p or 0.0
    if not 0 <= min_p <= 1:
        raise bad_request("min_p must lie in [0, 1]", "min_p")
    processing = dataclasses.replace(processing_for(request, vocab_size), bad_words=bad_words)
    return SamplingParams(
        temperature,
        top_p,
        top_k=top_k,
        seed=seed,
        logprobs=logprobs,
        top_logprobs=top,
        min_p=min_p,
        ignore_eos=bool(request.ignore_eos),
        processing=processing,
    )


def processing_for(request, vocab_size: int) -> LogitProcessing:
    """The request's penalties, biases and masks (specserve/logit_processing.py); a 400 naming
    the field for a value out of range or a token id outside the vocabulary."""
    given = request.logit_bias or {}
    bad = [key for key in given if not re.fullmatch(r"-?[0-9]+", key) or not 0 <= int(key) < vocab_size]
    if bad:
        raise bad_request(
            f"logit_bias keys are token ids in [0, {vocab_size}) (the vocabulary size is {vocab_size}); "
            f"not: {', '.join(repr(key) for key in bad)}",
            "logit_bias",
        )
    bias = {int(key): max(-MAX_BIAS, min(MAX_BIAS, value)) for key, value in given.items()}  # OpenAI clamps
    for name in ("stop_token_ids", "allowed_token_ids"):
        outside = [t for t in getattr(request, name) or [] if not 0 <= t < vocab_size]
        if outside:
            raise bad_request(
                f"{name} are token ids in [0, {vocab_size}) (the vocabulary size is {vocab_size}); "
                f"out of vocabulary: {', '.join(map(str, outside))}",
                name,
            )
    values = {
        "presence_penalty": 0.0 if request.presence_penalty is None else request.presence_penalty,
        "frequency_penalty": 0.0 if request.frequency_penalty is None else request.frequency_penalty,
        "repetition_penalty": 1.0 if request.repetition_penalty is None else request.repetition_penalty,
        "min_tokens": request.min_tokens or 0,
    }
    for name, value in values.items():
        try:
            LogitProcessing(**{name: value})
        except InvalidArgument as error:
            raise bad_request(str(error), name) from None
    stops, allowed = tuple(request.stop_token_ids or ()), tuple(request.allowed_token_ids or ())
    return LogitProcessing(
        **values, logit_bias=tuple(sorted(bias.items())), stop_token_ids=stops, allowed_token_ids=allowed
    )
