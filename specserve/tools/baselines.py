"""The rows `specserve bench` runs in its own process beside the stack: what a user would run
instead of a server, on the same prompts. transformers' generate() of the target alone or
with the draft as its assistant model, and llama-cpp-python on the target's GGUF file, plain
or with its prompt-lookup drafting.

Every row here sees the prompt token ids the stack's gateway makes (prompt_token_ids), and
is timed per request, prompt processing included, as one client of the stack is. A request's
completion tokens are the tokens it generated, its end-of-sequence token included.
"""

from __future__ import annotations

import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import NamedTuple

# The methods of the rows this module runs, one client each, beside the stack's rows.
TRANSFORMERS_ROWS = ("hf_target", "hf_assisted")
LLAMA_CPP_ROWS = ("llama_cpp", "llama_cpp_lookup")
LOCAL = TRANSFORMERS_ROWS + LLAMA_CPP_ROWS


class Sample(NamedTuple):
    """One request of an in-process row."""

    tokens: int  # completion tokens
    seconds: float  # wall time, prompt processing included


def prompt_text(tokenizer, prompt) -> str:
    """A prompt as the text the gateway tokenises: chat messages rendered by the model's chat
    template with the assistant's turn opened, a completion's prompt as it is."""
    if isinstance(prompt, list):
        return tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    return prompt


def prompt_token_ids(tokenizer, prompt) -> list[int]:
    """The gateway's ids of a prompt: a rendered chat template carries its special tokens in
    its text, so the tokenizer adds none; a completion's prompt gets the tokenizer's own."""
    text = prompt_text(tokenizer, prompt)
    return list(tokenizer(text, add_special_tokens=not isinstance(prompt, list))["input_ids"])


class Transformers:
    """transformers' generate(), target alone or with the draft as assistant, with the models
    in each dtype asked for; draft_dir None: the target alone."""

    def __init__(self, target_dir: str, draft_dir: str | None, dtypes: list[str]):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(target_dir)

        def load(path: str, dtype: str):
            return AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()

        self.targets = {dtype: load(target_dir, dtype) for dtype in dtypes}
        self.drafts = {dtype: load(draft_dir, dtype) for dtype in dtypes} if draft_dir else {}

    def run(self, prompts: list, dtype: str, assisted: bool, temperature: float, max_tokens: int) -> list[Sample]:
        samples = []
        for seed, prompt in enumerate(prompts):
            ids = self.torch.tensor([prompt_token_ids(self.tokenizer, prompt)])  # [1, prompt tokens]
            kwargs = {"max_new_tokens": max_tokens, "do_sample": temperature > 0}
            if temperature > 0:
                kwargs["temperature"] = temperature
                self.torch.manual_seed(seed)
            if assisted:
                kwargs["assistant_model"] = self.drafts[dtype]
            started = time.perf_counter()
            with self.torch.inference_mode():
                out = self.targets[dtype].generate(ids, attention_mask=self.torch.ones_like(ids), **kwargs)
            samples.append(Sample(out.shape[1] - ids.shape[1], time.perf_counter() - started))
        return samples


class LlamaCpp:
    """llama-cpp-python's Llama objects, one per row method: "llama_cpp" plain, and
    "llama_cpp_lookup" with LlamaPromptLookupDecoding as its draft model where the bench
    asked for it. Each is fed the target tokenizer's ids and stops at the target's
    end-of-sequence ids, as the stack does."""

    def __init__(self, models: dict, tokenizer, eos_token_ids: tuple[int, ...]):
        self.models = models
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def run(self, prompts: list, method: str, temperature: float, max_tokens: int) -> list[Sample]:
        llama = self.models[method]
        samples = []
        for seed, prompt in enumerate(prompts):
            ids = prompt_token_ids(self.tokenizer, prompt)
            started = time.perf_counter()
            tokens = self._generate(llama, ids, temperature, seed, max_tokens)
            samples.append(Sample(tokens, time.perf_counter() - started))
        return samples

    def _generate(self, llama, ids: list[int], temperature: float, seed: int, max_tokens: int) -> int:
        # Llama.generate reuses the KV cache of the longest prefix it shares with the previous
        # request; the bench sends each prompt once per row, so a row after another on the
        # same prompt would skip its prompt. reset() forgets it: every request pays its whole
        # prompt, as in the other in-process rows.
        llama.reset()
        llama.set_seed(seed)
        tokens = 0
        # Plain temperature sampling (greedy at 0), as the stack's requests ask: no top-k,
        # top-p, min-p or repeat penalty, which llama-cpp-python otherwise applies by default.
        for token in llama.generate(ids, temp=temperature, top_k=0, top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            tokens += 1
            if token in self.eos_token_ids or tokens >= max_tokens:
                break
        return tokens

    def mismatched_prompts(self, prompts: list) -> int:
        """How many prompts llama.cpp's own tokenizer splits otherwise than the target's: each
        row is fed the target's ids, so a mismatch means the GGUF's vocabulary is not the
        target's, not that the rows saw different prompts."""
        llama = self.models["llama_cpp"]
        count = 0
        for prompt in prompts:
            ids = prompt_token_ids(self.tokenizer, prompt)
            theirs = llama.tokenize(prompt_text(self.tokenizer, prompt).encode(), add_bos=False, special=True)
            count += ids not in (theirs, [llama.token_bos(), *theirs])
        return count


def prompt_lookup_class():
    """llama-cpp-python's LlamaPromptLookupDecoding, or None where the installed version has
    none (raises ImportError without llama-cpp-python)."""
    import llama_cpp.llama_speculative

    return getattr(llama_cpp.llama_speculative, "LlamaPromptLookupDecoding", None)


# A batch of tokens through the model in a child process: the first batched decode is where
# llama.cpp's extra buffer types (AMX tiles, repacked weights) run.
DECODE_PROBE = "import llama_cpp, sys; llama_cpp.Llama(sys.argv[1], n_ctx=64, verbose=False).eval(list(range(1, 33)))"


def extra_buffers_decode(gguf: str) -> bool:
    """Whether llama.cpp decodes the GGUF file with its extra buffer types on this machine. A
    virtual machine can report AMX and not let a process use it: llama.cpp picks AMX for the
    weights and its first batched decode kills the process, which a child process can afford."""
    return subprocess.run([sys.executable, "-c", DECODE_PROBE, gguf], capture_output=True, timeout=300).returncode == 0


@contextmanager
def _without_extra_buffers():
    """Llama objects made meanwhile keep their weights in plain CPU buffers. Llama takes no
    use_extra_bufts: it starts its model parameters from llama_model_default_params(), so that
    is what changes, while the bench (one thread) loads."""
    import llama_cpp.llama_cpp as api

    defaults = api.llama_model_default_params

    def plain_buffers():
        params = defaults()
        params.use_extra_bufts = False
        return params

    api.llama_model_default_params = plain_buffers
    try:
        yield
    finally:
        api.llama_model_default_params = defaults


def load_llama_cpp(
    gguf: str,
    target_dir: str,
    threads: int,
    lookup_tokens: int,
    prompts: list,
    max_tokens: int,
    tokenizer=None,
    extra_buffers: bool = True,
) -> LlamaCpp:
    """Llama objects on the GGUF file with threads threads, their context room for the longest
    of prompts, its completion and a round's drafts; lookup_tokens > 0 adds the prompt-lookup
    one, drafting up to lookup_tokens tokens a round. tokenizer: the target's, where loaded;
    extra_buffers False: the weights in plain CPU buffers (see extra_buffers_decode)."""
    from llama_cpp import Llama
    from transformers import AutoConfig, AutoTokenizer

    from specserve.model.loading import _eos_token_ids

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(target_dir)
    eos = _eos_token_ids(Path(target_dir), AutoConfig.from_pretrained(target_dir), tokenizer)  # the stack's
    longest = max(len(prompt_token_ids(tokenizer, prompt)) for prompt in prompts)
    # With a draft model llama-cpp-python keeps logits for every position of the context, a
    # vocabulary's floats each: a context no larger than the bench needs keeps that small.
    context = -(-(longest + max_tokens + lookup_tokens + 1) // 256) * 256

    def load(draft_model=None):
        with nullcontext() if extra_buffers else _without_extra_buffers():
            return Llama(
                model_path=gguf,
                n_ctx=context,
                n_batch=min(512, context),
                n_threads=threads,
                n_threads_batch=threads,
                draft_model=draft_model,
                verbose=False,
            )

    models = {"llama_cpp": load()}
    if lookup_tokens > 0:
        models["llama_cpp_lookup"] = load(prompt_lookup_class()(num_pred_tokens=lookup_tokens))
    return LlamaCpp(models, tokenizer, eos)
