"""A real net-snmp `snmpd` per real server, for the SNMP poller's integration tests.

Each `SnmpAgent` runs `snmpd -f` as a child on its own loopback UDP port, with its own
configuration and `SNMP_PERSISTENT_DIR` in a temporary folder (snmpd rewrites its
persistent files; never point it at the configuration's folder). The weight OID is served
by `pass_persist` with a tiny script that reads the answer from a file on every request,
so a test changes the value by rewriting the file (plain `pass` would cache it for 30 s).

    agent = SnmpAgent(tmp_path / "a1", value=7).start()
    agent.set_value(8)          # the next poll reads 8
    agent.set_string("busy")    # an OctetString: the poller counts bad_value
    agent.set_missing()         # noSuchInstance
    agent.stop()                # silent from now on; start() again on the same port

For v3, the agent also has `createUser` / `rouser ... priv` for `V3_USER` (SHA/AES) and
`V3_USER_STRONG` (SHA-256/AES-256), both with `V3_AUTH_KEY` / `V3_PRIV_KEY`.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tests import tools
from tests.integration.harness import wait_for

# NET-SNMP-MIB::netSnmpPlaypen, the subtree net-snmp reserves for experiments.
BASE_OID = "1.3.6.1.4.1.8072.9999.1"
VALUE_OID = BASE_OID + ".0"

V3_USER = "lbproxy"  # SHA / AES
V3_USER_STRONG = "lbproxy256"  # SHA-256 / AES-256 (net-snmp's Blumenthal key extension)
V3_AUTH_KEY = "lbproxy-auth-secret"
V3_PRIV_KEY = "lbproxy-priv-secret"

SNMPD = tools.find("snmpd")

requires_snmpd = tools.requires("snmpd", package="snmpd")

_PASS_PERSIST = """\
import sys

value_file, base = sys.argv[1], "." + sys.argv[2].lstrip(".")
oid = base + ".0"


def answer():
    try:
        with open(value_file) as f:
            kind, _, value = f.read().strip().partition(" ")
    except OSError:
        return "NONE"
    if kind == "none":
        return "NONE"
    return f"{oid}\\n{kind}\\n{value}"


for line in sys.stdin:
    command = line.strip()
    if command == "PING":
        print("PONG", flush=True)
    elif command == "get":
        asked = sys.stdin.readline().strip()
        print(answer() if asked == oid else "NONE", flush=True)
    elif command == "getnext":
        asked = sys.stdin.readline().strip()
        print(answer() if asked in (base, "." + base.lstrip(".")) or asked < oid else "NONE",
              flush=True)
    elif command == "set":
        sys.stdin.readline()
        sys.stdin.readline()
        print("not-writable", flush=True)
"""


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SnmpAgent:
    """One snmpd child on 127.0.0.1:port answering VALUE_OID from a file."""

    def __init__(
        self,
        folder: Path,
        value: int | None = None,
        *,
        community: str = "public",
        port: int | None = None,
    ) -> None:
        if SNMPD is None:
            tools.missing("snmpd", "snmpd")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_udp_port()
        self.community = community
        self.value_file = self.folder / "value"
        self.proc: subprocess.Popen | None = None
        self._log = None
        if value is None:
            self.set_missing()
        else:
            self.set_value(value)
        script = self.folder / "pass_persist.py"
        script.write_text(_PASS_PERSIST)
        self.conf = self.folder / "snmpd.conf"
        self.conf.write_text(
            "\n".join(
                [
                    f"rocommunity {community} 127.0.0.1",
                    f'createUser {V3_USER} SHA "{V3_AUTH_KEY}" AES "{V3_PRIV_KEY}"',
                    f"rouser {V3_USER} priv",
                    f'createUser {V3_USER_STRONG} SHA-256 "{V3_AUTH_KEY}" AES-256 "{V3_PRIV_KEY}"',
                    f"rouser {V3_USER_STRONG} priv",
                    f"pass_persist .{BASE_OID} {sys.executable} {script} "
                    f"{self.value_file} {BASE_OID}",
                    "",
                ]
            )
        )

    # -- the answer ----------------------------------------------------------------

    def _write(self, text: str) -> None:
        tmp = self.value_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(self.value_file)  # atomic: the script never reads half a value

    def set_value(self, value: int) -> None:
        self._write(f"integer {int(value)}")

    def set_string(self, text: str) -> None:
        self._write(f"string {text}")

    def set_missing(self) -> None:
        self._write("none")

    # -- the process ---------------------------------------------------------------

    @property
    def log_path(self) -> Path:
        return self.folder / "snmpd.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def start(self, timeout: float = 10.0) -> SnmpAgent:
        self.launch()
        return self.wait_ready(timeout)

    def launch(self) -> SnmpAgent:
        """Start snmpd without waiting (`wait_ready` waits): agents start side by side."""
        assert SNMPD is not None
        persistent = self.folder / "persist"
        shutil.rmtree(persistent, ignore_errors=True)  # createUser again from the conf
        persistent.mkdir()
        # MIBDIRS empty: snmpd loads no MIB text files (it serves by OID; it would only
        # fill its log with "Cannot find module").
        env = dict(os.environ, SNMP_PERSISTENT_DIR=str(persistent), MIBS="", MIBDIRS="")
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                SNMPD,
                "-f",
                "-Lo",
                "-C",
                "-c",
                str(self.conf),
                "-I",
                "-smux",
                f"udp:127.0.0.1:{self.port}",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        return self

    def wait_ready(self, timeout: float = 10.0) -> SnmpAgent:
        assert self.proc is not None

        def answers() -> bool:
            assert self.proc is not None
            if self._answers():
                return True
            if self.proc.poll() is not None:
                raise RuntimeError(f"snmpd exited {self.proc.returncode}:\n{self.log()}")
            return False

        try:
            wait_for(answers, timeout, f"snmpd to answer on port {self.port}", details=self.log)
        except AssertionError:
            self.stop()
            raise
        return self

    def _answers(self) -> bool:
        """One raw SNMPv2c GET of sysUpTime.0 (any answer at all means ready)."""
        return probe(self.port, self.community)

    def stop(self) -> None:
        """Kill the agent: from now on nothing answers on its port."""
        if self.proc is not None and self.proc.poll() is None:
            # SIGKILL to snmpd and its pass_persist child (its own session): no goodbye,
            # as an agent that dies.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def __enter__(self) -> SnmpAgent:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


def probe(port: int, community: str = "public", timeout: float = 0.2) -> bool:
    """True when something answers an SNMPv2c GET of sysUpTime.0 on 127.0.0.1:port."""
    from lbproxy.wire import snmp  # the codec under test is also the readiness probe

    request = snmp.encode_get_v2c(community, "1.3.6.1.2.1.1.3.0", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.settimeout(timeout)
        s.connect(("127.0.0.1", port))
        try:
            s.send(request)
            return bool(s.recv(65535))
        except OSError:
            return False


def start_agents(folder: Path, values, **options) -> list[SnmpAgent]:
    """One running agent per value (None: noSuchInstance), started side by side."""
    agents = [
        SnmpAgent(Path(folder) / f"agent{i}", value, **options) for i, value in enumerate(values)
    ]
    for agent in agents:
        agent.launch()
    try:
        for agent in agents:
            agent.wait_ready()
    except BaseException:
        for agent in agents:
            agent.stop()
        raise
    return agents


class GarbagePeer:
    """A UDP peer that answers every datagram with bytes that are not SNMP."""

    def __init__(self, reply: bytes = b"\x30\x03\x02\x01garbage, not BER") -> None:
        import threading

        self.reply = reply
        self.received = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                _data, peer = self.sock.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            self.received += 1
            self.sock.sendto(self.reply, peer)

    def stop(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
