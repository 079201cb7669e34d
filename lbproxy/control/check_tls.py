"""The TLS layer of a health check (SPEC §22): `type: tls`, and `http` with `tls: true`.

`TlsLayer(address, check).wrap(stream)` takes the check's connected stream, completes a
TLS handshake over it (Python's `ssl` through `trio.SSLStream`) and gives the stream the
rest of the check speaks through: `send`/`expect` for a `tls` check, the HTTP request
for an HTTPS one. What it checks:

- `verify: none` (the default): any certificate; `verify: CA-FILE`: the chain must lead
  to a certificate of that file, and the certificate must name `sni`, else the address's
  host (an IP address is matched against the certificate's IP addresses). The CA file is
  looked at (stat) at each check and read again when it changed, so a replaced file is
  picked up without a reload; a context is made once per setting and file version (a
  CA bundle takes milliseconds to load, a stat microseconds).
- `sni`: the server name sent; without it a host name address is sent, an IP never
  (RFC 6066).
- `alpn`: the protocols offered; the server must pick one of them.

Every failure raises `TlsFailed` with a reason a person reads, which says what the
server did: `tls: certificate verify failed: self-signed certificate`, `tls: handshake
failed: alert 'handshake failure' from the server`, `tls: no ALPN protocol agreed
(offered h2; the server chose none)`, `tls: not a TLS server (it sent "SSH-2.0-...")`.
A handshake still under way when the check's timeout ends is told apart by
`timeout_reason`: nothing at all received, or a handshake that did not complete.

What the server sends during the handshake is bounded by OpenSSL (a record is at most
16 KiB plus its header; a certificate chain at most 100 KiB) and by the check's timeout;
only the first bytes are kept, to name a server that is not TLS at all.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import ssl

import trio

from lbproxy.config.model import Address, HealthCheckConfig

FIRST_BYTES = 24  # of the server's answer, kept to show a server that does not speak TLS
# The first byte of a TLS record a server may open with: handshake (22) or alert (21).
_TLS_RECORD_TYPES = (0x15, 0x16)


class TlsFailed(Exception):
    """The TLS layer failed; str() is the whole reason, `tls: ...`."""


class _Recorded(trio.abc.Stream):
    """The connected stream, keeping the first bytes the server sent."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.first = bytearray()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        data = await self.inner.receive_some(max_bytes)
        if len(self.first) < FIRST_BYTES:
            self.first += data[: FIRST_BYTES - len(self.first)]
        return data

    async def aclose(self) -> None:
        await self.inner.aclose()


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _context(check: HealthCheckConfig) -> ssl.SSLContext:
    """The client context of the check: made once per setting and CA file version (a CA
    bundle takes milliseconds to load; a context serves any number of connections)."""
    offered = check.alpn or (("http/1.1",) if check.type == "http" else ())
    if check.verify is None:
        return _made(None, None, offered)
    try:
        found = os.stat(check.verify)
    except OSError as exc:  # removed since the configuration was loaded
        raise TlsFailed(f"tls: cannot read the CA file {check.verify}: {_describe(exc)}") from None
    version = (found.st_ino, found.st_size, found.st_mtime_ns)
    return _made(check.verify, version, offered)


@functools.lru_cache(maxsize=64)
def _made(
    verify: str | None, version: tuple[int, int, int] | None, offered: tuple[str, ...]
) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if verify is None:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    else:
        try:
            context.load_verify_locations(cafile=verify)
        except ssl.SSLError:  # an OSError too: first
            raise TlsFailed(f"tls: the CA file {verify} holds no PEM certificate") from None
        except OSError as exc:
            raise TlsFailed(f"tls: cannot read the CA file {verify}: {_describe(exc)}") from None
    if offered:
        context.set_alpn_protocols(list(offered))
    return context


def _describe(exc: OSError) -> str:
    return (exc.strerror or str(exc)).lower()


def _quoted(data: bytes) -> str:
    """The first bytes a server sent, escaped for a log line."""
    text = repr(data)[2:-1].replace('"', '\\"')
    return f'"{text}..."' if len(data) >= FIRST_BYTES else f'"{text}"'


class TlsLayer:
    """One check's TLS handshake over its connected stream (module header)."""

    def __init__(self, address: Address, check: HealthCheckConfig) -> None:
        self.address = address
        self.check = check
        self.established = False
        self._recorded: _Recorded | None = None

    def _server_hostname(self) -> str | None:
        if self.check.sni:
            return self.check.sni
        if self.check.verify is not None:  # verified against the address
            return self.address.host
        return None if _is_ip(self.address.host) else self.address.host

    async def wrap(self, stream: trio.abc.Stream) -> trio.SSLStream[trio.abc.Stream]:
        """The handshake over `stream`; raises TlsFailed (the stream is then closed)."""
        context = _context(self.check)
        self._recorded = recorded = _Recorded(stream)
        # https_compatible: a server that closes without close_notify has just closed
        # (as browsers read it); aclose does not wait for the server's close_notify.
        tls: trio.SSLStream[trio.abc.Stream] = trio.SSLStream(
            recorded, context, server_hostname=self._server_hostname(), https_compatible=True
        )
        try:
            await tls.do_handshake()
            agreed = tls.selected_alpn_protocol()
            if self.check.alpn and agreed not in self.check.alpn:
                chose = f"chose {agreed}" if agreed else "chose none"
                raise TlsFailed(
                    f"tls: no ALPN protocol agreed (offered {', '.join(self.check.alpn)};"
                    f" the server {chose})"
                )
        except BaseException as exc:
            await trio.aclose_forcefully(stream)
            if isinstance(exc, trio.BrokenResourceError | OSError):
                raise TlsFailed(self._failure(exc)) from None
            raise
        self.established = True
        return tls

    def _failure(self, exc: BaseException) -> str:
        """The reason a handshake failed: what the server did, as far as it can be told."""
        cause = exc.__cause__ if isinstance(exc, trio.BrokenResourceError) else exc
        first = bytes(self._recorded.first) if self._recorded else b""
        if first and first[0] not in _TLS_RECORD_TYPES:
            return f"tls: not a TLS server (it sent {_quoted(first)})"
        if isinstance(cause, ssl.SSLCertVerificationError):
            message = (cause.verify_message or cause.reason or "").rstrip(".")
            return f"tls: certificate verify failed: {message}"
        if isinstance(cause, ssl.SSLEOFError) or cause is None:
            if not first:
                return "tls: the server closed the connection without answering the handshake"
            return "tls: the server closed the connection during the handshake"
        if isinstance(cause, ssl.SSLError):
            reason = cause.reason or cause.strerror or str(cause)
            if "ALERT_" in reason:
                alert = reason.split("ALERT_", 1)[1].lower().replace("_", " ")
                return f"tls: handshake failed: alert {alert!r} from the server"
            return f"tls: handshake failed: {reason.lower().replace('_', ' ')}"
        if isinstance(cause, ConnectionResetError):
            return "tls: connection reset during the handshake"
        if isinstance(cause, OSError) and cause.strerror:
            return f"tls: handshake failed: {cause.strerror.lower()}"
        return f"tls: handshake failed: {cause}"

    def timeout_reason(self, timeout: float) -> str | None:
        """Why the check's timeout ended it during the handshake; None once it is done."""
        if self.established or self._recorded is None:
            return None
        within = f"within {timeout:g}s"
        if not self._recorded.first:
            return f"tls: no answer to the ClientHello {within}"
        first = bytes(self._recorded.first)
        if first[0] not in _TLS_RECORD_TYPES:
            return f"tls: not a TLS server (it sent {_quoted(first)})"
        return f"tls: handshake did not complete {within}"
