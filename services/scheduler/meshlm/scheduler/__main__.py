"""python -m meshlm.scheduler [flags]: run the scheduler service (`meshlm serve scheduler`)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from meshlm.common.grpc_env import prefer_classic_endpoints
from meshlm.common.launcher_watch import exit_with_launcher


def main(argv: Sequence[str] | None = None) -> int:
    prefer_classic_endpoints()  # before the service's imports load grpc
    exit_with_launcher()
    from meshlm.scheduler.service.server import main as service_main

    return service_main(argv)


if __name__ == "__main__":
    sys.exit(main())
