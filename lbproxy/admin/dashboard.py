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

import base64
import hashlib
import re
from functools import cache
from importlib import resources


@cache
def page() -> bytes:
    """The page's bytes, read once from the installed package."""
    return resources.files("lbproxy.admin").joinpath("dashboard.html").read_bytes()


@cache
def headers() -> list[tuple[bytes, bytes]]:
    """Response headers for the page: a Content-Security-Policy that runs only the
    page's own inline script and style (by their SHA-256) and talks only to this
    endpoint, and no framing. Once a user has given the page the token, its buttons
    change the proxy: another site must not be able to frame the page and trick a click
    on them."""
    text = page()
    scripts = " ".join(_hashes(rb"<script>(.*?)</script>", text))
    styles = " ".join(_hashes(rb"<style>(.*?)</style>", text))
    policy = (
        f"default-src 'none'; script-src {scripts}; style-src {styles}; "
        "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    )
    return [
        (b"content-security-policy", policy.encode()),
        (b"x-frame-options", b"DENY"),
        (b"x-content-type-options", b"nosniff"),
        (b"referrer-policy", b"no-referrer"),
    ]


def _hashes(pattern: bytes, text: bytes) -> list[str]:
    return [
        "'sha256-" + base64.b64encode(hashlib.sha256(block).digest()).decode() + "'"
        for block in re.findall(pattern, text, re.S)
    ]
