"""Which implementation of the connection path runs: compiled (C) or pure Python.

The pump and its reactor (net/reactor.py's `Reactor` and `Pump`: one API, two
implementations), the accept loop's accept4 batch, the connect to a real server, the
run's clock and the UDP datagram relay (dataplane/udp.py's two relays) have a C
version, ``lbproxy.net._cpump`` (lbproxy/net/_cpump.c), built by ``pip install`` when a
C compiler and the Python headers are there (an optional extension: a failed build
still installs lbproxy). The pure one (net/pure_pump.py and
the pure branches of accept.py and connection.py) behaves the same -- the pump's two
are checked against each other by tests/integration/test_pump_differential.py; the C one
only costs less per connection and per chunk (docs/benchmarks.md).

It is used when it imports and was built from this source (its ``C_API`` is this
module's: an extension left from an older checkout, not rebuilt, would miss names the
Python side calls); ``LBPROXY_PURE=1`` in the environment forces pure Python.
``lbproxy --version`` says which one runs, and why.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["IMPLEMENTATION", "PURE_ENV", "cpump", "describe"]

PURE_ENV = "LBPROXY_PURE"
#: The _cpump interface this Python source calls (_cpump.c's C_API).
C_API = 4

cpump: ModuleType | None = None
_why_pure = ""
if os.environ.get(PURE_ENV, "") not in ("", "0"):
    _why_pure = f"{PURE_ENV}={os.environ[PURE_ENV]}"
else:
    try:
        from lbproxy.net import _cpump as cpump  # type: ignore[attr-defined,no-redef]  # built C, no stub
    except ImportError as exc:  # not built (no compiler at install time), or broken
        _why_pure = f"no compiled extension: {exc}"
    else:
        built_for = getattr(cpump, "C_API", None)
        if built_for != C_API:
            cpump = None
            _why_pure = (
                f"the compiled extension is stale (interface {built_for}, this source's "
                f"{C_API}): rebuild it with pip install -e ."
            )

IMPLEMENTATION = "compiled" if cpump is not None else "pure"


def describe() -> str:
    """One line for ``lbproxy --version``: which path runs, and why if pure."""
    if cpump is not None:
        return "connection path: compiled (lbproxy.net._cpump)"
    return f"connection path: pure Python ({_why_pure})"
