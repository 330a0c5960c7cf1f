"""A service started by `meshlm launch` ends with the launcher, even when the launcher is killed.

`meshlm launch` sets MESHLM_LAUNCHER_PID in each child's environment. exit_with_launcher(), called
first thing in each service's main(), asks Linux for a SIGTERM when the parent dies
(prctl(PR_SET_PDEATHSIG)), so a SIGKILLed launcher leaves no service holding its ports; SIGTERM
takes each service's usual shutdown path. The kernel sends the signal when the *thread* that
forked the child ends, so only a caller that starts the services from a thread living as long as
itself may set the variable: the CLI does (its main thread); launcher.launch() does not on its own
(tests start systems from worker threads that end right after).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

LAUNCHER_PID_ENV = "MESHLM_LAUNCHER_PID"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

log = logging.getLogger(__name__)


def exit_with_launcher() -> bool:
    """If MESHLM_LAUNCHER_PID is set, arrange SIGTERM for this process when its parent dies and
    return True; else (a container, a shell, another OS) do nothing and return False. The variable
    is removed from this process's environment so its own children (TP ranks) do not inherit it.
    If the launcher is already gone (it died before the prctl), SIGTERM is sent at once."""
    raw = os.environ.pop(LAUNCHER_PID_ENV, None)
    if raw is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        log.warning(
            "prctl(PR_SET_PDEATHSIG) failed (errno %d): this service outlives a killed launcher", ctypes.get_errno()
        )
        return False
    if str(os.getppid()) != raw:
        os.kill(os.getpid(), signal.SIGTERM)
    return True
