# One image for all three roles (the command picks one: specserve draft | verify | gateway).
#   CPU, with the demo models:  docker build --build-arg VARIANT=cpu -t specserve:cpu .
#   CUDA, for GPU nodes:        docker build --build-arg VARIANT=cuda -t specserve:cuda .
ARG VARIANT=cpu

FROM python:3.11-slim AS base-cpu
ENV TORCH_INDEX=https://download.pytorch.org/whl/cpu

FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS base-cuda
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv python3-pip \
    && rm -rf /var/lib/apt/lists/* && ln -s /usr/bin/python3 /usr/local/bin/python
ENV TORCH_INDEX=https://download.pytorch.org/whl/cu128

# Build stage: a virtual environment with torch and specserve, nothing else.
FROM base-${VARIANT} AS build
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" torch==2.13.0
COPY pyproject.toml README.md /src/
COPY specserve /src/specserve
COPY kernels /src/kernels
COPY gateway /src/gateway
COPY draft_service /src/draft_service
COPY verify_service /src/verify_service
RUN pip install --no-cache-dir /src

# Runtime stage: the environment, the demo models, a non-root user; no build tools.
FROM base-${VARIANT} AS runtime
COPY --from=build /opt/venv /opt/venv
COPY models /models
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin specserve
USER 10001
ENV PATH=/opt/venv/bin:$PATH \
    HF_HOME=/tmp/hf \
    TRITON_CACHE_DIR=/tmp/triton \
    MPLCONFIGDIR=/tmp/matplotlib \
    PYTHONUNBUFFERED=1
EXPOSE 8000 50051 50052 9101 9102
ENTRYPOINT ["specserve"]
CMD ["--help"]
