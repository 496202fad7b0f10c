"""Model backends with one interface: our Llama-family runner, or transformers as the
fallback for architectures the runner does not know (chosen automatically and logged).

A KVSequence is one session's place in a backend's KV cache. forward() appends tokens to
several sequences in one call and returns the logits of each row's last tokens.
"""

from specserve.model.backends.base import Backend, ForwardRow, KVSequence, TreeNodes, forward_in_budget
from specserve.model.backends.hf import TransformersBackend
from specserve.model.backends.runner import RunnerBackend

__all__ = [
    "Backend",
    "ForwardRow",
    "KVSequence",
    "RunnerBackend",
    "TransformersBackend",
    "TreeNodes",
    "forward_in_budget",
]
