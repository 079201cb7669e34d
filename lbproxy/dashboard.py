"""The dashboard at `GET /` of the admin endpoint (SPEC §15).

One self-contained page, `dashboard.html` beside this module (package data): inline CSS
and JavaScript, no external asset, no build step. The page does everything in the
browser from the same JSON API any client uses — it polls `/api/v1/virtual-servers`
every 2 s, keeps 5 minutes of active-connection history per real server in memory, and
its buttons send the API's PATCH requests — so it works unchanged against one process
and against the supervisor of `workers: N`, whose document is the workers' merged one.
The admin app only serves the bytes; nothing here runs per connection.
"""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def page() -> bytes:
    """The page's bytes, read once from the installed package."""
    return resources.files("lbproxy").joinpath("dashboard.html").read_bytes()
