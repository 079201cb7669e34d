"""Who may ask the DNS locator, and how often: the source ACL and response rate limiting.

PURE: no trio, no sockets, no clock (`now` is passed in). dns_server.py asks `verdict`
for every UDP query *before* the query is answered, because an answer is a locate: it
runs a pick and counts (least-load estimates, the rr position, persistence entries). A
refused or rate-limited query must move none of them, and a UDP source is trivially
spoofed.

Rate limiting is BIND 9's `rate-limit` (and Knot's `rrl`): answers are counted per
source prefix (/24 for IPv4, /56 for IPv6, BIND's defaults), `responses_per_second` of
them per one-second window; over it a query is dropped, except that every `slip`-th
dropped one is answered empty with TC=1 so that a real client (whose address is not
spoofed) asks again over TCP, where no limit applies (a TCP client has proven its
address). Windows are whole seconds of `now`, as BIND's per-second counts: the answers
one prefix gets in any window never exceed the limit. At most MAX_PREFIXES prefixes
are remembered; a new one beyond that forgets the least recently seen (BIND's
`max-table-size` recycles the oldest entries too), so a flood of spoofed prefixes
cannot reset the count of a source that keeps asking.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict
from collections.abc import Iterable

from lbproxy.config.model import IPNetwork

ANSWER = "answer"
REFUSE = "refuse"
DROP = "drop"
SLIP = "slip"  # answer empty with TC=1

IPV4_PREFIX = 24
IPV6_PREFIX = 56
MAX_PREFIXES = 65536  # prefixes remembered; beyond it the least recently seen goes
_ACL_CACHE = 4096  # source addresses whose ACL verdict is kept


class SourcePolicy:
    """The ACL and the rate limiter of one DNS locator (UDP and TCP share the ACL)."""

    def __init__(self, allow: Iterable[IPNetwork], responses_per_second: int, slip: int) -> None:
        self.allow = tuple(allow)
        self.responses_per_second = responses_per_second
        self.slip = slip
        # prefix -> [window (whole second), answers in it, dropped in it], the least
        # recently seen first
        self._windows: OrderedDict[tuple[int, int], list[int]] = OrderedDict()
        self._allowed: dict[str, bool] = {}

    def allowed(self, host: str) -> bool:
        """Is a query from `host` (an address as the socket gives it) allowed?"""
        verdict = self._allowed.get(host)
        if verdict is None:
            try:
                ip = ipaddress.ip_address(host.split("%", 1)[0])
            except ValueError:
                return False
            if ip.version == 6 and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            verdict = any(ip.version == net.version and ip in net for net in self.allow)
            if len(self._allowed) >= _ACL_CACHE:
                self._allowed.clear()
            self._allowed[host] = verdict
        return verdict

    def verdict(self, host: str, now: float) -> str:
        """What to do with one UDP query from `host` at `now`: ANSWER, REFUSE, DROP, SLIP.

        ANSWER counts against the prefix's window; REFUSE is for a source not allowed
        (refusals are rate limited too, so the locator reflects no flood)."""
        outcome = ANSWER if self.allowed(host) else REFUSE
        if self.responses_per_second <= 0:
            return outcome
        key = source_prefix(host)
        second = int(now)
        windows = self._windows
        window = windows.get(key)
        if window is None:
            if len(windows) >= MAX_PREFIXES:
                windows.popitem(last=False)
            window = windows[key] = [second, 0, 0]
        else:
            windows.move_to_end(key)
            if window[0] != second:
                window[0], window[1], window[2] = second, 0, 0
        if window[1] < self.responses_per_second:
            window[1] += 1
            return outcome
        window[2] += 1
        if self.slip and window[2] % self.slip == 0:
            return SLIP
        return DROP

    @property
    def prefixes(self) -> int:
        """Prefixes remembered now (at most MAX_PREFIXES)."""
        return len(self._windows)


def source_prefix(host: str) -> tuple[int, int]:
    """(version, prefix) of an address: its /24 (IPv4) or /56 (IPv6); rate limiting
    and the DNS locator's cap of TCP clients count by it."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return (0, 0)
    if ip.version == 6 and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.version == 4:
        return (4, int(ip) >> (32 - IPV4_PREFIX))
    return (6, int(ip) >> (128 - IPV6_PREFIX))
