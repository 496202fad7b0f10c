#!/usr/bin/env bash
# Download, here, the wheels the GPU machine's image lacks (it has torch, triton,
# transformers, grpcio, httpx, matplotlib, prometheus-client but cannot reach a registry).
# They land in .whl/ (git-ignored); scripts/gpu_bench.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
packages=(
    "protobuf==7.36.2" "grpcio==1.85.3" "grpcio-health-checking==1.85.1" "grpcio-reflection==1.85.1"
    "fastapi==0.165.0" "starlette==1.10.0" "pydantic==2.14.4" "pydantic-core==2.50.5" "annotated-types==0.8.0"
    "typing-inspection==0.4.5" "uvicorn==0.55.0" "opentelemetry-api==1.45.2" "opentelemetry-sdk==1.45.2"
    "opentelemetry-semantic-conventions==0.66b2" "opentelemetry-exporter-otlp-proto-grpc==1.45.2"
    "opentelemetry-exporter-otlp-proto-common==1.45.2" "opentelemetry-proto==1.45.2" "googleapis-common-protos==1.76.0"
)
python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${packages[@]}"
du -sh .whl
