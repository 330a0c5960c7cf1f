"""python -m meshlm.scheduler [flags]: run the scheduler service (`meshlm serve scheduler`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from meshlm.scheduler.service.server import main as service_main

    return service_main(argv)


if __name__ == "__main__":
    sys.exit(main())
