"""Our own runner for the Llama family (Llama 2/3, Mistral, Qwen2, Qwen3, the demo pair),
loading Hugging Face config.json + safetensors directly.

One forward serves a ragged batch: each row appends its own number of tokens at its own
position in its own KV-cache slot (a prefill chunk, a verify of K + 1, a decode of 1), so
concurrent sessions share every weight read. Rolling a row back is setting its length:
what lies past it is overwritten by the next forward and masked until then. The layers'
functions are specserve/model/llama.py's; the weights are built by weights.py.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from pathlib import Path

import torch
import torch.nn.functional as F

import specserve_kernels.attention as attention_kernels
from specserve.model.compiled_steps import CompiledSteps
from specserve.model.llama import (
    EXACT_MAX_QUERIES,
    KEY_BLOCK,
    BatchLayout,
    RunnerSpec,
    UnsupportedModel,
    decoder_layer,
    final_outputs,
    rope_tables,
)
from specserve.model.weights import Weights, precise_copy
from specserve_kernels.attention_reference import exact_attention_reference

__all__ = ["EXACT_MAX_QUERIES", "KEY_BLOCK", "LlamaRunner", "RunnerSpec", "UnsupportedModel"]

log = logging.getLogger(__name__)


class LlamaRunner:
    def __init__(
        self,
        directory: str,
        device: torch.device,
        dtype: torch.dtype,
        num_slots: int,
        max_len: int,
        matmul_dtype: torch.dtype | None = None,
        num_layers: int | None = None,
        exact_attention: bool = True,
        row_invariant: bool = True,
        compile_steps: bool = False,
        precise_scoring: bool = False,
    ):
        """dtype is what activations, norms and the KV cache use; matmul_dtype is what the
        weight matrices are kept and multiplied in (None: see auto_matmul_dtype). num_layers
        keeps only the first layers (then the final norm and LM head): an early-exit model.
        row_invariant=False (a draft's) skips the check that products do not depend on the row
        count, and float32 matrices need not be prepacked for it.
        compile_steps (on a CPU) builds one-token steps (specserve/model/compiled_steps.py): a
        target's before the constructor returns, a draft's in the background; once ready,
        rows of up to EXACT_MAX_QUERIES tokens take them. precise_scoring keeps a float32 copy
        of the matrices where they are 16-bit on a CPU (weights.precise_copy), for
        prompts' logprobs (forward_scoring)."""
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(directory, local_files_only=True)
        self.spec = RunnerSpec.from_config(config)
        if num_layers is not None:
            self.spec = dataclasses.replace(self.spec, num_layers=min(num_layers, self.spec.num_layers))
        self.device, self.dtype, self.row_invariant = device, dtype, row_invariant
        self.max_len = min(max_len, self.spec.max_positions)
        self._cos, self._sin = rope_tables(config, self.max_len, device, dtype)
        self.exact_attention = exact_attention
        self._exact_attention = self._exact_attention_kernel()
        weights = Weights(Path(directory), self.spec, device, dtype, matmul_dtype, row_invariant)
        self.matmul_dtype, self.draft_matmul, self.int4 = weights.matmul_dtype, weights.draft_matmul, weights.int4
        self.embed, self.norm, self.lm_head, self.layers = weights.embed, weights.norm, weights.lm_head, weights.layers
        self.precise_weights = precise_copy(
            Path(directory), self.spec, device, dtype, self.matmul_dtype, precise_scoring
        )
        self._allocate_cache(num_slots, compile_steps)
        self.compiled_steps = self._start_compiled_steps() if compile_steps else None

    def _exact_attention_kernel(self):
        """The Triton kernel on a GPU where it passes its check (else one SDPA call per
        token); on a CPU, the kernels' CPU path."""
        spec = self.spec
        shapes = (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.sliding_window)
        if self.device.type == "cuda" and not attention_kernels.triton_kernel_works(self.device, self.dtype, *shapes):
            log.warning(
                "the Triton attention kernel failed its check on this GPU: decode and verify attention run "
                "one SDPA call per token instead (slower, as exact)"
            )
            return exact_attention_reference
        return attention_kernels.exact_attention

    def _allocate_cache(self, num_slots: int, compile_steps: bool) -> None:
        """Head-major, so that a row's keys of one head are contiguous: attention reads them as
        they lie (a strided view made CPU attention of one query four times slower). One slot
        more than served for the compiled steps' warm-up, never handed out; and a key block
        more than served, never written: the keys the steps read (a multiple of the block) are
        then never all the slot holds, a size torch would compile anew. Uninitialised: a slot
        is zeroed when handed out (allocate), so on the CPU only the slots ever used commit
        memory."""
        extra = KEY_BLOCK if compile_steps else 0
        shape = (num_slots + compile_steps, self.spec.num_kv_heads, self.max_len + extra, self.spec.head_dim)
        self.k_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        self.v_cache = [torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.spec.num_layers)]
        self.num_slots = num_slots
        self._free_slots = list(range(num_slots - 1, -1, -1))
        self._never_used = set(self._free_slots)  # their memory is uninitialised

    def _start_compiled_steps(self) -> CompiledSteps | None:
        why_not = CompiledSteps.supported(self)
        if why_not is not None:
            log.info("one-token steps run eager: %s", why_not)
            return None
        steps = CompiledSteps(self, scratch_slot=self.num_slots)
        if self.row_invariant:
            # A target's logits must not change while it serves (its greedy output, alone or
            # verifying, is one sequence), so it compiles before serving and the eager forward
            # serves only where compiling fails.
            steps.compile()
        else:
            steps.start()
        return steps

    def allocate(self) -> int | None:
        """A free cache slot, zeroed, or None when all are taken."""
        if not self._free_slots:
            return None
        slot = self._free_slots.pop()
        # Zeroed when first handed out (a masked 0 weight times a NaN of uninitialised memory
        # is NaN); later it holds an earlier session's keys, finite (zeroing the demo target's
        # 20 MB slot at every request took milliseconds of each one's time to first token).
        if slot in self._never_used:
            for cache in (*self.k_cache, *self.v_cache):
                cache[slot].zero_()
            self._never_used.discard(slot)
        return slot

    def release(self, slot: int) -> None:
        self._free_slots.append(slot)

    @property
    def free_slots(self) -> int:
        return len(self._free_slots)

    def forward(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> list[torch.Tensor]:
        """Row b appends tokens[b] to slot slots[b] at positions starts[b]..; returns per row the
        logits of its last num_logits[b] tokens: [num_logits[b], vocab] float32."""
        return self.forward_with_argmax(slots, starts, tokens, num_logits)[0]

    def forward_with_argmax(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> tuple[list[torch.Tensor], list[list[int] | None], list[torch.Tensor]]:
        """forward(), per row the argmax of its logits where the compiled steps made it (None
        where eager), and the normed hidden states the logits came from."""
        counts = [len(t) for t in tokens]
        assert all(n > 0 for n in counts), "every row appends at least one token"
        assert all(s + n <= self.max_len for s, n in zip(starts, counts)), "a row runs past its cache slot"
        steps = self.compiled_steps
        if steps is not None and steps.ready:
            return self._forward_as_token_rows(slots, starts, tokens, num_logits)
        logits, hidden = self.forward_eager(slots, starts, tokens, num_logits)
        return logits, [None] * len(tokens), hidden

    @torch.inference_mode()
    def forward_last(
        self, slots: list[int], starts: list[int], tokens: list[list[int]]
    ) -> tuple[torch.Tensor, list[int]]:
        """forward() for the last token of each row only, with its argmax: ([batch, vocab]
        float32 logits, [batch] argmax), what a draft's next token needs. Through the compiled
        steps, the argmax comes out of the step itself."""
        assert all(s + len(t) <= self.max_len for s, t in zip(starts, tokens)), "a row runs past its cache slot"
        steps = self.compiled_steps
        if steps is None or not steps.ready or any(len(t) > EXACT_MAX_QUERIES for t in tokens):
            logits = torch.cat(self.forward(slots, starts, tokens, [1] * len(tokens)))
            return logits, logits.argmax(-1).tolist()
        token_slots = [slot for slot, row in zip(slots, tokens) for _ in row]
        positions = [start + i for start, row in zip(starts, tokens) for i in range(len(row))]
        logits, argmax, _ = steps.step_with_argmax(token_slots, positions, [t for row in tokens for t in row])
        if len(token_slots) == len(tokens):  # one token per row: the usual draft step
            return logits, argmax.tolist()
        last = torch.tensor(list(itertools.accumulate(len(row) for row in tokens))) - 1
        return logits[last], argmax[last].tolist()

    @torch.inference_mode()
    def _forward_as_token_rows(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int]
    ) -> tuple[list[torch.Tensor], list[list[int] | None], list[torch.Tensor]]:
        """forward_with_argmax() with compiled steps: every token of the rows of at most
        EXACT_MAX_QUERIES tokens (decodes, verifies, a draft's steps and catch-ups, short
        prompts) is a row of one compiled step, in which each token attends to its own slot's
        keys up to its own position, so a target's results do not depend on K or on the
        batch; longer rows (prefills) run eager."""
        out: list[torch.Tensor] = [None] * len(tokens)  # type: ignore[list-item]
        hidden: list[torch.Tensor] = [None] * len(tokens)  # type: ignore[list-item]
        best: list[list[int] | None] = [None] * len(tokens)
        short = [b for b, t in enumerate(tokens) if len(t) <= EXACT_MAX_QUERIES]
        long = [b for b, t in enumerate(tokens) if len(t) > EXACT_MAX_QUERIES]
        if long:
            pick = lambda values: [values[b] for b in long]  # noqa: E731
            eager = self.forward_eager(pick(slots), pick(starts), pick(tokens), pick(num_logits))
            for b, logits, normed in zip(long, *eager):
                out[b], hidden[b] = logits, normed
        if short:
            token_slots = [slots[b] for b in short for _ in tokens[b]]
            positions = [starts[b] + i for b in short for i in range(len(tokens[b]))]
            logits, argmax, normed = self.compiled_steps.step_with_argmax(
                token_slots, positions, [t for b in short for t in tokens[b]]
            )
            argmax, end = argmax.tolist(), 0
            for b in short:
                end += len(tokens[b])
                kept = slice(end - num_logits[b], end)
                out[b], best[b], hidden[b] = logits[kept], argmax[kept], normed[kept]
        return out, best, hidden

    @torch.inference_mode()
    def forward_nodes(
        self, tokens: list[int], positions: list[int], read_slots: list[int], write_slots: list[list[int]]
    ) -> tuple[torch.Tensor, list[int] | None, torch.Tensor]:
        """One token per row, at its position, attending to the keys of read_slots[t] up to its
        position, its own key and value stored in every slot of write_slots[t] (read_slots[t]
        among them): the nodes of token trees (specserve/model/trees.py), each slot a branch.
        A node reads its branch as the chain of its path would, so its logits are that
        chain's, to the bit. Returns (logits [T, vocab] float32, their argmax where the
        compiled steps made it, else None, the normed hidden states [T, hidden])."""
        assert self.exact_attention, "token trees need exact attention"
        assert all(p < self.max_len for p in positions), "a node runs past its cache slot"
        writes = (
            [t for t, slots in enumerate(write_slots) for _ in slots],
            [slot for slots in write_slots for slot in slots],
            [positions[t] for t, slots in enumerate(write_slots) for _ in slots],
        )
        steps = self.compiled_steps
        if steps is not None and steps.ready:
            logits, argmax, hidden = steps.step_with_argmax(read_slots, positions, tokens, writes)
            return logits, argmax.tolist(), hidden
        layout = BatchLayout(
            slots=torch.tensor(read_slots, device=self.device),
            token_slots=torch.tensor(read_slots, device=self.device),
            token_positions=torch.tensor(positions, device=self.device),
            pad_index=torch.arange(len(tokens), device=self.device),
            n_max=1,
            kv_len=max(positions) + 1,
            mask=None,
            single=None,
            exact=True,
            writes=tuple(torch.tensor(column, device=self.device) for column in writes),
        )
        x = self._layers(torch.tensor(tokens, dtype=torch.long, device=self.device), layout, self)
        logits, hidden = final_outputs(x, self.norm, self.lm_head, self.spec.rms_norm_eps)
        return logits, None, hidden

    def copy_positions(self, source: int, target: int, start: int, end: int) -> None:
        """The keys and values of positions start..end - 1 of slot source into slot target."""
        if end > start and source != target:
            for cache in (*self.k_cache, *self.v_cache):
                cache[target, :, start:end] = cache[source, :, start:end]

    def forward_scoring(self, slot: int, start: int, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """One row's logits of every token and their normed hidden states, op by op, with the
        float32 matrices where the runner keeps them (precise_weights): a prompt's logprobs."""
        logits, hidden = self.forward_eager([slot], [start], [tokens], [len(tokens)], self.precise_weights)
        return logits[0], hidden[0]

    @torch.inference_mode()
    def forward_eager(
        self, slots: list[int], starts: list[int], tokens: list[list[int]], num_logits: list[int], weights=None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """forward() op by op: per row its logits, and the normed hidden states they came from
        (weights: other matrices than the runner's own, of the same checkpoint)."""
        w = weights or self
        counts = [len(t) for t in tokens]
        layout = self._layout(slots, starts, counts)
        x = self._layers(
            torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=self.device), layout, w
        )
        if len(counts) == 1:
            selected = x[-num_logits[0] :]
        else:
            ends = torch.tensor(counts, device=self.device).cumsum(0)
            picked = torch.cat([torch.arange(int(e) - k, int(e), device=self.device) for e, k in zip(ends, num_logits)])
            selected = x[picked]
        logits, hidden = final_outputs(selected, w.norm, w.lm_head, self.spec.rms_norm_eps)
        return list(logits.split(num_logits)), list(hidden.split(num_logits))  # [sum(num_logits), vocab / hidden]

    def _layers(self, ids: torch.Tensor, layout: BatchLayout, weights) -> torch.Tensor:
        """The decoder layers (of weights) over tokens ids [T]: the last layer's x [T, hidden]."""
        x = weights.embed[ids].to(self.dtype)  # [T, hidden]
        cos, sin = self._rope(layout)  # [T, head_dim]
        for index, layer in enumerate(weights.layers):
            x = decoder_layer(x, layer, self.spec, cos, sin, self._attend(index, layout))
        return x

    def _layout(self, slots: list[int], starts: list[int], counts: list[int]) -> BatchLayout:
        # Index lists are built in Python: a forward's few hundred ints cost less that way
        # than the dozen small tensor ops that would make them.
        device = self.device
        batch, n_max = len(counts), max(counts)
        kv_len = max(s + n for s, n in zip(starts, counts))
        rows = [b for b, n in enumerate(counts) for _ in range(n)]  # [T]
        local = [i for n in counts for i in range(n)]
        positions = [starts[b] + i for b, i in zip(rows, local)]
        exact = self.exact_attention and n_max <= EXACT_MAX_QUERIES
        mask = None
        if not exact and (n_max > 1 or batch > 1 or self.spec.sliding_window is not None):
            # A lone row of one token attends to every cached key, which SDPA does unmasked.
            starts_t, counts_t = torch.tensor(starts, device=device), torch.tensor(counts, device=device)
            query_pos = starts_t[:, None] + torch.arange(n_max, device=device)[None, :]  # [batch, n_max]
            key_pos = torch.arange(kv_len, device=device)
            allowed = key_pos[None, None, :] <= query_pos[:, :, None]  # causal, offset per row
            if self.spec.sliding_window is not None:
                allowed &= key_pos[None, None, :] > query_pos[:, :, None] - self.spec.sliding_window
            padding = torch.arange(n_max, device=device)[None, :] >= counts_t[:, None]  # [batch, n_max]
            allowed[padding] = key_pos == 0  # padded queries attend somewhere (their output is dropped)
            mask = allowed[:, None]  # [batch, 1, n_max, kv_len]
        return BatchLayout(
            slots=torch.tensor(slots, device=device),
            token_slots=torch.tensor([slots[b] for b in rows], device=device),
            token_positions=torch.tensor(positions, device=device),
            pad_index=torch.tensor([b * n_max + i for b, i in zip(rows, local)], device=device),
            n_max=n_max,
            kv_len=kv_len,
            mask=mask,
            single=(slots[0], starts[0]) if batch == 1 else None,
            exact=exact,
        )

    def _rope(self, layout: BatchLayout) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, head_dim] of each token's position, from the table made at load."""
        if layout.single is not None:
            start = layout.single[1]
            end = start + layout.token_positions.shape[0]
            return self._cos[start:end], self._sin[start:end]  # views
        return self._cos[layout.token_positions], self._sin[layout.token_positions]

    def _attend(self, index: int, layout: BatchLayout):
        """Layer index's attention over the batch's cache (llama.Attend): the new keys and
        values written into their slots, then query by query (exact) or in one masked call."""
        spec = self.spec
        k_cache, v_cache = self.k_cache[index], self.v_cache[index]  # [slots, kv_heads, max_len, d]

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if layout.writes is not None:
                written, slots, positions = layout.writes
                k_cache[slots, :, positions] = k[written]  # writes the new keys, on every branch
                v_cache[slots, :, positions] = v[written]
            elif layout.single is not None:
                slot, start = layout.single
                k_cache[slot, :, start : start + k.shape[0]] = k.transpose(0, 1)  # writes the new keys
                v_cache[slot, :, start : start + k.shape[0]] = v.transpose(0, 1)
            else:
                k_cache[layout.token_slots, :, layout.token_positions] = k  # writes the new keys: [T, kv_heads, d]
                v_cache[layout.token_slots, :, layout.token_positions] = v
            if not layout.exact:
                return self._attention_masked(q, k_cache, v_cache, layout)
            scale = 1 / math.sqrt(spec.head_dim)
            out = self._exact_attention(
                q,
                k_cache,
                v_cache,
                layout.token_slots,
                layout.token_positions,
                spec.sliding_window,
                scale,
                layout.kv_len,
            )
            return out.reshape(-1, spec.num_heads * spec.head_dim)  # [T, heads d]

        return attend

    def _attention_masked(self, q: torch.Tensor, k_cache, v_cache, layout: BatchLayout) -> torch.Tensor:
        """All queries of the batch in one masked call over the rows' padded keys."""
        heads, d = q.shape[1], q.shape[2]
        if layout.single is not None:
            slot, _ = layout.single
            keys = k_cache[slot, None, :, : layout.kv_len]  # [1, kv_heads, kv_len, d], a view
            values = v_cache[slot, None, :, : layout.kv_len]
            queries = q[None].transpose(1, 2)  # [1, heads, n, d]
        else:
            batch = layout.slots.shape[0]
            keys = k_cache[layout.slots, :, : layout.kv_len]  # [batch, kv_heads, kv_len, d]
            values = v_cache[layout.slots, :, : layout.kv_len]
            padded = q.new_zeros(batch * layout.n_max, heads, d)
            padded[layout.pad_index] = q
            queries = padded.view(batch, layout.n_max, heads, d).transpose(1, 2)  # [batch, heads, n_max, d]
        out = F.scaled_dot_product_attention(
            queries, keys, values, attn_mask=layout.mask, scale=1 / math.sqrt(d), enable_gqa=heads != keys.shape[1]
        )  # [batch, heads, n_max, d]
        out = out.transpose(1, 2).reshape(-1, heads * d)  # [batch * n_max, heads d]
        return out if layout.single is not None else out[layout.pad_index]  # [T, heads d]
