"""A real dnsmasq on a loopback port, serving the records a test writes (SPEC §14 tests).

    dns = Dnsmasq(tmp_path / "dns").start(
        srv={"_web._tcp.svc.test": [(0, 1, 8081, "a.node.test")]},  # priority weight port target
        hosts={"a.node.test": ["127.0.0.1"], "web.k8s.test": ["127.0.0.2", "127.0.0.3"]},
    )
    dns.set_hosts({...})   # A/AAAA records: rewrites the --addn-hosts file and sends SIGHUP
    dns.set_srv({...})     # SRV records: dnsmasq reads them only at start, so it restarts
    dns.stop()             # silent from now on (a resolver outage); start() again, same port

Names under `test.` that have no record answer NXDOMAIN (`local=/test/`); a name with
records of another type only answers NOERROR without records. dnsmasq keeps no cache of
its own records, so the next query sees a change at once.
"""

from __future__ import annotations

import contextlib
import getpass
import signal
import subprocess
from pathlib import Path

import dns.message
import dns.query

from tests import tools
from tests.integration.harness import free_port, wait_for

DNSMASQ = tools.find("dnsmasq")

requires_dnsmasq = tools.requires("dnsmasq", package="dnsmasq-base")

SrvRecords = dict[str, list[tuple[int, int, int, str]]]


class Dnsmasq:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.port = port or free_port()
        self.conf = folder / "dnsmasq.conf"
        self.hosts = folder / "hosts"
        self.log_path = folder / "dnsmasq.log"
        self.srv: SrvRecords = {}
        self.proc: subprocess.Popen | None = None
        self._log = None
        self._hosts: dict[str, list[str]] = {}

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, srv: SrvRecords | None = None, hosts: dict | None = None) -> Dnsmasq:
        if srv is not None:
            self.srv = srv
        if hosts is not None:
            self._write_hosts(hosts)
        elif not self.hosts.exists():
            self._write_hosts({})
        self._write_conf()
        assert DNSMASQ is not None
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                DNSMASQ,
                "--no-daemon",
                f"--port={self.port}",
                "--listen-address=127.0.0.1",
                "--bind-interfaces",
                "--no-resolv",
                "--no-hosts",
                f"--conf-file={self.conf}",
                f"--addn-hosts={self.hosts}",
                f"--pid-file={self.folder / 'dnsmasq.pid'}",
                f"--user={getpass.getuser()}",  # as root, it would read the files as nobody
                "--log-queries",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_answering()
        return self

    def _write_conf(self) -> None:
        lines = ["local=/test/"]
        for name, records in self.srv.items():
            lines += [
                f"srv-host={name},{target},{port},{priority},{weight}"
                for priority, weight, port, target in records
            ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _write_hosts(self, hosts: dict[str, list[str]]) -> None:
        self._hosts = dict(hosts)
        text = "".join(f"{ip} {name}\n" for name, ips in hosts.items() for ip in ips)
        tmp = self.hosts.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.hosts)  # dnsmasq never reads half a file

    def _wait_answering(self, timeout: float = 10.0) -> None:
        query = dns.message.make_query("ready.test.", "A")

        def answers() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"dnsmasq exited {self.proc.returncode}:\n{self.log()}")
            try:
                dns.query.udp(query, "127.0.0.1", port=self.port, timeout=0.2)
            except (dns.exception.Timeout, OSError):
                return False
            return True

        wait_for(answers, timeout, "dnsmasq to answer", details=self.log)

    def set_hosts(self, hosts: dict[str, list[str]], timeout: float = 5.0) -> None:
        """New A/AAAA records: dnsmasq re-reads the hosts file on SIGHUP; returns once
        it answers with them (the signal and a query race otherwise)."""
        old = self._hosts
        self._write_hosts(hosts)
        assert self.proc is not None
        self.proc.send_signal(signal.SIGHUP)

        def taken() -> bool:
            names = {*old, *hosts}
            return all(self.addresses(name) == set(hosts.get(name, ())) for name in names)

        wait_for(taken, timeout, "dnsmasq to take the new hosts", 0.01, details=self.log)

    def addresses(self, name: str) -> set[str]:
        """What dnsmasq answers now for `name`, A and AAAA together."""
        found: set[str] = set()
        for rdtype in ("A", "AAAA"):
            query = dns.message.make_query(name, rdtype)
            response = dns.query.udp(query, "127.0.0.1", port=self.port, timeout=1.0)
            found |= {rdata.address for rrset in response.answer for rdata in rrset}
        return found

    def set_srv(self, srv: SrvRecords) -> None:
        """New SRV records: dnsmasq reads srv-host only at start, so restart it."""
        self.stop()
        self.start(srv=srv)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            self.proc = None
        if self._log is not None:
            with contextlib.suppress(OSError):
                self._log.close()
            self._log = None
