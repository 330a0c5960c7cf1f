#!/usr/bin/env python3
"""Generate the meshlm.v1 gRPC stubs from protos/meshlm/v1/*.proto: the one command writing them.

    python3 scripts/gen_protos.py           # regenerate the stubs that are missing or stale
    python3 scripts/gen_protos.py --force   # regenerate them all
    python3 scripts/gen_protos.py --check   # write nothing; exit 1 naming any missing or stale stub

scripts/test.sh and scripts/serve.sh run it before use, and setup.py's build_py runs the same
generator (services/common/meshlm/v1/_gen.py), so `pip install -e .` alone is not relied on.
Importing meshlm.v1 never generates: with a stale stub it raises ImportError naming this command.
"""

import runpy
import sys
from pathlib import Path

# Executed by path: importing meshlm.v1 would refuse the very stubs this command fixes.
REPO = Path(__file__).resolve().parents[1]
GENERATOR = REPO / "services" / "common" / "meshlm" / "v1" / "_gen.py"

if __name__ == "__main__":
    sys.exit(runpy.run_path(str(GENERATOR))["main"](sys.argv[1:]))
