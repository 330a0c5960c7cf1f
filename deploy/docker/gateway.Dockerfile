# syntax=docker/dockerfile:1
# meshlm gateway: the HTTP front. No torch, no model. Build from the repository root:
#   docker build -f deploy/docker/gateway.Dockerfile -t meshlm-gateway:0.1.0 .

FROM python:3.11.9-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY protos/ protos/
COPY services/ services/
# pip builds the wheel; setup.py's build_py generates the gRPC stubs from protos/ (grpcio-tools
# comes from [build-system] requires). The import check runs as root so that a stub older than
# its .proto is regenerated here, never at run time on the read-only file system.
RUN pip install ".[gateway]" \
 && python -c "from meshlm.v1 import _gen, tokenizer_pb2; assert not _gen._stale(_gen.proto_root())" \
 && python -c "import sys, meshlm.gateway.app; sys.exit('torch' in sys.modules)"

FROM python:3.11.9-slim-bookworm
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
RUN groupadd --system --gid 10001 meshlm \
 && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/meshlm --shell /usr/sbin/nologin meshlm
COPY --from=build /opt/venv /opt/venv
USER 10001:10001
WORKDIR /home/meshlm
EXPOSE 30000
ENTRYPOINT ["meshlm", "serve", "gateway"]
