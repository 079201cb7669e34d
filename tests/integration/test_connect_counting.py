"""What `connections_total` counts, through a real `lbproxy run` process and sockets.

A real server's `connections_total` (metric, JSON document, `lbproxy status`) counts the
connections established to it. A connect that failed is counted only in
`lbproxy_connect_failures_total`, and the client is retried on another server.
"""

from __future__ import annotations

import json

from tests.integration.harness import (
    ask_name,
    free_port,
    http,
    metrics,
    run_cli,
    sample,
    vs_config,
    wait_for,
    with_admin,
)


class Refusing:
    """A real server that refuses every connection: a port nothing listens on."""

    name = "b"

    def __init__(self) -> None:
        self.port = free_port()


def test_failed_connects_are_not_connections(name_servers, lbproxy):
    (a,) = name_servers("a")
    b = Refusing()
    port, admin_port = free_port(), free_port()
    # Passive health only: every client that wlc sends to b meets the refusal itself
    # (until b's third failure marks it down) and is retried on a.
    extra = "health_check: {type: none, fall: 3}\nretries: 2"
    proxy = lbproxy(with_admin(vs_config(port, [a, b], "wlc", extra), admin_port), [port])

    # wait_port's probe: it meets a (and b left untried), or b's refusal and then a --
    # a connection to a either way, counted once it is established, which may be after
    # the port answered. Count from when it has been.
    def probe_counted():
        samples = metrics(admin_port)
        return (
            samples
            if sample(samples, "lbproxy_connections_total", virtual_server="web", real_server="a")
            else None
        )

    before = wait_for(probe_counted, what="the start-up probe's connection to a")
    a_before = sample(before, "lbproxy_connections_total", virtual_server="web", real_server="a")
    refused_before = sample(
        before,
        "lbproxy_connect_failures_total",
        virtual_server="web",
        real_server="b",
        reason="refused",
    )
    names = [ask_name(port) for _ in range(20)]
    assert names == ["a"] * 20

    samples = metrics(admin_port)
    total = {
        n: sample(samples, "lbproxy_connections_total", virtual_server="web", real_server=n)
        for n in "ab"
    }
    assert total == {"a": 20 + a_before, "b": 0}
    refused = sample(
        samples,
        "lbproxy_connect_failures_total",
        virtual_server="web",
        real_server="b",
        reason="refused",
    )
    assert refused_before <= 1
    assert refused == 3  # fall: 3, then b is down and no longer tried
    rejected = sample(
        samples, "lbproxy_rejected_connections_total", virtual_server="web", reason="connect_failed"
    )
    assert rejected == 0

    status, body = http("GET", f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers")
    assert status == 200
    (vs,) = json.loads(body)["virtual_servers"]
    by_name = {rs["name"]: rs for rs in vs["real_servers"]}
    assert (by_name["a"]["connections_total"], by_name["b"]["connections_total"]) == (
        20 + a_before,
        0,
    )
    out = run_cli("status", "--json", "--admin", f"http://127.0.0.1:{admin_port}")
    assert out.returncode == 0, out.stderr
    (vs,) = json.loads(out.stdout)["virtual_servers"]
    assert {rs["name"]: rs["connections_total"] for rs in vs["real_servers"]} == {
        "a": 20 + a_before,
        "b": 0,
    }
    assert proxy.proc.poll() is None
