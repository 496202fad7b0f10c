#!/usr/bin/env bash
# The prepared GPU check: run on a lent GPU machine from the repository root, with .whl/
# carried (scripts/gpu_wheels.sh makes it). Benchmarks the demo pair on CUDA in bfloat16 and
# writes results under $OUT (the device tool fetches them). Sized to finish in under 8 minutes.
set -euo pipefail
out="${OUT:-bench-results}/gpu"
mkdir -p "$out"
# The checkout runs uninstalled: kernels/ imports as specserve_kernels (pyproject.toml), here
# through a link of that name.
mkdir -p /tmp/site && ln -sfn "$PWD/kernels" /tmp/site/specserve_kernels
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="/tmp/site:$PWD"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt"
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA'; print(torch.__version__, torch.cuda.get_device_name())" | tee -a "$out/gpu.txt"
# The Triton kernels against their references on real CUDA first: a wrong kernel makes the bench meaningless.
python3 -m pytest -q -p no:cacheprovider tests/test_rejection_sampler.py tests/test_attention_kernel.py 2>&1 | tail -3 | tee "$out/kernels.txt"
timeout 420 python3 -m specserve.cli bench --device cuda --workloads code edit --temperatures 0 0.8 --k 2 4 8 \
    --concurrency 1 16 --prompts 8 --max-tokens 128 --output "$out" 2>&1 | tail -40 | tee "$out/bench.log"
