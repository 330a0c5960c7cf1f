"""python -m meshlm.scheduler.service [flags]: run the scheduler service."""

import sys

from meshlm.scheduler.service.server import main

if __name__ == "__main__":
    sys.exit(main())
