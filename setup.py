"""Build hook: generate the gRPC stubs from protos/ and ship the protos inside the package."""

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent


class BuildWithStubs(build_py):
    def run(self) -> None:
        sys.path.insert(0, str(HERE / "services" / "common" / "meshlm" / "v1"))
        import _gen  # the generator module, loaded without importing the package

        _gen.generate(HERE / "protos")
        super().run()
        if not self.editable_mode:
            dest = Path(self.build_lib) / "meshlm" / "v1" / "protos" / "meshlm" / "v1"
            dest.mkdir(parents=True, exist_ok=True)
            for proto in (HERE / "protos" / "meshlm" / "v1").glob("*.proto"):
                shutil.copy2(proto, dest / proto.name)


setup(cmdclass={"build_py": BuildWithStubs})
