"""The names `ps`, `top`, `pidof` and `pkill` see for lbproxy's processes.

lbproxy is a Python program, so without this every one of its processes is `python3 ...`
to those tools and `kill -HUP $(pidof -s lbproxy)` finds nothing. With setproctitle the
process that takes SIGHUP, SIGUSR2 and SIGTERM (the one process of `workers: 1`, the
supervisor of `workers: N`) is named `lbproxy` exactly, and no other process is:

    lbproxy                      the one to signal: serves, or supervises the workers
    lbproxy: worker N            a worker of `workers: N` (SIGHUP reaches it through the
                                 supervisor, never directly)
    lbproxy: taking over         the new process of an upgrade until it serves
    lbproxy: upgraded, draining  the old process of an upgrade, from the moment the new
                                 one serves until its last connection ends

setproctitle rewrites the command line (/proc/PID/cmdline: `ps -f`, `pgrep -f`) and the
first 15 characters of it become the kernel's name (/proc/PID/comm: `ps -e`, `top`,
`pkill`). `pidof NAME` (sysvinit-utils' on Debian, procps-ng's elsewhere) matches NAME
against the command line's first word; sysvinit's also against the kernel name when
that word has a space in it (a process that renamed itself). A worker's kernel name is
`lbproxy: worker` (15 characters, not `lbproxy`), so neither pidof matches a worker and
`pidof -s lbproxy` has one answer. No `/` in a title: pidof compares the part after the
last one.

Without setproctitle (not installed, or no wheel for the platform and no compiler)
lbproxy runs the same and says once that its processes keep Python's name.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("lbproxy")

SERVING = "lbproxy"
TAKING_OVER = "lbproxy: taking over"
HANDED_OVER = "lbproxy: upgraded, draining"


def worker(index: int) -> str:
    return f"lbproxy: worker {index}"


def set_title(title: str) -> bool:
    """Name this process `title`; False when setproctitle cannot be imported."""
    try:
        import setproctitle
    except ImportError:
        return False
    setproctitle.setproctitle(title)
    return True


def name_serving_process() -> None:
    """The process a user signals (started by `lbproxy run`, not by an upgrade): named
    `lbproxy`, or one warning saying why not and what to use instead."""
    if not set_title(SERVING):
        log.warning(
            "setproctitle is not installed: this process keeps Python's name and "
            "`pidof lbproxy` does not find it; reload with `lbproxy reload` or "
            "`kill -HUP %d`",
            os.getpid(),
        )
