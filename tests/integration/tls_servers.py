"""Real TLS and HTTPS servers on loopback for the health check tests, and certificates
made with the openssl command line.

`Certificates(folder)`: a test CA (`ca`), and on demand a certificate signed by it for
some names (`signed`), or a self-signed one (`self_signed`); each a (cert, key) pair of
paths. `TlsServer`: Python's `ssl` in a thread per connection, with a certificate, the
ALPN protocols it accepts, and what it answers after the handshake. `HttpsServer`: an
HTTP/1.1 server over TLS whose answer (status, body) a test sets and changes.
"""

from __future__ import annotations

import http.server
import socket
import socketserver
import ssl
import subprocess
import threading
import time
from pathlib import Path

# An endless answer stops after this long (every loop a test starts is bounded).
ENDLESS_FOR = 30.0


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


class Certificates:
    """A CA and certificates for the tests, in `folder` (openssl, EC P-256 keys)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.ca = str(folder / "ca.pem")
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=lbproxy test CA",
            "-addext", "basicConstraints=critical,CA:TRUE",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign",
            cwd=folder,
        )  # fmt: skip

    @staticmethod
    def _alt_names(names: tuple[str, ...]) -> str:
        kinds = ("IP" if name.replace(".", "").isdigit() else "DNS" for name in names)
        return ",".join(f"{kind}:{name}" for kind, name in zip(kinds, names, strict=True))

    def signed(self, stem: str, *names: str) -> tuple[str, str]:
        """A certificate signed by the CA for `names` (DNS names or IPv4 addresses)."""
        (self.folder / f"{stem}.ext").write_text(f"subjectAltName={self._alt_names(names)}\n")
        _openssl(
            "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
            "-keyout", f"{stem}.key", "-out", f"{stem}.csr", "-subj", f"/CN={names[0]}",
            cwd=self.folder,
        )  # fmt: skip
        _openssl(
            "x509", "-req", "-in", f"{stem}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-days", "2", "-out", f"{stem}.pem",
            "-extfile", f"{stem}.ext",
            cwd=self.folder,
        )  # fmt: skip
        return str(self.folder / f"{stem}.pem"), str(self.folder / f"{stem}.key")

    def self_signed(self, stem: str, *names: str) -> tuple[str, str]:
        """A certificate for `names` that signs itself (no CA vouches for it)."""
        _openssl(
            "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
            "-nodes", "-keyout", f"{stem}.key", "-out", f"{stem}.pem", "-days", "2",
            "-subj", f"/CN={names[0]}", "-addext", f"subjectAltName={self._alt_names(names)}",
            cwd=self.folder,
        )  # fmt: skip
        return str(self.folder / f"{stem}.pem"), str(self.folder / f"{stem}.key")


def server_context(cert: tuple[str, str], alpn: list[str] | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(*cert)
    if alpn is not None:
        context.set_alpn_protocols(alpn)
    return context


class _Threaded(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, name: str, handler: type[socketserver.BaseRequestHandler]) -> None:
        self.name = name
        super().__init__(("127.0.0.1", 0), handler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


class _Tls(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: TlsServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.settimeout(10)
        try:
            tls = server.context.wrap_socket(sock, server_side=True)
        except (OSError, ssl.SSLError) as exc:
            server.failed_handshakes.append(exc)
            return
        server.handshakes.append(tls.selected_alpn_protocol())
        with tls:
            self._serve(server, tls)

    @staticmethod
    def _serve(server: TlsServer, tls: ssl.SSLSocket) -> None:
        try:
            if server.answer is not None:
                server.requests.append(tls.recv(100))
                tls.sendall(server.answer)
            if server.endless:
                deadline = time.monotonic() + ENDLESS_FOR
                while time.monotonic() < deadline:
                    tls.sendall(b"x" * 16384)
            while tls.recv(100):  # keep the connection open until the checker closes it
                pass
        except OSError:
            pass


class TlsServer(_Threaded):
    """A TLS server: a handshake with `cert` (ALPN: `alpn`, None = no ALPN at all), then
    with `answer` reads the request and sends `answer`; `endless`: sends forever.
    `client_ca`: a client certificate signed by that CA is required (TLS 1.2 at most, so
    that the refusal, an alert, comes within the client's handshake)."""

    def __init__(
        self,
        name: str,
        cert: tuple[str, str],
        alpn: list[str] | None = None,
        answer: bytes | None = None,
        endless: bool = False,
        client_ca: str | None = None,
    ) -> None:
        self.context = server_context(cert, alpn)
        if client_ca is not None:
            self.context.verify_mode = ssl.CERT_REQUIRED
            self.context.load_verify_locations(client_ca)
            self.context.maximum_version = ssl.TLSVersion.TLSv1_2
        self.answer = answer
        self.endless = endless
        self.handshakes: list[str | None] = []  # the ALPN protocol agreed in each
        self.server_names: list[str | None] = []  # the SNI of each ClientHello
        self.context.sni_callback = lambda _sock, name, _context: self.server_names.append(name)
        self.failed_handshakes: list[Exception] = []
        self.requests: list[bytes] = []
        super().__init__(name, _Tls)


class _Plain(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: PlainServer = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.settimeout(10)
        try:
            server.requests.append(sock.recv(1000))
            if server.answer:
                sock.sendall(server.answer)
            while sock.recv(1000):
                pass
        except OSError:
            pass


class PlainServer(_Threaded):
    """A TCP server that is not TLS: it reads what comes and sends `answer` (b"": says
    nothing), then waits for the close."""

    def __init__(self, name: str, answer: bytes) -> None:
        self.answer = answer
        self.requests: list[bytes] = []
        super().__init__(name, _Plain)


class _Https(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        self.request.settimeout(10)
        try:
            self.request = self.server.context.wrap_socket(self.request, server_side=True)  # type: ignore[attr-defined]
        except OSError:
            self.request = None
            return
        super().setup()

    def handle(self) -> None:
        if self.request is not None:
            super().handle()

    def finish(self) -> None:
        if self.request is not None:
            try:
                super().finish()
            finally:
                self.request.close()

    def _answer(self) -> None:
        server: HttpsServer = self.server  # type: ignore[assignment]
        server.requests.append((self.command, self.path, self.headers.get("Host")))
        status, body = server.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        if server.endless_body:
            self.send_header("Connection", "close")
            self.end_headers()
            deadline = time.monotonic() + ENDLESS_FOR
            try:
                while time.monotonic() < deadline:
                    self.wfile.write(b" " * 16384)
            except OSError:
                pass
            self.close_connection = True
            return
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_OPTIONS = _answer

    def log_message(self, format: str, *args: object) -> None:  # quiet
        pass


class HttpsServer(http.server.ThreadingHTTPServer):
    """HTTP/1.1 over TLS; `answer` = (status, body) may be changed at any time, as a
    Patroni's `/primary` answers 200 on the leader and 503 on a replica."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        name: str,
        cert: tuple[str, str],
        answer: tuple[int, bytes],
        endless_body: bool = False,
    ) -> None:
        self.name = name
        self.context = server_context(cert, ["http/1.1"])
        self.answer = answer
        self.endless_body = endless_body
        self.requests: list[tuple[str, str, str | None]] = []
        super().__init__(("127.0.0.1", 0), _Https)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
