"""Build hook: generate the gRPC stubs from protos/ and ship the protos inside the package."""

import runpy
import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
# The stub generator scripts/gen_protos.py runs, executed by path: importing meshlm.v1 would
# refuse the missing or stale stubs it is about to write.
GENERATOR = HERE / "services" / "common" / "meshlm" / "v1" / "_gen.py"


class BuildWithStubs(build_py):
    def run(self) -> None:
        runpy.run_path(str(GENERATOR))["generate"](HERE / "protos")
        super().run()
        if not self.editable_mode:
            # meshlm.v1 checks its stubs against these on import (see _gen.check).
            dest = Path(self.build_lib) / "meshlm" / "v1" / "protos" / "meshlm" / "v1"
            dest.mkdir(parents=True, exist_ok=True)
            for proto in (HERE / "protos" / "meshlm" / "v1").glob("*.proto"):
                shutil.copy2(proto, dest / proto.name)


setup(cmdclass={"build_py": BuildWithStubs})
