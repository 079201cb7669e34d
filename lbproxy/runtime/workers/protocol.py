"""What the supervisor and a worker say to each other over the channel a worker inherits
(the package header, lbproxy/runtime/workers/__init__.py)."""

from __future__ import annotations

MAX_GIVEN = 256  # listening sockets one reload may add
