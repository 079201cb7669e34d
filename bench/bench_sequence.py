"""Each proxy's system calls for one new connection, in order: ``scripts/bench --syscalls
--sequence`` (issue 44; not a test).

``--syscalls`` counts calls by name under load; this shows *which* calls, with which
arguments, on which socket, in which order -- what tells two proxies' connection paths
apart (a socket option one sets and the other does not, writev against sendto, who sends
the FIN with shutdown and who with close, how many epoll_ctl a connection costs and with
which flags). For each proxy (default lbproxy, HAProxy and nginx stream), with the same
real server, configuration and cores as the benchmark:

1. ``strace -f -tt -p PID`` attached to the running proxy while wrk makes new connections
   one at a time (``-c1``, ``Connection: close``, the benchmark's client and request);
2. every call is given to the connection whose descriptor it names (the client's from
   the ``accept4`` that returned it, the real server's from the ``socket`` that followed;
   ``epoll_ctl`` by the descriptor it registers); a call naming no connection's
   descriptor (``epoll_wait``, an ``accept4`` that found the backlog empty) belongs to
   the event loop;
3. printed: each call with its socket's role and its arguments that matter (socket
   options, flags, epoll events, result), counted per connection over every complete
   connection traced (the loop's calls divided by the number of connections); and one
   connection from the middle of the trace as strace saw it, descriptors named by role
   (``client``, ``server``, ``listener``, ``epoll``; ``other``: a descriptor of none of
   these, such as the write end of lbproxy's trio wake-up socket; ``timeout=t``: a
   finite wait).

strace slows the proxy, so timings in the trace mean nothing; the order and the
arguments do. One connection at a time is the lightest load: under the benchmark's
``-c20`` a proxy batches more (fewer ``epoll_wait`` per connection), which ``--syscalls``
counts.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Any

from common import BenchError, Processes, attached, save_result
from harness import Bench, traced_bench
from peers import Proxy, tool_versions

#: Calls whose first argument is a descriptor.
FD_FIRST = {
    "accept",
    "accept4",
    "close",
    "connect",
    "fcntl",
    "getpeername",
    "getsockname",
    "getsockopt",
    "ioctl",
    "read",
    "readv",
    "recvfrom",
    "recvmsg",
    "sendmsg",
    "sendto",
    "setsockopt",
    "shutdown",
    "splice",
    "write",
    "writev",
}

LINE = re.compile(r"^(\d+)\s+(\d\d:\d\d:\d\d\.\d+)\s+(\w+)\((.*)\)\s+=\s+(-?\d+|\?)(.*)$")
UNFINISHED = re.compile(r"^(\d+)\s+(\S+)\s+(\w+)\((.*)\s+<unfinished \.\.\.>$")
RESUMED = re.compile(r"^(\d+)\s+(\S+)\s+<\.\.\. (\w+) resumed>(.*)\)\s+=\s+(-?\d+|\?)(.*)$")


def split_args(text: str) -> list[str]:
    """strace's argument list split at its top-level commas."""
    out, depth, cur, quoted = [], 0, [], False
    i = 0
    while i < len(text):
        ch = text[i]
        if quoted:
            cur.append(ch)
            if ch == "\\" and i + 1 < len(text):
                cur.append(text[i + 1])
                i += 1
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
            cur.append(ch)
        elif ch in "[{(":
            depth += 1
            cur.append(ch)
        elif ch in "]})":
            depth -= 1
            cur.append(ch)
        elif ch == "," and depth == 0:
            out.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1
    if cur or out:
        out.append("".join(cur).strip())
    return out


def parse_trace(text: str) -> list[dict[str, Any]]:
    """strace -f -tt lines as calls (name, args, result, the error's name); an unfinished
    call is joined to its resumption."""
    calls: list[dict[str, Any]] = []
    pending: dict[str, tuple[str, str]] = {}
    for line in text.splitlines():
        m = LINE.match(line)
        if m:
            pid, _, name, args, ret, rest = m.groups()
        else:
            u = UNFINISHED.match(line)
            if u:
                pending[u.group(1)] = (u.group(3), u.group(4))
                continue
            r = RESUMED.match(line)
            if not r:
                continue
            pid, _, name, tail, ret, rest = r.groups()
            head = pending.pop(pid, (name, ""))[1]
            args = head + tail
        err = rest.split()[0] if ret == "-1" and rest.split() else ""
        calls.append(
            {
                "name": name,
                "args": split_args(args),
                "ret": int(ret) if ret != "?" else None,
                "err": err,
            }
        )
    return calls


def _flags(text: str) -> str:
    return re.sub(r"\s+", "", text)


def describe(call: dict[str, Any], role: dict[int, str]) -> str:
    """One call as `name(role, the arguments that matter) = result`."""
    name, args, ret, err = call["name"], call["args"], call["ret"], call["err"]

    def fd(i: int) -> str:
        try:
            return role.get(int(args[i]), "other")
        except (IndexError, ValueError):
            return "?"

    if ret is None:
        result = "?"
    elif ret < 0:
        result = err
    elif name in ("recvfrom", "read", "readv", "recvmsg"):
        result = "0 (EOF)" if ret == 0 else "n"
    elif name in ("sendto", "write", "writev", "sendmsg", "splice"):
        result = "n"
    elif name in ("accept4", "accept", "socket"):
        result = "fd"
    elif name == "epoll_wait":
        result = "events" if ret else "0"
    else:
        result = str(ret)
    if name in ("accept4", "accept"):
        shown = [fd(0), *(["flags=" + _flags(args[3])] if len(args) > 3 else [])]
    elif name == "socket":
        shown = [_flags(a) for a in args]
    elif name in ("setsockopt", "getsockopt"):
        shown = [fd(0), *args[1:3], *(args[3:4] if name == "setsockopt" else [])]
    elif name in ("fcntl", "ioctl"):
        shown = [fd(0), *args[1:]]
    elif name == "shutdown":
        shown = [fd(0), args[1]]
    elif name in ("sendto", "recvfrom"):
        shown = [fd(0), *([f"flags={args[3]}"] if len(args) > 3 and args[3] != "0" else [])]
    elif name == "writev":
        shown = [fd(0), *([f"{args[2]} iov"] if len(args) > 2 else [])]
    elif name == "epoll_ctl":
        events = re.search(r"events=([A-Z|_]+)", args[3]) if len(args) > 3 else None
        shown = [
            args[1].replace("EPOLL_CTL_", ""),
            fd(2),
            *([events.group(1)] if events else []),
        ]
    elif name == "epoll_wait":
        timeout = args[3] if len(args) > 3 else "?"
        shown = [fd(0), "timeout=" + (timeout if timeout in ("0", "-1") else "t")]
    elif name == "splice":
        shown = [fd(0), fd(2)]
    elif name in FD_FIRST:
        shown = [fd(0)]
    else:
        shown = []
    return f"{name}({', '.join(s for s in shown if s)}) = {result}"


def per_connection(calls: list[dict[str, Any]]) -> tuple[list[list[int]], list[int], dict]:
    """The calls (indices) of each connection, the event loop's, and the roles of the
    descriptors that are not a connection's (listener, epoll set, pipes)."""
    conns: list[list[int]] = []
    loop: list[int] = []
    owner: dict[int, int] = {}  # descriptor -> connection (index in conns)
    fixed: dict[int, str] = {}
    last_accepted = -1
    for i, c in enumerate(calls):
        name, args, ret = c["name"], c["args"], c["ret"]
        target: int | None = None
        if name in ("epoll_wait", "epoll_ctl") and args:
            fixed.setdefault(int(args[0]), "epoll")
        if name in ("accept4", "accept") and args:
            fixed.setdefault(int(args[0]), "listener")
            if ret is not None and ret >= 0:
                conns.append([])
                last_accepted = len(conns) - 1
                owner[ret] = last_accepted
                target = last_accepted
        elif name == "socket" and ret is not None and ret >= 0 and last_accepted >= 0:
            owner[ret] = last_accepted
            target = last_accepted
        elif name == "pipe2" and ret == 0:
            for fd in re.findall(r"\d+", args[0] if args else ""):
                fixed[int(fd)] = "pipe"
        else:
            fds: list[int] = []
            if name in FD_FIRST and args:
                fds.append(int(args[0]) if args[0].lstrip("-").isdigit() else -1)
            if name == "splice" and len(args) > 2 and args[2].isdigit():
                fds.append(int(args[2]))
            if name == "epoll_ctl" and len(args) > 2 and args[2].isdigit():
                fds.append(int(args[2]))
            for fd in fds:
                if fd in owner:
                    target = owner[fd]
                    break
            if name == "close" and fds and fds[0] in owner:
                del owner[fds[0]]
        (conns[target] if target is not None else loop).append(i)
    return conns, loop, fixed


def roles_for(calls: list[dict[str, Any]], conn: list[int], fixed: dict[int, str]) -> dict:
    """Descriptor -> role for one connection's calls: its client and real-server sockets."""
    role = dict(fixed)
    for i in conn:
        c = calls[i]
        if c["name"] in ("accept4", "accept") and c["ret"] is not None and c["ret"] >= 0:
            role[c["ret"]] = "client"
        elif c["name"] == "socket" and c["ret"] is not None and c["ret"] >= 0:
            role[c["ret"]] = "server"
    return role


def sequence(calls: list[dict[str, Any]]) -> dict[str, Any]:
    conns, loop, fixed = per_connection(calls)
    # complete: accepted, and both its sockets closed in the trace
    complete = [
        k
        for k, idx in enumerate(conns)
        if sum(1 for i in idx if calls[i]["name"] == "close") >= 2 and k > 0
    ]
    if not complete:
        raise BenchError("no complete connection in the trace")
    counts: Counter[str] = Counter()
    for k in complete:
        role = roles_for(calls, conns[k], fixed)
        counts.update(describe(calls[i], role) for i in conns[k])
    # the loop's calls between the first and the last complete connection
    lo, hi = conns[complete[0]][0], conns[complete[-1]][-1]
    role = dict(fixed)
    counts.update(describe(calls[i], role) for i in loop if lo <= i <= hi)
    n = len(complete)
    mid = complete[len(complete) // 2]
    first, last = conns[mid][0], conns[mid][-1]
    role = roles_for(calls, conns[mid], fixed)
    mine = set(conns[mid])
    others = {i for k, idx in enumerate(conns) if k != mid for i in idx}
    shown = []
    for i in range(first, last + 1):
        if i in others:
            continue  # another connection's call, interleaved
        text = describe(calls[i], role)
        shown.append(text if i in mine else f"{text}    (loop)")
    return {
        "connections": n,
        "per_conn": {k: round(v / n, 2) for k, v in counts.items()},
        "total_per_conn": round(sum(counts.values()) / n, 2),
        "one_connection": shown,
    }


def traced(bench: Bench, proxy: Proxy, port: int, seconds: float, work: Path) -> dict[str, Any]:
    assert proxy.proc is not None
    target = work / f"sequence-{proxy.name}.txt"
    strace = ["strace", "-f", "-tt", "-s", "0", "-o", str(target), "-p", str(proxy.proc.pid)]
    with attached(strace, settle=1.0):
        bench.wrk(port, "/small", 1, seconds, close=True)
    return sequence(parse_trace(target.read_text()))


def run(args: Any, procs: Processes, work: Path) -> dict[str, Any]:
    bench, proxies = traced_bench(args, procs, work, "strace", "strace")
    out: dict[str, Any] = {}
    for proxy in proxies:
        print(f"{proxy.name} ...", flush=True)
        http, _ = bench.start_proxy(proxy)
        try:
            bench.wrk(http, "/small", 1, 1, close=True)  # warm-up
            out[proxy.name] = traced(bench, proxy, http, min(args.duration, 2), work)
        finally:
            bench.stop_proxy(proxy)
    report(out)
    save_result(args.out, "sequence", {"versions": tool_versions(), "results": out})
    return out


def report(out: dict[str, Any]) -> None:
    names = list(out)
    keys = sorted({k for r in out.values() for k in r["per_conn"]})
    width = max(len(k) for k in keys) + 2
    print("\nSystem calls per new connection, by call, socket and arguments")
    print("(strace -f, wrk -c1 Connection: close; the loop's calls divided among connections)")
    print(f"{'':{width}}" + "".join(f"{n:>10}" for n in names))
    for k in keys:
        vals = [out[n]["per_conn"].get(k) for n in names]
        if max(v or 0 for v in vals) < 0.05:
            continue
        print(f"{k:{width}}" + "".join(f"{'-' if v is None else f'{v:.2f}':>10}" for v in vals))
    print(f"{'total':{width}}" + "".join(f"{out[n]['total_per_conn']:>10.2f}" for n in names))
    traced = "".join(f"{out[n]['connections']:>10}" for n in names)
    print(f"{'connections traced':{width}}" + traced)
    for n in names:
        print(f"\n{n}: one connection, in order")
        for line in out[n]["one_connection"]:
            print(f"  {line}")


if __name__ == "__main__":  # a trace file given: print its sequence
    import json
    import sys

    print(json.dumps(sequence(parse_trace(Path(sys.argv[1]).read_text())), indent=1))
