"""The OpenAI-compatible request bodies, their validation, and the error shape.

Field names are the ones OpenAI clients send; `speculation` and `return_token_ids` are
specserve's extensions. Validation that needs the served model (context window, vocabulary,
K bounds) happens in `plan_for`, after parsing.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.clients import ServedModel
from gateway.config import GatewayConfig
from gateway.errors import ApiError, bad_request
from gateway.request_sampling import logprob_settings, sampling_for
from gateway.rounds import GenerationPlan
from gateway.shapes import lookahead_of_request, tree_of_request
from specserve.grammar import Grammar
from specserve.methods import registry


class Lookahead(BaseModel):
    """Method lookahead's shape (specserve/methods/lookahead.py); unset: the verifier's defaults."""

    model_config = ConfigDict(extra="forbid")

    window: int | None = None
    ngram: int | None = None
    guesses: int | None = None


class Speculation(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: str | None = None  # one of specserve/methods/registry.py's, or "none"
    num_speculative_tokens: int | None = None
    adaptive: bool | None = None
    min_draft_probability: float | None = None
    pipeline: bool | None = None
    # A token tree each round drafts: children per depth ([3, 2, 1]) or paths of ranks
    # ([[0], [0, 0], [1]]) (specserve/methods/trees.py).
    tree: list[int] | list[list[int]] | None = None
    lookahead: Lookahead | None = None

    @field_validator("method")
    @classmethod
    def _known_method(cls, method: str | None) -> str | None:
        methods = (*registry.names(), registry.NONE)
        if method is not None and method not in methods:
            raise ValueError(f"must be one of {', '.join(methods)}")
        return method


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk too, with include_usage


# OpenAI's and vLLM's sampling and output fields that this server does not implement yet,
# with the values that ask for nothing (a request may send those); any other value is a
# 400 that names the field, never a silent default.
UNSUPPORTED = {
    "length_penalty": (1,),
    "tools": ([],),
    "tool_choice": ("none", "auto"),
    "functions": ([],),
    "function_call": ("none", "auto"),
    "use_beam_search": (False,),
    "spaces_between_special_tokens": (True,),
    "logits_processors": ([],),
    "prediction": (),
    "audio": (),
    "modalities": (["text"],),
    "chat_template": (),
    "documents": (),
    "reasoning_effort": (),
}
MAX_STOP_STRINGS, MAX_STOP_LENGTH = 64, 1024
MAX_CHOICES = 16  # n: choices of one request, each its own rounds


class _GenerationRequest(BaseModel):
    """Fields common to completions and chat completions. Fields not named here are ignored,
    except those of UNSUPPORTED set to a value that asks for something."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # vLLM's range (a torch long)
    stop: str | list[str] | None = None
    n: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    speculation: Speculation | None = None
    return_token_ids: bool = False
    return_timings: bool = False
    logprobs: bool | int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt tokens' logprobs, with this many top ones
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last N tokens
    truncation_side: Literal["left", "right"] | None = None  # vLLM's: "right" keeps the first N instead
    return_tokens_as_token_ids: bool = False  # vLLM's: logprobs name tokens "token_id:N"
    skip_special_tokens: bool = True  # vLLM's: false keeps special tokens' text in the output
    # Structured outputs (gateway/structured.py): OpenAI's, vLLM's and vLLM's older fields.
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # vLLM's choice of library: this server has one, llguidance

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def continuous_usage(self) -> bool:
        return self.include_usage() and self.stream_options.continuous_usage_stats

    def speculation_usage(self) -> bool:
        """Whether usage carries `speculation` (specserve's): asked with a speculation object or
        return_timings; left out otherwise, so that usage is OpenAI's own three counts."""
        return self.speculation is not None or self.return_timings

    def stop_strings(self) -> tuple[str, ...]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise bad_request("stop strings must not be empty", "stop")
        if len(stops) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_LENGTH for s in stops):
            raise bad_request(
                f"at most {MAX_STOP_STRINGS} stop strings of at most {MAX_STOP_LENGTH} characters each", "stop"
            )
        return tuple(dict.fromkeys(stops))


class CompletionRequest(_GenerationRequest):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(...)  # a batch: vLLM's
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported", "messages")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = None
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    add_generation_prompt: bool = True  # the template's: open the assistant's turn
    continue_final_message: bool = False  # the template's: leave the last message open, to be continued
    echo: bool = False  # vLLM's: the reply starts with the last message's content, where it has the reply's role

    def response_role(self) -> str:
        """vLLM's: the assistant's, or, with no generation prompt, the last message's role."""
        return "assistant" if self.add_generation_prompt else self.messages[-1].role

    def echoed(self) -> str:
        """What echo puts before the reply: the last message's content, where its role is the reply's."""
        last = self.messages[-1]
        return last.text() if self.echo and last.role == self.response_role() else ""


# apply_chat_template's own arguments, which chat_template_kwargs may not override.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_variables(kwargs: dict | None) -> dict:
    """chat_template_kwargs: variables for the model's chat template (e.g. Qwen3's
    enable_thinking); none may stand for one of the call's own arguments."""
    variables = kwargs or {}
    taken = sorted(set(variables) & TEMPLATE_ARGUMENTS)
    if taken:
        raise bad_request(f"chat_template_kwargs may not set {', '.join(taken)}", "chat_template_kwargs")
    return variables


def check_model(requested: str | None, served: ServedModel) -> None:
    """An omitted or empty model is the served one."""
    if requested and requested != served.name:
        raise ApiError(
            404,
            f"The model `{requested}` does not exist; this server serves `{served.name}`.",
            "model",
            "model_not_found",
        )


def check_unsupported(request: _GenerationRequest) -> None:
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed with stream: true", "stream_options")
    if isinstance(request, ChatCompletionRequest) and request.add_generation_prompt and request.continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message cannot both be true (set add_generation_prompt: false "
            "to continue the last message)",
            "continue_final_message",
        )
    for name, value in (request.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and not any(_same(value, d) for d in UNSUPPORTED[name]):
            neutral = " or ".join(json.dumps(d) for d in UNSUPPORTED[name])
            raise bad_request(
                f"{name} is not supported by this server; leave it out"
                + (f" or set it to {neutral}" if neutral else ""),
                name,
            )
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise bad_request(f"n must lie in 1..{MAX_CHOICES}", "n")
    if isinstance(request, CompletionRequest):
        if request.best_of not in (None, 1):
            raise bad_request("only best_of = 1 is supported", "best_of")
        if request.suffix:
            raise bad_request("suffix is not supported", "suffix")


def _same(value, neutral) -> bool:
    """value is neutral (numbers compared as numbers, 0 == 0.0, but False is no 0)."""
    if isinstance(neutral, bool) or isinstance(value, bool):
        return value is neutral
    return value == neutral


def _num_speculative_tokens(speculation: Speculation, defaults: GatewayConfig, served: ServedModel) -> int:
    k = speculation.num_speculative_tokens
    k = defaults.num_speculative_tokens if k is None else k
    if not 1 <= k <= served.max_speculative_tokens:
        raise bad_request(
            f"speculation.num_speculative_tokens must lie in 1..{served.max_speculative_tokens}",
            "speculation.num_speculative_tokens",
        )
    return k


def plan_for(
    request: _GenerationRequest,
    prompt_token_ids: list[int],
    served: ServedModel,
    defaults: GatewayConfig,
    *,
    tenant: str = "",
    bad_words: tuple[tuple[int, ...], ...] = (),
    grammar: Grammar | None = None,
) -> GenerationPlan:
    check_unsupported(request)
    prompt_token_ids = _truncated(request, prompt_token_ids, served)
    max_tokens = _checked_lengths(request, prompt_token_ids, served)
    if (request.min_tokens or 0) > max_tokens:
        raise bad_request(f"min_tokens ({request.min_tokens}) exceeds max_tokens ({max_tokens})", "min_tokens")
    speculation = request.speculation or Speculation()
    k = _num_speculative_tokens(speculation, defaults, served)
    min_p = (
        defaults.min_draft_probability
        if speculation.min_draft_probability is None
        else speculation.min_draft_probability
    )
    if not 0 <= min_p <= 1:
        raise bad_request("speculation.min_draft_probability must lie in [0, 1]", "speculation.min_draft_probability")
    method = _method(speculation.method, defaults.method, served)
    # A sampled request with a seed must give the same output whatever else runs (docs/design.md,
    # invariant 4), and its keyed randomness reproduces it only for the same rounds: it keeps
    # its method whatever the load, and a K that no timing chooses.
    seeded_sampled = request.temperature != 0 and request.seed is not None
    adaptive = defaults.adaptive if speculation.adaptive is None else speculation.adaptive
    tree = tree_of_request(speculation.tree, defaults.tree, method, served)
    lookahead = lookahead_of_request(speculation.lookahead, method)
    return GenerationPlan(
        prompt_token_ids=prompt_token_ids,
        max_tokens=max_tokens,
        sampling=sampling_for(request, served.vocab_size, bad_words),
        method=method,
        num_speculative_tokens=min(k, served.max_speculative_tokens),
        adaptive=adaptive and not seeded_sampled,
        min_draft_probability=min_p,
        k_bounds=(
            min(defaults.adaptive_k_min, served.max_speculative_tokens),
            min(defaults.adaptive_k_max, served.max_speculative_tokens),
        ),
        local=method in served.local_methods,
        pipeline=defaults.pipeline if speculation.pipeline is None else speculation.pipeline,
        yields_to_load=not seeded_sampled,
        tree=tree,
        tenant=tenant,
        isolated=seeded_sampled,
        lookahead=lookahead,
        prompt_logprobs=logprob_settings(request)[2],
        grammar=grammar,
    )


def _truncated(request: _GenerationRequest, prompt_token_ids: list[int], served: ServedModel) -> list[int]:
    """vLLM's truncate_prompt_tokens: the prompt's last tokens (-1: as many as the context
    holds), or its first with truncation_side "right"."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return prompt_token_ids
    if keep == -1:
        keep = served.max_context_length
    if keep < 1:
        raise bad_request("truncate_prompt_tokens must be >= 1 (or -1)", "truncate_prompt_tokens")
    return prompt_token_ids[:keep] if request.truncation_side == "right" else prompt_token_ids[-keep:]


def _checked_lengths(request: _GenerationRequest, prompt_token_ids: list[int], served: ServedModel) -> int:
    """The request's max_tokens, once the prompt's tokens and their count and max_tokens are
    known to fit the model (a 400 naming the field otherwise)."""
    if not prompt_token_ids:
        raise bad_request("the prompt must not be empty", "prompt")
    outside = next((t for t in prompt_token_ids if not 0 <= t < served.vocab_size), None)
    if outside is not None:
        raise bad_request(
            f"token id {outside} is out of vocabulary: prompt token ids lie in [0, {served.vocab_size})", "prompt"
        )
    room = served.max_context_length - len(prompt_token_ids)
    if room < 1:
        raise bad_request(
            f"This model's maximum context length is {served.max_context_length} tokens; "
            f"the prompt has {len(prompt_token_ids)}",
            "prompt",
        )
    max_tokens = _max_tokens(request, room)
    scores_prompt = request.prompt_logprobs is not None or (isinstance(request, CompletionRequest) and request.echo)
    if max_tokens < (0 if scores_prompt else 1):  # 0: the prompt's logprobs only (a log-likelihood)
        raise bad_request("max_tokens must be >= 1 (0 with echo or prompt_logprobs)", "max_tokens")
    if max_tokens > room:
        raise bad_request(
            f"This model's maximum context length is {served.max_context_length} tokens; the prompt "
            f"({len(prompt_token_ids)} tokens) + max_tokens ({max_tokens}) exceeds it",
            "max_tokens",
        )
    return max_tokens


def _method(asked: str | None, default: str, served: ServedModel) -> str:
    """The request's speculation method: asked, or the gateway's default where the pair
    serves it (target-only where it does not)."""
    available = served.local_methods | served.remote_methods | {"none"}
    if asked is None:
        return default if default in available else "none"
    if asked not in available:
        raise bad_request(
            f"speculation.method {asked!r} is not served here; available: {', '.join(sorted(available))}",
            "speculation.method",
        )
    return asked


def _max_tokens(request: _GenerationRequest, room: int) -> int:
    if isinstance(request, ChatCompletionRequest):
        value = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        return room if value is None else value
    return 16 if request.max_tokens is None else request.max_tokens  # OpenAI's completions default
