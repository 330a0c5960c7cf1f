"""The kernel build's cache key covers what a source depends on: its own text and the headers it
includes with quotes (by a path relative to its folder), so editing a shared header rebuilds every kernel using it."""

from __future__ import annotations

from pathlib import Path

from meshlm.scheduler.attention.cpu_kernel import SOURCE as DECODE_SOURCE
from meshlm.scheduler.attention.extend_kernel import AMX_SOURCE
from meshlm.scheduler.kernels.build import source_bytes
from meshlm.scheduler.kernels.gemm_amx import SOURCE as GEMM_AMX_SOURCE


def test_local_headers_are_part_of_the_source(tmp_path: Path) -> None:
    header = tmp_path / "shared.h"
    header.write_text("#define A 1\n")
    src = tmp_path / "k.c"
    src.write_text('#include <stdint.h>\n  #  include "shared.h"\n#include "absent.h"\nint f(void) { return A; }\n')
    before = source_bytes(src)
    assert src.read_bytes() in before and b"#define A 1" in before
    header.write_text("#define A 2\n")
    assert source_bytes(src) != before  # a changed header means another library name
    plain = tmp_path / "plain.c"
    plain.write_text("#include <math.h>\n")
    assert source_bytes(plain) == plain.read_bytes()


def test_amx_kernels_share_the_amx_header() -> None:
    amx_h = (GEMM_AMX_SOURCE.parent / "amx.h").read_bytes()
    for source in (DECODE_SOURCE, AMX_SOURCE, GEMM_AMX_SOURCE):  # the attention kernels include ../../kernels/csrc
        assert amx_h in source_bytes(source)
