"""One-token forward steps through torch.compile, on a CPU, for drafts and targets.

A small model's eager step is mostly per-op overhead: the 1.5M-parameter demo draft runs
about a hundred small ops (norms, RoPE, attention, SwiGLU) around matrices of a few
microseconds each, and even the 14M-parameter demo target spends more of its step between
its matrices than in them. Inductor fuses those ops into a few C++ loops; matrices the
runner prepacked for oneDNN (16-bit) are multiplied by oneDNN's own op, which the compiled
code calls as it is (see _call_onednn_linear_as_is).

The step takes a batch of rows, each appending one token at its own position in its own
cache slot, and returns each row's logits; the new keys are written before any are read,
so several rows of one slot at consecutive positions are a verify. Each token attends to
its own slot's keys, those past its position masked to exact zeros, and its norms and
products are its own: a token's logits do not depend on the rows beside it or on how many
keys the batch reads, which a target's steps are checked for, to the bit, before they
serve (greedy speculative output is then target-only output). A draft may round
differently from its eager self, since verification keeps the output exact whatever it
proposes; a target's steps are compiled before its service serves, a draft's in a thread
of its own while the eager forward serves.

Compiling covers one row and any number of rows and keys (torch specialises a size of one:
that is a graph of its own), so nothing compiles while serving."""

from __future__ import annotations

import functools
import logging
import math
import os
import shutil
import threading
import time
import types

import torch

from specserve.model.llama import KEY_BLOCK, decoder_layer, final_outputs
from specserve.sampling import draft_noise, sparse_draws

log = logging.getLogger(__name__)


def _call_onednn_linear_as_is() -> None:
    """Makes inductor call oneDNN's product with a prepacked matrix (the runner's Linear) as
    it is, from the compiled code: its own lowering of that op takes only matrices it froze
    itself. Wrapping the op in a custom op of ours instead cost Python time at every product
    (docs/benchmarks/history/verifier-rounds.md, "Compiled steps without Python between products"). Results are
    bitwise the op's own. Affects only this process's compiles, which are all ours."""
    from torch._inductor import lowering

    op = torch.ops.mkldnn._linear_pointwise.default
    if op in lowering.fallbacks:
        return
    lowering.lowerings.pop(op, None)
    lowering.make_fallback(op, warn=False)


def _make_step(runner):
    """The one-token step over the runner's weights, which it holds as constants: compiled
    code specialised to them (only the rows and the keys read vary). Its layers are the eager
    forward's own (llama.decoder_layer); only attention differs: each token reads its own
    slot's keys up to its position."""
    spec = runner.spec
    heads, kv_heads, d, window = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.sliding_window or 0
    scale = 1 / math.sqrt(d)
    embed, norm, lm_head, layers, cos_table, sin_table = (
        runner.embed,
        runner.norm,
        runner.lm_head,
        runner.layers,
        runner._cos,
        runner._sin,
    )

    def step(
        k_cache: list[torch.Tensor],  # per layer [slots, kv_heads, max_len + KEY_BLOCK, d]: writes the new keys
        v_cache: list[torch.Tensor],
        tokens: torch.Tensor,  # [B] int64
        slots: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        writes: torch.Tensor,  # [3, W] int64: (row, slot, position) where each new key is stored
        key_index: torch.Tensor,  # [L] int64 0..L-1: the keys read per row, L > every position
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits [B, vocab] float32 of one token per row, and its normed hidden state [B,
        hidden]. A chain's rows store their keys in their own slots at their positions; a token
        tree's node also into the slot of every branch it lies on (see runner.TreeRows)."""
        batch, num_keys = tokens.shape[0], key_index.shape[0]
        x = embed[tokens].to(norm.dtype)  # [B, hidden]
        allowed = key_index[None, :] <= positions[:, None]  # [B, L]
        written_rows, written_slots, written_positions = writes[0], writes[1], writes[2]
        if window:
            allowed = allowed & (key_index[None, :] > positions[:, None] - window)

        def attend(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            k_cache[i][written_slots, :, written_positions] = k[written_rows]  # writes into the cache
            v_cache[i][written_slots, :, written_positions] = v[written_rows]
            keys = k_cache[i][slots, :, :num_keys]  # [B, kv_heads, L, d]
            values = v_cache[i][slots, :, :num_keys]
            grouped = q.view(batch, kv_heads, heads // kv_heads, d)  # [B, kv_heads, group, d]
            scores = torch.einsum("bkgd,bkld->bkgl", grouped, keys) * scale
            scores = scores.masked_fill(~allowed[:, None, None, :], float("-inf"))
            out = torch.einsum("bkgl,bkld->bkgd", torch.softmax(scores, dim=-1), values)  # [B, kv_heads, group, d]
            return out.reshape(batch, heads * d)

        cos, sin = cos_table[positions], sin_table[positions]  # [B, d]
        for i, layer in enumerate(layers):
            x = decoder_layer(x, layer, spec, cos, sin, functools.partial(attend, i))
        return final_outputs(x, norm, lm_head, spec.rms_norm_eps)  # [B, vocab], [B, hidden]

    return step


# A lone session's K drafts run as one compiled call of up to this many steps (greedy_run,
# sampled_run), its catch-up's last token the first step's, one graph per kind and count:
# each compiled call costs Python and guard checks besides its loops, a third of a demo draft
# step (docs/benchmarks.md), and a sampled step's draw in Python as much again.
RUN_STEPS = 8


class CompiledSteps:
    """A runner's one-token steps through torch.compile (see the module docstring). ready
    turns true once the compiled step has run and agreed with the eager forward. A draft's
    runs (greedy_run, sampled_run) compile afterwards, each kind when first asked for."""

    def __init__(self, runner, scratch_slot: int):
        self.runner = runner
        self.role = "target" if runner.row_invariant else "draft"
        self.scratch_slot = scratch_slot
        self.ready = False
        self.failed = False
        self._runs: dict[tuple[str, int], object] = {}  # (kind, steps) -> compiled run, once built
        self._asking = threading.Lock()
        self._asked: set[str] = set()  # the kinds of run ever asked for
        self._wanted: list[tuple[str, int]] = []  # runs not compiled yet
        self._support = 32  # the draws' support size sampled runs compile for: the first ask's
        self.thread: threading.Thread | None = None
        import torch._inductor.config

        # Inductor compiles in the calling thread, not in a pool of worker processes that
        # would take every core from a draft service, which goes on serving meanwhile.
        torch._inductor.config.compile_threads = 1
        _call_onednn_linear_as_is()
        self._owner = f"{self.role}_{id(runner):x}"
        self._step_function = _make_step(runner)
        self._compiled = torch.compile(_with_argmax(self._step_function, self._owner))

    @staticmethod
    def supported(runner) -> str | None:
        """Why this runner's steps cannot be compiled, or None when they can."""
        if runner.device.type != "cpu":
            return "the compiled step is built for CPUs only"
        linears = [runner.lm_head] + [
            m for layer in runner.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)
        ]
        if any(m.pad_single for m in linears):
            return "its matrices are row-independent float32 ones (a verifier's), which the compiled step does not take"
        compiler = os.environ.get("CXX") or "g++"
        if shutil.which(compiler) is None:
            return f"torch.compile needs a C++ compiler on a CPU and {compiler} is not on PATH (set CXX)"
        return None

    # Drafts started in one process compile one after another (inductor's configuration,
    # which start() sets for the length of a compile, is the process's).
    _serial_compiles = threading.Lock()

    def start(self) -> None:
        """Compiles and checks in a thread of its own (self.thread); the eager forward serves
        until then."""
        self._in_thread(self.compile)

    def _in_thread(self, work) -> None:
        """work in a thread of its own (self.thread), compiling serial: a draft's loops are
        compiled serial (inductor's cpp.threads, restored after): a small draft's loops gain
        nothing from a second thread, and wherever the other core is busy (the gateway, on one
        machine) each parallel loop waits for it (docs/benchmarks.md)."""

        def compile_serial() -> None:
            import torch._inductor.config

            with CompiledSteps._serial_compiles, torch._inductor.config.patch({"cpp.threads": 1}):
                work()

        self.thread = threading.Thread(target=compile_serial, name="compile-steps", daemon=True)
        self.thread.start()

    @property
    def compiling(self) -> bool:
        """Whether a compile runs: the steps', or a greedy run's."""
        thread = self.thread
        return thread is not None and thread.is_alive()

    @torch.inference_mode()
    def compile(self) -> None:
        """Compiles the graphs of one row and of several (on the scratch slot) and checks the
        one-row step against the eager forward (and a target's for batch independence); ready
        or failed once it returns."""
        log.info("compiling the %s's one-token steps", self.role)
        started = time.perf_counter()
        try:
            runner, slot = self.runner, self.scratch_slot
            length = min(KEY_BLOCK + 3, runner.max_len)
            prompt = [i % runner.spec.vocab_size for i in range(1, length + 1)]
            for cache in (*runner.k_cache, *runner.v_cache):
                cache[slot].zero_()
            noise = self._rounding_noise(slot, prompt)
            runner.forward_eager([slot], [0], [prompt[:-1]], [1])
            expected = runner.forward_eager([slot], [length - 1], [prompt[-1:]], [1])
            actual = self.step_with_argmax([slot], [length - 1], [prompt[-1]])
            # The logits, and the normed hidden state they came from (Medusa heads read it).
            for name, one, other, moved in (
                ("logits", actual[0][0], expected[0][0][0], noise[0]),
                ("hidden state", actual[2][0], expected[1][0][0], noise[1]),
            ):
                if not agrees(one, other, (moved - other).abs()):
                    raise RuntimeError(
                        f"compiled step's {name} differs from the eager forward by {(one - other).abs().max():.2e} "
                        f"(mean {(one - other).abs().mean():.2e}; a last bit of its input moves it by "
                        f"{(moved - other).abs().max():.2e})"
                    )
            # The graph of several rows (a size specialised by mistake recompiles here), and
            # the keys of a row at the end of its slot.
            self.step([slot] * 2, [length - 1, runner.max_len - 1], prompt[-2:])
            self.step([slot] * 3, list(range(length - 3, length)), prompt[-3:])
            if runner.row_invariant:
                self._check_batch_independence(slot, prompt)
        except Exception:  # noqa: BLE001 - any compiler or toolchain failure: the eager forward serves
            self.failed = True
            log.exception("torch.compile of the %s's steps failed; the eager forward serves", self.role)
            return
        self.ready = True
        log.info("compiled the %s's one-token steps in %.1f s", self.role, time.perf_counter() - started)

    def _rounding_noise(self, slot: int, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The eager forward's last logits and hidden state [vocab], [hidden] for prompt with
        every embedding row it reads one last bit larger in magnitude (in the embedding's own
        dtype): how far rounding alone moves this model's output (see agrees)."""
        runner = self.runner
        ids = torch.tensor(sorted(set(prompt)), device=runner.device)
        saved = runner.embed[ids].clone()
        bits = {2: torch.int16, 4: torch.int32}[saved.element_size()]
        runner.embed[ids] = (saved.view(bits) + 1).view(saved.dtype)  # the next value away from zero
        try:
            runner.forward_eager([slot], [0], [prompt[:-1]], [1])
            logits, hidden = runner.forward_eager([slot], [len(prompt) - 1], [prompt[-1:]], [1])
        finally:
            runner.embed[ids] = saved
        return logits[0][0], hidden[0][0]

    def greedy_run(self, slot: int, position: int, token: int, steps: int) -> list[int] | None:
        """A greedy draft of one session continued for steps steps as one call: token is fed at
        position, each step's argmax is fed next; returns the steps argmax tokens, and the
        slot then holds steps more keys. None where no run of that count is compiled yet: the
        first ask starts compiling every count, its own first, in the background (a few
        seconds of a core each), and the one-token steps serve meanwhile."""
        run = self._run_of("greedy", steps)
        return None if run is None else self._run(run, slot, position, token, steps)[0].tolist()

    def sampled_run(
        self, slot: int, position: int, token: int, temperature: float, top_p: float, noise: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """A sampled draft of one session continued as one call, a step per row of noise
        [steps, S] (specserve.sampling.draft_noise at the positions drawn): token is fed at
        position, each step's draw (sampling.sparse_draws) is fed next. Returns the tokens
        [steps], the supports' ids and q [steps, S]; None as for greedy_run."""
        self._support = noise.shape[1]  # the width its runs compile for (the service's)
        run = self._run_of("sampled", noise.shape[0])
        if run is None:
            return None
        made, ids, q = self._run(run, slot, position, token, noise.shape[0], (temperature, top_p, noise))
        return made[0], ids[0], q[0]

    def has_run(self, kind: str, steps: int) -> bool:
        """Whether the run of that kind and count is compiled; the first ask of a kind starts
        compiling its counts."""
        return self._run_of(kind, steps) is not None

    def _run_of(self, kind: str, steps: int):
        """The compiled run of that kind and count, or None; the first ask of a kind starts
        compiling its counts, this one first (K changes as it runs)."""
        run = self._runs.get((kind, steps))
        if run is None and 0 < steps <= RUN_STEPS and self.ready:
            with self._asking:
                if kind not in self._asked:
                    self._asked.add(kind)
                    idle = not self._wanted
                    self._wanted += [(kind, n) for n in (steps, *(n for n in range(1, RUN_STEPS + 1) if n != steps))]
                    if idle:
                        self._in_thread(self._compile_runs)
        return run

    @torch.inference_mode()
    def _compile_runs(self) -> None:
        """Each run asked for, compiled and checked on the scratch slot against as many
        one-token steps; a run that fails either is left to the steps."""
        runner, slot = self.runner, self.scratch_slot
        while True:
            with self._asking:
                if not self._wanted:
                    return
                kind, steps = self._wanted.pop(0)
            started = time.perf_counter()
            position = min(KEY_BLOCK, runner.max_len - steps)
            try:
                self._runs[kind, steps] = self._compile_run(kind, steps, slot, position)
            except Exception:  # noqa: BLE001 - the one-token steps serve this count
                log.exception("torch.compile of the draft's %s run of %d steps failed", kind, steps)
                continue
            log.info("compiled the draft's %s run of %d steps in %.1f s", kind, steps, time.perf_counter() - started)

    def _compile_run(self, kind: str, steps: int, slot: int, position: int):
        """The run compiled, once it made the tokens of as many one-token steps."""
        if kind == "greedy":
            run = torch.compile(_greedy_run(self._step_function, steps, self._owner))
            made, draws = self._run(run, slot, position, 5, steps)[0].tolist(), None
        else:
            run = torch.compile(_sampled_run(self._step_function, steps, self._owner))
            noise = draft_noise(0, position, steps, self._support, self.runner.device)
            made = self._run(run, slot, position, 5, steps, (1.0, 1.0, noise))[0][0].tolist()
            draws = functools.partial(sparse_draws, temperature=torch.tensor(1.0), top_p=torch.tensor(math.inf))
        expected, token = [], 5
        for i in range(steps):
            logits = self.step([slot], [position + i], [token])
            token = int(logits[0].argmax() if draws is None else draws(logits, noise=noise[i : i + 1])[0][0])
            expected.append(token)
        if made != expected:
            raise RuntimeError(f"{kind} run made {made}, its one-token steps {expected}")
        return run

    @torch.inference_mode()  # as it was compiled: another grad mode would compile it again, inline
    def _run(self, run, slot: int, position: int, token: int, steps: int, sampling: tuple | None = None):
        """A run's call; sampling: a sampled run's (temperature, top_p, noise). Its inputs
        are made here, in inference mode, as they were when it compiled (a tensor made
        outside fails a guard: a recompile)."""
        runner = self.runner
        num_keys = min(runner.max_len, -(-(position + steps) // KEY_BLOCK) * KEY_BLOCK)
        inputs = [torch.tensor([value], device=runner.device) for value in (token, slot, position)]
        key_index = torch.arange(num_keys, device=runner.device)
        torch._dynamo.mark_dynamic(key_index, 0)
        extra = (key_index,)
        if sampling is not None:
            temperature, top_p, noise = sampling
            top_p = top_p if top_p < 1 else math.inf  # the nucleus of 1 is every token: no sum's rounding cuts it
            extra = (key_index, torch.tensor(temperature), torch.tensor(top_p), noise.clone())
        return run(runner.k_cache, runner.v_cache, *inputs, *extra)  # [1, steps] first

    def _check_batch_independence(self, slot: int, prompt: list[int]) -> None:
        """A target's steps must give each token the same logits, to the bit, whether it is
        decoded alone, verified among K + 1 tokens of its row or batched with a row that reads
        many more keys: greedy speculative output is then target-only output. Tokens are fed
        one at a time, then the same ones at once, then beside a row far along the slot."""
        start = KEY_BLOCK - 2  # the third token's keys take a second block
        tokens, positions = prompt[start : start + 3], list(range(start, start + 3))
        alone = torch.cat([self.step([slot], [p], [t]) for p, t in zip(positions, tokens)])
        together = self.step([slot] * 3, positions, tokens)
        far = min(self.runner.max_len - 1, 5 * KEY_BLOCK)
        beside = self.step([slot] * 4, [*positions, far], [*tokens, tokens[0]])[:3]
        for name, logits in (("verified together", together), ("batched beside a longer row", beside)):
            if not torch.equal(logits, alone):
                raise RuntimeError(
                    f"compiled steps give tokens {name} other logits than alone (by up to "
                    f"{(logits - alone).abs().max():.2e}): a target's results would depend on its batch"
                )

    def step(self, slots: list[int], positions: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits [len(slots), vocab] float32 of one token per row."""
        return self.step_with_argmax(slots, positions, tokens)[0]

    def step_with_argmax(
        self,
        slots: list[int],
        positions: list[int],
        tokens: list[int],
        writes: tuple[list[int], list[int], list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logits [len(slots), vocab] float32 of one token per row, their argmax [len(slots)]
        and the normed hidden states [len(slots), hidden] they came from.
        writes: (row, slot, position) of every place a new key is stored, where
        that is not only each row's own (a token tree's nodes)."""
        runner = self.runner
        num_keys = min(runner.max_len, -(-(max(positions) + 1) // KEY_BLOCK) * KEY_BLOCK)
        device = runner.device
        if writes is None:
            writes = (list(range(len(slots))), slots, positions)
        inputs = [torch.tensor(values, device=device) for values in (tokens, slots, positions)]
        written = torch.tensor(writes, device=device)
        key_index = torch.arange(num_keys, device=device)
        for tensor in (*inputs, key_index):
            if tensor.shape[0] > 1:  # torch specialises a size of 1: a graph of its own
                torch._dynamo.mark_dynamic(tensor, 0)
        if written.shape[1] > 1:
            torch._dynamo.mark_dynamic(written, 1)
        return self._compiled(runner.k_cache, runner.v_cache, *inputs, written, key_index)


def agrees(compiled: torch.Tensor, eager: torch.Tensor, noise: torch.Tensor) -> bool:
    """Whether a compiled step's output is the eager forward's up to rounding: at most 1e-3 off,
    or, where the eager forward itself moves further when its input moves by a last bit
    (noise: that move, see CompiledSteps._rounding_noise), no more than twice as far, in its
    largest and its mean difference. Inductor sums a norm's or a softmax's terms in its own
    order; where the matrices are 16-bit, a last-bit change in an activation can round its
    16-bit copy the other way, and a deep model carries that on (30 layers of bfloat16
    products: logits a few hundredths apart). A small model with float32 inputs moves by
    millionths, so there 1e-3 holds. Either way, a target's decode and verify steps both run
    compiled and are checked against each other to the bit
    (CompiledSteps._check_batch_independence)."""
    difference = (compiled - eager).abs()
    return bool(difference.max() <= 1e-3 + 2 * noise.max() and difference.mean() <= 1e-3 + 2 * noise.float().mean())


def _greedy_run(step, steps: int, owner: str):
    """steps one-token steps of one session, each fed the argmax of the one before; returns
    the argmax tokens [1, steps]. A code object of its own per count and owner (see
    _with_argmax)."""

    def greedy_run(k_cache, v_cache, tokens, slots, positions, key_index) -> torch.Tensor:
        made = []
        for _ in range(steps):
            writes = torch.stack([torch.zeros_like(slots), slots, positions])
            tokens = step(k_cache, v_cache, tokens, slots, positions, writes, key_index)[0].argmax(-1)
            made.append(tokens)
            positions = positions + 1
        return torch.stack(made, 1)

    return _own_code(greedy_run, f"greedy_run_{steps}_{owner}")


def _sampled_run(step, steps: int, owner: str):
    """steps one-token steps of one session, each fed a draw from the one before
    (sampling.sparse_draws at the temperature and top_p given, with a row of noise [steps,
    S] each); returns the tokens [1, steps] and the supports' ids and q [1, steps, S]."""

    def sampled_run(k_cache, v_cache, tokens, slots, positions, key_index, temperature, top_p, noise):
        made, supports, kept = [], [], []
        for i in range(steps):
            writes = torch.stack([torch.zeros_like(slots), slots, positions])
            logits = step(k_cache, v_cache, tokens, slots, positions, writes, key_index)[0]
            tokens, ids, q = sparse_draws(logits, temperature, top_p, noise[i : i + 1])
            made.append(tokens)
            supports.append(ids)
            kept.append(q)
            positions = positions + 1
        return torch.stack(made, 1), torch.stack(supports, 1), torch.stack(kept, 1)

    return _own_code(sampled_run, f"sampled_run_{steps}_{owner}")


def _own_code(function, name: str):
    """function with a code object of its own, named name (torch.compile keeps its graphs per
    code object)."""
    code = function.__code__.replace(co_name=name)
    return types.FunctionType(code, function.__globals__, name, None, function.__closure__)


def _with_argmax(step, owner: str):
    """The step, also returning each row's argmax (a greedy draft's token, or a greedy
    decision's, computed in the compiled loops instead of by an op of its own) and its
    normed hidden state.

    The function has a code object of its own, named for owner: torch.compile keeps its
    graphs per code object, so with one shared code a draft's and a target's steps in one
    process (a verifier that drafts) would be recompiled as one function of dynamic weight
    shapes (generic loops, and every call checked against the other's graphs first)."""

    def step_with_argmax(*args) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits, hidden = step(*args)
        return logits, logits.argmax(-1), hidden

    return _own_code(step_with_argmax, f"step_with_argmax_{owner}")
