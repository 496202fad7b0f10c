"""The gateway's one object: its configuration, the model it serves once the verify service
has answered, the gRPC clients, the tokenizer threads, metrics and the counts the guard
keeps. app.py builds it; the routes, the guard and the responses take it."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from gateway.api import plan_for
from gateway.clients import Backends, ServedModel
from gateway.config import GatewayConfig
from gateway.errors import bad_request
from gateway.prompts import TokenizerThreads, bad_words
from gateway.rounds import GenerationPlan
from gateway.structured import grammar_of
from specserve.errors import InvalidArgument
from specserve.grammar import Grammar, Grammars
from specserve.serving.metrics import GatewayMetrics


@dataclass
class Gateway:
    config: GatewayConfig
    tokenizer: object
    served: ServedModel | None = None  # None while starting: the verify service has not answered yet
    clients: Backends | None = None  # set when the app starts (its gRPC channels need the event loop)
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    in_flight: int = 0  # requests being generated (touched only on the event loop)
    fatal: BaseException | None = None  # why the gateway could not start
    stopping: threading.Event = field(default_factory=threading.Event)
    seen_ready: bool = False  # a verifier has reported SERVING once: "unavailable", not "starting", after
    background: list = field(default_factory=list)  # its start-up and watching tasks
    tokenizers: TokenizerThreads = field(init=False)
    grammars: Grammars | None = None  # structured outputs' grammars compiled for the tokenizer, once served

    def __post_init__(self):
        self.tokenizers = TokenizerThreads(self.tokenizer)

    async def off_loop(self, work, request):
        """work(request, tokenizer) in the tokenizer threads (gateway/prompts.py)."""
        return await self.tokenizers.run(work, request)

    def crowded(self) -> bool:
        """Whether more requests run than speculation pays for (max_speculating_requests)."""
        limit = self.config.max_speculating_requests
        return limit > 0 and self.in_flight > limit

    def plan(self, request, prompt_token_ids: list[int], tenant: str = "", grammar=None) -> GenerationPlan:
        banned = bad_words(request, self.tokenizer)
        return plan_for(
            request, prompt_token_ids, self.served, self.config, tenant=tenant, bad_words=banned, grammar=grammar
        )

    def grammar(self, request, tokenizer=None) -> Grammar | None:
        """The request's structured output (gateway/structured.py), compiled here once to
        answer a 400 that names what the grammar library refuses (called off the event loop:
        a large schema compiles for tens of milliseconds)."""
        asked = grammar_of(request)
        if asked is None:
            return None
        name, grammar = asked
        if self.grammars is None:
            eos = tuple(sorted(self.served.eos_token_ids))
            self.grammars = Grammars(self.tokenizer, self.served.vocab_size, eos)
        try:
            self.grammars.compiled(grammar)
        except InvalidArgument as error:
            raise bad_request(f"{name}: {error}", name) from None
        return grammar
