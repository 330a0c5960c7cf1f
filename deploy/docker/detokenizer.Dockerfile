# syntax=docker/dockerfile:1
# meshlm detokenizer: incremental detokenization. No torch. Build from the repository root:
#   docker build -f deploy/docker/detokenizer.Dockerfile -t meshlm-detokenizer:0.1.0 .

FROM python:3.11.9-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY services/ services/
# pip builds the wheel; setup.py's build_py generates the gRPC stubs from protos/ (grpcio-tools
# comes from [build-system] requires). Importing meshlm.v1 checks every stub against the .proto
# files the wheel ships and fails the build if one is missing or stale (it never generates).
RUN pip install ".[detokenizer]" \
 && python -c "import meshlm.v1.tokenizer_pb2" \
 && python -c "import sys, meshlm.detokenizer.service; sys.exit('torch' in sys.modules)"

FROM python:3.11.9-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 meshlm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/meshlm --shell /usr/sbin/nologin meshlm
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/meshlm
EXPOSE 50053
ENTRYPOINT ["meshlm", "serve", "detokenizer"]
