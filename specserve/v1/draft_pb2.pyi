from specserve.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DraftRequest(_message.Message):
    __slots__ = ("session_id", "tokens", "num_verified", "num_speculative_tokens", "sampling", "trace_context", "method", "min_draft_probability", "want_bonus_guess", "tree", "tenant", "isolated", "prompt_length")
    class TraceContextEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    MIN_DRAFT_PROBABILITY_FIELD_NUMBER: _ClassVar[int]
    WANT_BONUS_GUESS_FIELD_NUMBER: _ClassVar[int]
    TREE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    ISOLATED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    tokens: _containers.RepeatedScalarFieldContainer[int]
    num_verified: int
    num_speculative_tokens: int
    sampling: _common_pb2.SamplingParams
    trace_context: _containers.ScalarMap[str, str]
    method: str
    min_draft_probability: float
    want_bonus_guess: bool
    tree: _common_pb2.TokenTree
    tenant: str
    isolated: bool
    prompt_length: int
    def __init__(self, session_id: _Optional[str] = ..., tokens: _Optional[_Iterable[int]] = ..., num_verified: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., sampling: _Optional[_Union[_common_pb2.SamplingParams, _Mapping]] = ..., trace_context: _Optional[_Mapping[str, str]] = ..., method: _Optional[str] = ..., min_draft_probability: _Optional[float] = ..., want_bonus_guess: _Optional[bool] = ..., tree: _Optional[_Union[_common_pb2.TokenTree, _Mapping]] = ..., tenant: _Optional[str] = ..., isolated: _Optional[bool] = ..., prompt_length: _Optional[int] = ...) -> None: ...

class DraftResponse(_message.Message):
    __slots__ = ("num_verified", "draft_token_ids", "draft_distributions", "draft_seconds", "batch_size", "bonus_guess", "draft_parents")
    NUM_VERIFIED_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_DISTRIBUTIONS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    BONUS_GUESS_FIELD_NUMBER: _ClassVar[int]
    DRAFT_PARENTS_FIELD_NUMBER: _ClassVar[int]
    num_verified: int
    draft_token_ids: _containers.RepeatedScalarFieldContainer[int]
    draft_distributions: _containers.RepeatedCompositeFieldContainer[_common_pb2.SparseDistribution]
    draft_seconds: float
    batch_size: int
    bonus_guess: int
    draft_parents: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, num_verified: _Optional[int] = ..., draft_token_ids: _Optional[_Iterable[int]] = ..., draft_distributions: _Optional[_Iterable[_Union[_common_pb2.SparseDistribution, _Mapping]]] = ..., draft_seconds: _Optional[float] = ..., batch_size: _Optional[int] = ..., bonus_guess: _Optional[int] = ..., draft_parents: _Optional[_Iterable[int]] = ...) -> None: ...
