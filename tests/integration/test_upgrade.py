"""`lbproxy upgrade` and SIGUSR2 (SPEC §17) with real processes on loopback.

Each upgrade starts a new `lbproxy run` that takes over the listening sockets; the old
one drains. The new process is not this test's child (the old one started it), so it
is found by the PID the upgrade answers with and stopped by that PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import textwrap
import threading
import time

import pytest

from tests import tools
from tests.integration.client_loop import ClientLoop
from tests.integration.harness import (
    ROOT,
    Answering,
    Echo,
    NameServer,
    NotifySocket,
    alive,
    ask_name,
    free_port,
    get_json,
    local_http,
    run_cli,
    servers_of,
    vs_config,
    wait_for,
    wall_time,
    with_admin,
)
from tests.integration.harness import UpgradableLbproxy as Proxy

pytestmark = pytest.mark.integration

MIB = 1 << 20
SERVERS = "/api/v1/virtual-servers/web/real-servers"


def config(port: int, admin: int, backend: int, drain: str = "10s", spare: bool = False) -> str:
    return textwrap.dedent(
        f"""\
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: {drain}
        virtual_servers:
          - name: web
            listen: 127.0.0.1:{port}
            scheduler: rr
            real_servers:
              - {{name: echo, address: 127.0.0.1:{backend}}}
        """
    ) + (f"      - {{name: spare, address: 127.0.0.1:{backend}}}\n" if spare else "")


def transfer(sock: socket.socket, size: int) -> bytes | None:
    """Send `size` random bytes and read the echo back (sending in a thread of its own,
    so neither side's buffers fill): the bytes, or None when the echo was not exact."""
    payload = os.urandom(size)
    sender = threading.Thread(target=sock.sendall, args=(payload,), daemon=True)
    sender.start()
    received = bytearray()
    while len(received) < size:
        chunk = sock.recv(1 << 18)
        if not chunk:
            break
        received += chunk
    sender.join(10)
    return payload if received == payload else None


def transfer_all(sockets: list[socket.socket], size: int) -> list[int]:
    """`transfer` on every socket at once; for each, `size` when the echo was exact."""
    results = [0] * len(sockets)

    def move(i: int) -> None:
        echoed = transfer(sockets[i], size)
        results[i] = len(echoed) if echoed is not None else -1

    threads = [threading.Thread(target=move, args=(i,)) for i in range(len(sockets))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return results


def test_upgrades_under_a_client_loop_drop_nothing(tmp_path):
    """50 clients connect -> echo -> close throughout 10 upgrades: none refused, none
    reset, every echo byte-exact. Before each upgrade 20 connections are established;
    each then moves 4 MiB through the old process, which drains them and exits."""
    port, admin = free_port(), free_port()
    upgrades, held, size = 10, 20, 4 * MIB
    with NameServer("echo", greeting=False) as backend:
        proxy = Proxy(tmp_path, config(port, admin, backend.port), admin)
        try:
            with ClientLoop(port, clients=50, limit=120) as loop:
                loop.wait_for(100)
                for _ in range(upgrades):
                    old = proxy.pid
                    established = []
                    for _ in range(held):
                        s = socket.create_connection(("127.0.0.1", port), timeout=20)
                        s.sendall(b"hello")
                        assert s.recv(5) == b"hello"  # accepted and served by `old`
                        established.append(s)
                    proxy.upgrade()
                    assert alive(old)  # draining the held connections
                    sizes = transfer_all(established, size)
                    assert sizes == [size] * held, sizes  # every byte back, in order
                    for s in established:
                        s.close()
                    wait_for(lambda old=old: not alive(old), 15, f"pid {old} to exit")
                    loop.wait_for(50)  # the new process serves the loop
            counts = loop.counts
        finally:
            proxy.stop()
    assert proxy.log().count("upgraded: pid") == upgrades
    assert counts["ok"] > 500, counts
    assert counts["refused"] == counts["reset"] == counts["error"] == 0, (counts, loop.errors)
    assert counts["mismatch"] == 0, (counts, loop.errors)


def test_an_upgrade_to_a_broken_configuration_keeps_the_old_process(tmp_path):
    port, admin = free_port(), free_port()
    with NameServer("echo") as backend:
        proxy = Proxy(tmp_path, config(port, admin, backend.port, spare=True), admin)
        try:
            broken = tmp_path / "broken.yaml"
            broken.write_text(config(port, admin, backend.port).replace("drain_timeout", "dran"))
            result = run_cli("upgrade", "--admin", f"http://127.0.0.1:{admin}", str(broken))
            assert result.returncode == 2, result
            assert f"{broken}:3: unknown key 'dran' in global" in result.stderr
            assert "lbproxy: upgrade failed: invalid configuration; still serving" in result.stderr
            assert "Traceback" not in result.stderr
            # The old process serves on, the admin endpoint included.
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            status = run_cli("status", "--admin", f"http://127.0.0.1:{admin}", "--json")
            assert status.returncode == 0, status
            assert alive(proxy.pid)
            # ... and upgrades fine once the files are right, runtime changes kept.
            url = f"http://127.0.0.1:{admin}"
            assert run_cli("drain", "web", "spare", "--admin", url).returncode == 0
            assert run_cli("set-weight", "web", "echo", "7", "--admin", url).returncode == 0
            result = run_cli("upgrade", "--admin", url)
            assert result.returncode == 0, result
            new = int(result.stdout.split("pid ")[1].split()[0])
            proxy.pids.append(new)
            assert f"upgraded: pid {new} serves now; pid {proxy.pids[0]} drains" in result.stdout
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            status = json.loads(run_cli("status", "--admin", url, "--json").stdout)
            servers = {rs["name"]: rs for rs in status["virtual_servers"][0]["real_servers"]}
            assert servers["spare"]["state"] == "drain"
            assert servers["echo"]["weight"]["static"] == 7
            assert f"upgraded: pid {new} serves now" in proxy.log()  # the old one said so
        finally:
            proxy.stop()


def test_a_new_version_that_cannot_start_keeps_the_old_process(tmp_path):
    """The lbproxy on disk is broken (an import error, as a half-installed upgrade would
    be): the old process serves on and `lbproxy upgrade` exits 1 with the error."""
    port, admin = free_port(), free_port()
    with NameServer("echo") as backend:
        # A folder first on PYTHONPATH, empty at the start: the package written there
        # after the start is what "the lbproxy on disk now" is.
        site = tmp_path / "site"
        site.mkdir()
        env = {"PYTHONPATH": f"{site}{os.pathsep}{ROOT}"}
        proxy = Proxy(tmp_path, config(port, admin, backend.port), admin, env=env)
        try:
            (site / "lbproxy").mkdir()
            (site / "lbproxy" / "__init__.py").write_text(
                "raise ImportError('a half-installed lbproxy')\n"
            )
            result = run_cli("upgrade", "--admin", f"http://127.0.0.1:{admin}")
            assert result.returncode == 1, result
            assert "ImportError: a half-installed lbproxy" in result.stderr
            assert "before it was ready; still serving" in result.stderr
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            assert "upgrade failed, still serving" in proxy.log()
        finally:
            proxy.stop()


def test_sigusr2_upgrades_and_the_new_process_tells_systemd_its_pid(tmp_path):
    port, admin = free_port(), free_port()
    notify = NotifySocket(str(tmp_path / "notify"))
    with NameServer("echo") as backend:
        proxy = Proxy(
            tmp_path,
            config(port, admin, backend.port, drain="1s"),
            admin,
            env={"NOTIFY_SOCKET": notify.address},
        )
        try:
            notify.wait_for("READY")
            old = proxy.pid
            os.kill(old, signal.SIGUSR2)
            message = notify.wait_for("MAINPID", timeout=30)
            new = int(message["MAINPID"])
            proxy.pids.append(new)
            assert new != old and message["READY"] == "1"
            assert [pid for pid, m in notify.messages if "MAINPID" in m] == [new]  # its own
            wait_for(lambda: not alive(old), 15, "the old process to exit")
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            # The old process never said STOPPING=1: systemd would stop the service.
            assert not any("STOPPING" in m for pid, m in notify.messages if pid == old)
        finally:
            proxy.stop()
            notify.sock.close()


def test_a_udp_virtual_server_is_handed_over_and_loses_no_new_datagram(tmp_path):
    """The UDP socket goes over too. A session is open in the old process (which would
    keep a draining relay reading the shared socket), yet every datagram of a client
    that comes after the upgrade is answered: the old process reads it no more."""
    port, admin = free_port(), free_port()
    echo = Echo(b"")  # a UDP echo server in a thread
    yaml = textwrap.dedent(
        f"""\
        global:
          admin: {{listen: 127.0.0.1:{admin}}}
          drain_timeout: 2s
        virtual_servers:
          - name: echo
            protocol: udp
            listen: 127.0.0.1:{port}
            udp: {{idle_timeout: 30s, responses: 1000}}
            real_servers:
              - {{name: a, address: 127.0.0.1:{echo.port}}}
        """
    )
    proxy = Proxy(tmp_path, yaml, admin)
    before = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    after = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        before.settimeout(5)
        before.sendto(b"before", ("127.0.0.1", port))
        assert before.recvfrom(100)[0] == b"before"  # a session in the old process
        old = proxy.pid
        proxy.upgrade()
        after.settimeout(2)
        answered = 0
        for i in range(50):
            after.sendto(b"%d" % i, ("127.0.0.1", port))
            with contextlib.suppress(TimeoutError):
                if after.recvfrom(100)[0] == b"%d" % i:
                    answered += 1
        assert answered == 50
        wait_for(lambda: not alive(old), 15, "the old process to exit")
    finally:
        before.close()
        after.close()
        echo.close()
        proxy.stop()


def test_with_workers_the_supervisor_hands_over_its_sockets(tmp_path):
    """workers: 2. The new supervisor takes the TCP listening sockets and the admin
    endpoint, starts its own two workers on them; the old workers drain. A loop of
    20 clients through two upgrades: none refused or reset; a connection held through
    an old worker finishes its transfer."""
    port, admin = free_port(), free_port()
    with NameServer("echo", greeting=False) as backend:
        yaml = config(port, admin, backend.port).replace(
            "  drain_timeout: 10s\n", "  drain_timeout: 10s\n  workers: 2\n"
        )
        proxy = Proxy(tmp_path, yaml, admin)
        try:
            wait_for(lambda: "all 2 workers ready" in proxy.log(), 20, "the workers")
            with ClientLoop(port, clients=20, limit=90) as loop:
                loop.wait_for(50)
                for _ in range(2):
                    held = socket.create_connection(("127.0.0.1", port), timeout=20)
                    held.sendall(b"x")
                    assert held.recv(1) == b"x"
                    old = proxy.pid
                    proxy.upgrade()
                    assert transfer_all([held], MIB) == [MIB]  # through an old worker
                    held.close()
                    wait_for(lambda old=old: not alive(old), 20, f"supervisor {old} to exit")
                    loop.wait_for(50)
            counts = loop.counts
        finally:
            proxy.stop()
    assert proxy.log().count("upgraded: pid") == 2
    assert counts["refused"] == counts["reset"] == counts["error"] == 0, (counts, loop.errors)
    assert counts["mismatch"] == 0 and counts["ok"] > 100, counts


@pytest.mark.parametrize("workers", [1, 2])
def test_an_upgrade_hands_over_more_sockets_than_one_sendmsg_carries(tmp_path, workers):
    """300 listening sockets: the hand-over carries more descriptors than the kernel takes
    in one sendmsg (SCM_MAX_FD, 253). The new process serves every port once the old one
    has exited (it could not have bound them itself while the old one held them)."""
    ports = [free_port() for _ in range(300)]
    admin = free_port()
    with NameServer("echo") as backend:
        listen = ", ".join(f"127.0.0.1:{p}" for p in ports)
        yaml = config(ports[0], admin, backend.port).replace(
            f"listen: 127.0.0.1:{ports[0]}", f"listen: [{listen}]"
        )
        yaml = yaml.replace("global:\n", f"global:\n  workers: {workers}\n", 1)
        proxy = Proxy(tmp_path, yaml, admin)
        try:
            old = proxy.pid
            proxy.upgrade()
            wait_for(lambda: not alive(old), 20, "the old process to exit")
            assert [ask_name(p) for p in ports] == ["echo"] * len(ports)
        finally:
            proxy.stop()
    assert "took over from pid" in proxy.log()


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1), (2, 2)])
def test_changing_workers_with_a_udp_listener_in_an_upgrade(tmp_path, before, after):
    """workers 1 <-> N in one upgrade with a UDP virtual server: the upgrade works, and 20
    new UDP clients are each answered while the old process drains and once it is gone."""
    port, admin, udp_port = free_port(), free_port(), free_port()
    echo = Echo(b"")  # a UDP echo server in a thread
    udp_vs = textwrap.indent(
        textwrap.dedent(
            f"""\
            - name: dgram
              protocol: udp
              listen: 127.0.0.1:{udp_port}
              udp: {{idle_timeout: 30s, responses: 1000}}
              real_servers:
                - {{name: a, address: 127.0.0.1:{echo.port}}}
            """
        ),
        "  ",
    )

    def text(workers: int) -> str:
        yaml = config(port, admin, backend.port) + udp_vs
        return yaml.replace(
            "  drain_timeout: 10s\n", f"  drain_timeout: 10s\n  workers: {workers}\n"
        )

    with NameServer("echo") as backend:
        proxy = Proxy(tmp_path, text(before), admin)
        clients = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(CLIENTS_UDP)]
        held = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(CLIENTS_UDP)]
        try:
            if before > 1:
                wait_for(lambda: f"all {before} workers ready" in proxy.log(), 20, "workers")
            for client in clients + held:
                client.settimeout(2)

            def lost(clients: list[socket.socket]) -> int:
                missing = 0
                for n, client in enumerate(clients):
                    client.sendto(b"%d" % n, ("127.0.0.1", udp_port))
                    try:
                        missing += client.recvfrom(100)[0] != b"%d" % n
                    except TimeoutError:
                        missing += 1
                return missing

            assert lost(held) == 0  # sessions open in the old process(es), kept open
            old = proxy.pid
            proxy.path.write_text(text(after))
            proxy.upgrade()
            if after > 1:
                wait_for(lambda: f"all {after} workers ready" in proxy.log(), 20, "workers")
            assert lost(clients) == 0  # new clients while the old process drains
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            wait_for(lambda: not alive(old), 20, "the old process to exit")
            assert lost(clients) == 0  # and once it is gone
            assert "Traceback" not in proxy.log()
        finally:
            for client in clients + held:
                client.close()
            echo.close()
            proxy.stop()


CLIENTS_UDP = 20


@pytest.mark.parametrize(("before", "after"), [(1, 2), (2, 1), (2, 2)])
def test_changing_workers_with_the_dns_locator_in_an_upgrade(tmp_path, before, after):
    """workers 1 <-> N in one upgrade with the DNS locator fails with a message that says
    why, and the old process serves on (TCP and the locator); 2 -> 2 works."""
    port, admin, dns_port = free_port(), free_port(), free_port()

    def text(workers: int) -> str:
        yaml = config(port, admin, backend.port).replace(
            "  drain_timeout: 10s\n",
            f"  drain_timeout: 10s\n  workers: {workers}\n  locator:\n"
            f"    dns: {{listen: 127.0.0.1:{dns_port}, zone: lb.internal., ttl: 0}}\n",
        )
        return yaml

    with NameServer("echo") as backend:
        proxy = Proxy(tmp_path, text(before), admin)
        try:
            if before > 1:
                wait_for(lambda: f"all {before} workers ready" in proxy.log(), 20, "workers")
            changed = tmp_path / "changed.yaml"
            changed.write_text(text(after))
            result = run_cli("upgrade", "--admin", f"http://127.0.0.1:{admin}", str(changed))
            assert "Traceback" not in result.stderr + proxy.log()
            if before == after:
                assert result.returncode == 0, result
                proxy.pids.append(int(result.stdout.split("pid ")[1].split()[0]))  # stopped
            else:  # the locator's sockets cannot go over: as a configuration error
                assert result.returncode == 2, result
                wanted = f"workers {before} -> {after} with the DNS locator (127.0.0.1:{dns_port})"
                assert f"{wanted} takes a restart" in result.stderr, result.stderr
                assert "still serving" in result.stderr, result.stderr
                assert alive(proxy.pid)
            with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
                assert s.recv(100) == b"echo\n"
            assert dns_answers(dns_port)
        finally:
            proxy.stop()


def dns_answers(port: int) -> bool:
    """`dig` for virtual server web in the locator's zone, over UDP and TCP: an address."""
    dig = tools.need("dig", "bind9-dnsutils")
    for transport in ("+notcp", "+tcp"):
        result = subprocess.run(
            [
                dig,
                "@127.0.0.1",
                "-p",
                str(port),
                transport,
                "+short",
                "+time=2",
                "+tries=1",
                "web.lb.internal",
                "A",
            ],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if result.stdout.strip() != "127.0.0.1":
            return False
    return True


@pytest.mark.parametrize("workers", [1, 2])
def test_the_new_process_starts_from_the_health_the_old_one_saw(name_servers, tmp_path, workers):
    """Active checks: a server down in the old process (its check port refuses) is down
    in the new one from its first connection, with the reason its last check gave, its
    `since` and its downtime so far, and
    a server added at run time and up takes connections at once, though the checks of
    both are silent from the upgrade on (each would take its 10 s timeout to say
    anything). With workers, every new worker starts from one old worker's view."""
    a, b, c = name_servers("a", "b", "c")
    checks = {name: Answering(name, b"PONG\r\n") for name in "ac"}
    with socket.socket() as b_check:
        b_check.bind(("127.0.0.1", 0))  # bound, not listening: every connect is refused
        port, admin = free_port(), free_port()
        check_ports = {"a": checks["a"].port, "b": b_check.getsockname()[1]}
        yaml = with_admin(
            vs_config(
                port,
                [a, b],
                "rr",
                'health_check: {type: send_expect, send: "PING\\r\\n", expect: "^PONG",'
                " interval: 200ms, timeout: 10s, rise: 1, fall: 1}",
                {name: f"health_check: {{port: {check_ports[name]}}}" for name in "ab"},
            ),
            admin,
        )
        if workers > 1:
            yaml = yaml.replace("global:\n", f"global:\n  workers: {workers}\n", 1)
        proxy = Proxy(tmp_path, yaml, admin)
        try:
            if workers > 1:
                wait_for(lambda: f"all {workers} workers ready" in proxy.log(), 20, "workers")
            entry = {"name": "c", "address": f"127.0.0.1:{c.port}"}
            entry["health_check"] = {"port": checks["c"].port}
            status, body = local_http("POST", f"http://127.0.0.1:{admin}{SERVERS}", entry)
            assert status == 201, body
            health = lambda: {rs: doc["health"] for rs, doc in servers_of(admin).items()}  # noqa: E731
            wanted = {"a": "up", "b": "down", "c": "up"}
            wait_for(lambda: health() == wanted, 15, f"{wanted}")
            wait_for(lambda: servers_of(admin)["b"]["downtime_s"] >= 1.0, 15, "b down 1 s")
            b_before = servers_of(admin)["b"]
            b_check.listen()  # connects now succeed and nothing answers
            checks["c"].answer = b""
            upgrade_began = time.time()
            proxy.upgrade()
            assert get_json(admin, "/api/v1/process")["pid"] == proxy.pid
            assert health() == wanted
            # Why b is down: its last check in the old process, until the next one ends.
            assert servers_of(admin)["b"]["check"]["result"] == "fail"
            assert "refused" in servers_of(admin)["b"]["check"]["reason"]
            # ... down since then, and its downtime goes on from what the old one counted
            b_after = servers_of(admin)["b"]
            # b has been down a second or more: `since` is its first failed check, well
            # before the upgrade, not the new process's start.
            assert wall_time(b_after["since"]) < upgrade_began
            if workers == 1:  # the very moment, give or take the clocks' reading
                assert abs(wall_time(b_after["since"]) - wall_time(b_before["since"])) < 0.1
            # With workers, the API shows the latest `since` of the old workers' and the
            # new ones have worker 1's: each worker found b down at its own first check,
            # as far apart as the workers' starts were on a loaded machine.
            assert b_after["downtime_s"] >= b_before["downtime_s"] >= 1.0
            if workers == 1:
                assert sorted(ask_name(port) for _ in range(6)) == ["a"] * 3 + ["c"] * 3
            else:  # each worker's own rotation: a and c, in whatever interleaving
                assert set(ask_name(port) for _ in range(12)) == {"a", "c"}
            assert "2 health state(s) kept" in proxy.log()
        finally:
            proxy.stop()
            for check in checks.values():
                check.stop()
