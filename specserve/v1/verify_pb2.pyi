from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrefillRequest(_message.Message):
    __slots__ = ("session_id", "token_ids", "sampling", "prompt_logprobs", "prompt_top_logprobs", "copy_of", "prompt_length", "grammar")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    COPY_OF_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _common_pb2.SamplingParams
    prompt_logprobs: bool
    prompt_top_logprobs: int
    copy_of: str
    prompt_length: int
    grammar: _common_pb2.Grammar
    def __init__(self, session_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ..., prompt_top_logprobs: _Optional[int] = ..., copy_of: _Optional[str] = ..., prompt_length: _Optional[int] = ..., grammar: _Optional[_Union[_common_pb2.Grammar, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("next_token_logprob", "prompt_logprobs", "next_token_id", "num_verified", "server_seconds")
    NEXT_TOKEN_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    next_token_logprob: _common_pb2.TokenLogprob
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    next_token_id: int
    num_verified: int
    server_seconds: float
    def __init__(self, next_token_logprob: _Optional[_Union[_common_pb2.TokenLogprob, _Mapping]] = ..., prompt_logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., next_token_id: _Optional[int] = ..., num_verified: _Optional[int] = ..., server_seconds: _Optional[float] = ...) -> None: ...

class VerifyRequest(_message.Message):
    __slots__ = ("session_id", "num_verified", "draft_token_ids", "draft_distributions", "sampling", "draft_parents")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_verified: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    sampling: _common_pb2.SamplingParams
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session_id: _Optional[str] = ..., num_verified: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...

class VerifyResponse(_message.Message):
    __slots__ = ("num_accepted", "next_token_id", "num_verified", "batch_size", "server_seconds", "forward_seconds", "kernel_seconds", "accepted_token_ids", "logprobs", "mask_seconds")
    NUM_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    NEXT_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    num_accepted: int
    next_token_id: int
    num_verified: int
    batch_size: int
    server_seconds: float
    forward_seconds: float
    kernel_seconds: float
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    mask_seconds: float
    def __init__(self, num_accepted: _Optional[int] = ..., next_token_id: _Optional[int] = ..., num_verified: _Optional[int] = ..., batch_size: _Optional[int] = ..., server_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., kernel_seconds: _Optional[float] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., mask_seconds: _Optional[float] = ...) -> None: ...

class DecodeRequest(_message.Message):
    __slots__ = ("session_id", "num_verified", "max_tokens", "sampling", "speculation")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    SPECULATION_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    num_verified: int
    max_tokens: int
    sampling: _common_pb2.SamplingParams
    speculation: Speculation
    def __init__(self, session_id: _Optional[str] = ..., num_verified: _Optional[int] = ..., max_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., speculation: _Optional[_Union[Speculation, _Mapping]] = ...) -> None: ...

class Speculation(_message.Message):
    __slots__ = ("method", "num_speculative_tokens", "adaptive", "adaptive_k_min", "adaptive_k_max", "min_draft_probability", "tree", "tenant", "isolated", "lookahead")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_MIN_FIELD_NUMBER: _ClassVar[int]
    ADAPTIVE_K_MAX_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_FIELD_NUMBER: _ClassVar[int]
    method: str
    num_speculative_tokens: int
    adaptive: bool
    adaptive_k_min: int
    adaptive_k_max: int
    min_draft_probability: float
    tree: _common_pb2.TokenTree
    tenant: str
    isolated: bool
    lookahead: Lookahead
    def __init__(self, method: _Optional[str] = ..., num_speculative_tokens: _Optional[int] = ..., adaptive: _Optional[bool] = ..., adaptive_k_min: _Optional[int] = ..., adaptive_k_max: _Optional[int] = ..., min_draft_probability: _Optional[float] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., tenant: _Optional[str] = ..., isolated: _Optional[bool] = ..., lookahead: _Optional[_Union[Lookahead, _Mapping]] = ...) -> None: ...

class Lookahead(_message.Message):
    __slots__ = ("window", "ngram", "guesses")
    WINDOW_FIELD_NUMBER: _ClassVar[int]
    NGRAM_FIELD_NUMBER: _ClassVar[int]
    GUESSES_FIELD_NUMBER: _ClassVar[int]
    window: int
    ngram: int
    guesses: int
    def __init__(self, window: _Optional[int] = ..., ngram: _Optional[int] = ..., guesses: _Optional[int] = ...) -> None: ...

class DecodeResponse(_message.Message):
    __slots__ = ("token_id", "num_verified", "batch_size", "server_seconds", "forward_seconds", "kernel_seconds", "accepted_token_ids", "num_draft_tokens", "draft_seconds", "tree", "logprobs", "mask_seconds")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SERVER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    FORWARD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KERNEL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    MASK_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    num_verified: int
    batch_size: int
    server_seconds: float
    forward_seconds: float
    kernel_seconds: float
    accepted_token_ids: _containers.RepeatedScalarFieldContainer[int]
    num_draft_tokens: int
    draft_seconds: float
    tree: bool
    logprobs: _containers.RepeatedCompositeFieldContainer[_common_pb2.TokenLogprob]
    mask_seconds: float
    def __init__(self, token_id: _Optional[int] = ..., num_verified: _Optional[int] = ..., batch_size: _Optional[int] = ..., server_seconds: _Optional[float] = ..., forward_seconds: _Optional[float] = ..., kernel_seconds: _Optional[float] = ..., accepted_token_ids: _Optional[_Iterable[int]] = ..., num_draft_tokens: _Optional[int] = ..., draft_seconds: _Optional[float] = ..., tree: _Optional[bool] = ..., logprobs: _Optional[_Iterable[_Union[_common_pb2.TokenLogprob, _Mapping]]] = ..., mask_seconds: _Optional[float] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
