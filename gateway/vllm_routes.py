"""vLLM's server's own routes: its version, tokenizing as the completions do, and
/invocations (a completion or a chat completion by its body)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.api import ChatCompletionRequest, ChatMessage, CompletionRequest, check_model
from gateway.errors import bad_request
from gateway.prompts import chat_prompt
from gateway.responses import chat_complete, complete
from gateway.state import Gateway
from specserve import __version__


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered as a chat completion would be."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: a prompt's yes, chat messages' no (the template's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    tools: list[dict] | None = None  # handed to the chat template, as vLLM does
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]


def add_vllm_routes(app: FastAPI, gateway: Gateway) -> None:
    """vLLM's server's own: its version, tokenizing as the completions do, /invocations."""

    @app.post("/invocations")
    async def invocations(http: Request):
        """A chat completion where the body has messages, else a completion (vLLM's, SageMaker's)."""
        try:
            body = await http.json()
        except ValueError:
            raise bad_request("the body must be JSON") from None
        chat = isinstance(body, dict) and "messages" in body
        try:
            request = (ChatCompletionRequest if chat else CompletionRequest).model_validate(body)
        except ValidationError as error:
            raise RequestValidationError(error.errors()) from None
        return await (chat_complete if chat else complete)(gateway, request, http)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        """vLLM's: a prompt's (or chat messages') token ids, as the completions would take them."""
        check_model(request.model, gateway.served)
        if request.messages is not None:
            if request.add_generation_prompt and request.continue_final_message:
                raise bad_request("add_generation_prompt and continue_final_message cannot both be true", "messages")
            special = bool(request.add_special_tokens)
            tokens = await gateway.off_loop(lambda r, t: chat_prompt(r, t, special, r.tools), request)
        else:
            text, special = request.prompt or "", request.add_special_tokens is not False
            tokens = await gateway.off_loop(lambda _, t: list(t(text, add_special_tokens=special)["input_ids"]), None)
        strings = gateway.tokenizer.convert_ids_to_tokens(tokens) if request.return_token_strs else None
        return {
            "count": len(tokens),
            "max_model_len": gateway.served.max_context_length,
            "tokens": tokens,
            "token_strs": strings,
        }

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        check_model(request.model, gateway.served)
        if any(not 0 <= t < gateway.served.vocab_size for t in request.tokens):
            raise bad_request(f"token ids must lie in [0, {gateway.served.vocab_size})", "tokens")
        return {"prompt": await gateway.off_loop(lambda _, t: t.decode(request.tokens), None)}
