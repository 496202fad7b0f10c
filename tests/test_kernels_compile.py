"""Every Triton kernel compiles for a Hopper GPU (sm_90), here without one. The interpreter
that runs the kernels in the other tests executes them as Python and checks no types; this
runs Triton's real compiler to PTX and, where Triton ships ptxas, to machine code."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, sys, tempfile
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from specserve_kernels import attention_triton, penalties_triton, rejection_triton, tree_triton

    def pointers(*names, dtype):
        return {name: f"*{dtype}" for name in names}

    def ints(*names):
        return {name: "i32" for name in names}

    split = {**pointers("partial_out_ptr", "partial_stats_ptr", dtype="fp32"),
             **pointers("q_ptr", "k_ptr", "v_ptr", dtype="bf16"), **pointers("slots_ptr", "positions_ptr", dtype="i64"),
             **ints("q_stride_t", "q_stride_h", "cache_stride_slot", "cache_stride_head", "heads", "max_splits",
                    "group", "head_dim", "window"), "scale": "fp32"}
    combine = {**pointers("out_ptr", dtype="bf16"), **pointers("partial_out_ptr", "partial_stats_ptr", dtype="fp32"),
               **pointers("positions_ptr", dtype="i64"),
               **ints("out_stride_t", "out_stride_h", "heads", "max_splits", "head_dim", "window")}
    rejection = {**pointers("output_ptr", "num_accepted_ptr", "draft_ids_ptr", "num_draft_ptr", "q_ids_ptr",
                            dtype="i64"),
                 **pointers("target_probs_ptr", "q_probs_ptr", "uniforms_ptr", "exponentials_ptr", dtype="fp32"),
                 **ints("k_max", "vocab", "support")}
    greedy = {**pointers("output_ptr", "num_accepted_ptr", "draft_ids_ptr", "num_draft_ptr", dtype="i64"),
              **pointers("target_logits_ptr", dtype="fp32"), **ints("k_max", "vocab")}
    tree = {**pointers("output_ptr", "num_accepted_ptr", "path_ptr", "parents_ptr", "tokens_ptr", "num_nodes_ptr",
                       "q_ids_ptr", dtype="i64"),
            **pointers("target_probs_ptr", "q_probs_ptr", "uniforms_ptr", "exponentials_ptr", dtype="fp32"),
            **ints("n_max", "d_max", "vocab", "support")}
    penalties = {**pointers("scores_ptr", "counts_ptr", dtype="fp32"),
                 **pointers("rows_ptr", "tokens_ptr", dtype="i64"),
                 **pointers("seen_ptr", dtype="u8"), **ints("num_entries", "vocab"),
                 "presence": "fp32", "frequency": "fp32", "repetition": "fp32"}
    kernels = [
        (attention_triton._split_attention_kernel, split, {"SPLIT_KEYS": 256, "BLOCK_N": 64, "BLOCK_D": 128}),
        (attention_triton._combine_kernel, combine, {"SPLIT_KEYS": 256, "BLOCK_D": 128}),
        (rejection_triton._rejection_sample_kernel, rejection, {"K_BLOCK": 8, "S_BLOCK": 64, "V_BLOCK": 1024}),
        (rejection_triton._greedy_verify_kernel, greedy, {"K_BLOCK": 8, "V_BLOCK": 1024}),
        (tree_triton._tree_rejection_sample_kernel, tree, {"S_BLOCK": 64, "V_BLOCK": 1024}),
        (penalties_triton._penalties_kernel, penalties, {"BLOCK": 256}),
    ]
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = os.path.join(bin_dir, "ptxas-blackwell")  # the newer of the two Triton ships: reads its PTX
    for kernel, signature, constants in kernels:
        names = [p.name for p in kernel.params]
        signature = {**signature, **{name: "constexpr" for name in constants}}
        assert sorted(signature) == sorted(names), (kernel.__name__, sorted(set(names) ^ set(signature)))
        signature = {name: signature[name] for name in names}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants),
                                  target=GPUTarget("cuda", 90, 32))
        assert ".entry" in compiled.asm["ptx"], kernel.__name__
        if os.path.exists(ptxas):
            with tempfile.NamedTemporaryFile("w", suffix=".ptx") as ptx:
                ptx.write(compiled.asm["ptx"])
                ptx.flush()
                result = subprocess.run([ptxas, "--gpu-name=sm_90a", ptx.name, "-o", os.devnull],
                                        capture_output=True, text=True)
            assert result.returncode == 0, (kernel.__name__, result.stderr)
        print("compiled", kernel.__name__)
    """
)


def test_every_triton_kernel_compiles_for_sm_90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, do not interpret
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT, env=env
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("compiled") == 6, result.stdout
