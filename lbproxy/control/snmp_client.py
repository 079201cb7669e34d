"""The SNMP client: one GET of `snmp.oid` from a real server's agent, v2c or v3.

How a GET travels
-----------------
pysnmp's asyncio API is not used: through trio-asyncio it keeps retransmitting after a
cancel, and threads cannot be cancelled at all (and, under load, reported live servers as
dead). Instead pysnmp only *encodes and decodes* messages and trio moves the datagrams:

- SNMPv2c: the packet-level API (`pysnmp.proto.api`, v2c module) builds a GetRequest and
  parses the Response: about 0.5 ms of CPU per GET measured here (1.2 ms for v3
  authPriv; about 1 ms per poll all told inside a running lbproxy), most of it pyasn1.
- SNMPv3 (USM: authNoPriv / authPriv with SHA, SHA-256, MD5 / AES, AES-256, DES): pysnmp's
  own message-processing (`proto.mpmod.rfc3412`) and security (`proto.secmod.rfc3414`)
  subsystems, reached through an `SnmpEngine` whose transport dispatcher is a mailbox:
  `MsgAndPduDispatcher.send_pdu` encodes (engine-ID discovery, time window, keys,
  encryption) and drops the datagram in the mailbox, we send it; a datagram we receive
  goes to `MsgAndPduDispatcher.receive_message`, which decrypts, authenticates, matches
  it to the request by msgID and calls us back. Retransmissions and timeouts are ours:
  the engine's timer never ticks, and a timed-out request's state is released at once.
  No cryptography is written here; pysnmp uses the `cryptography` package for AES/DES.

One poll uses one connected UDP socket (the kernel drops datagrams from anyone else),
opened for the poll and closed after it, so a late answer to an earlier poll can never be
taken for this one. A poll sends its request, waits `timeout`, and retransmits up to
`retries` times (v2c: the same request-id, so an answer to any transmission counts).
Datagrams that do not decode, or carry another request-id, are ignored while waiting. A
cancelled poll is simply gone: nothing keeps running after it.

A poll's result is one of wire/snmp.py's `RESULTS`. Everything but `ok` is "no answer"
for the dynamic weight (dynamic_weight.py). net-snmp drops a v3 message it cannot
decrypt without a report, so a wrong priv key is a timeout; when the agent answered
engine discovery in that same poll, the log says so and points at priv_key_file.

The SNMPv2c messages are in wire/snmp.py; the pollers calling `SnmpClient.get` every
`snmp.interval` are in control/snmp.py.
"""

from __future__ import annotations

import random
import socket
from typing import Any, ClassVar, Literal

import trio
from pysnmp.proto import error as snmp_error

from lbproxy.config.model import SnmpConfig
from lbproxy.config.secret_files import SECRETS
from lbproxy.wire.snmp import (
    BAD_VALUE,
    ERROR,
    MAX_DATAGRAM,
    TIMEOUT,
    BadMessage,
    PollResult,
    checked_value_of,
    decode_response_v2c,
    encode_get_v2c,
    v2c,
)

V3_DISCOVERY_ROUNDS = 4  # engine-ID / time-window reports answered per poll (as pysnmp)


# --------------------------------------------------------------------------------------
# SNMPv3 through pysnmp's message-processing and USM subsystems


_AUTH = {
    "SHA": "USM_AUTH_HMAC96_SHA",
    "SHA256": "USM_AUTH_HMAC192_SHA256",
    "MD5": "USM_AUTH_HMAC96_MD5",
}
# AES256 extends the key as draft-blumenthal-aes-usm does, like net-snmp's "AES-256"
# (checked against snmpd 5.9); pysnmp's USM_PRIV_CFB256_AES is the other (Reeder, Cisco)
# extension, which net-snmp calls "AES-256-C".
_PRIV = {
    "AES": "USM_PRIV_CFB128_AES",
    "AES256": "USM_PRIV_CFB256_AES_BLUMENTHAL",
    "DES": "USM_PRIV_CBC56_DES",
}
_UDP_DOMAIN = (1, 3, 6, 1, 6, 1, 1)  # snmpUDPDomain
_UDP6_DOMAIN = (1, 3, 6, 1, 2, 1, 100, 1, 2)  # transportDomainUdpIpv6
# errind values compare by name and cannot be hashed: keyed by class name here.
_RESEND = {"UnknownEngineID", "NotInTimeWindow"}  # answered by sending a new request
_AUTH_HINT = "check auth_key_file and auth_protocol"
_V3_ERRORS = {
    "WrongDigest": f"authentication failed (wrong digest): {_AUTH_HINT}",
    "AuthenticationFailure": f"authentication failed: {_AUTH_HINT}",
    "AuthenticationError": f"authentication failed: {_AUTH_HINT}",
    "DecryptionError": "decryption failed: check priv_key_file and priv_protocol",
    "UnknownUserName": "the agent does not know this user: check user",
    "UnknownSecurityName": "the agent does not know this user: check user",
    "UnsupportedSecurityLevel": "the agent refuses this security level for the user "
    "(the auth/priv keys configured here and on the agent must match)",
}


class V3Credentials:
    """A v3 user with its passphrases read from the key files (raises OSError/ValueError)."""

    def __init__(self, snmp: SnmpConfig) -> None:
        if not snmp.user:
            raise ValueError("snmp version 3 needs 'user'")
        self.user = snmp.user
        self.auth_protocol = snmp.auth_protocol if snmp.auth_key_file else None
        self.priv_protocol = snmp.priv_protocol if snmp.priv_key_file else None
        self.auth_key = _read_key(snmp.auth_key_file) if snmp.auth_key_file else None
        self.priv_key = _read_key(snmp.priv_key_file) if snmp.priv_key_file else None
        if self.priv_key is not None and self.auth_key is None:
            raise ValueError("priv_key_file needs auth_key_file too (USM has no privNoAuth)")
        # USM security levels: 1 noAuthNoPriv, 2 authNoPriv, 3 authPriv
        self.level = 3 if self.priv_key else 2 if self.auth_key else 1

    def key(self) -> tuple:
        return (self.user, self.auth_protocol, self.auth_key, self.priv_protocol, self.priv_key)


def _read_key(path: str) -> str:
    key = SECRETS.read(path).rstrip("\r\n")
    if len(key) < 8:
        raise ValueError(f"{path}: an SNMPv3 passphrase has at least 8 characters")
    return key


class _V3Engine:
    """One pysnmp SnmpEngine for one set of v3 credentials, shared by every poller using
    them (the engine costs ~50 ms to build; keys are localized per agent and cached).

    The engine's transport dispatcher is a mailbox: the engine puts datagrams in
    `outbox`, the poller sends them on its own socket.
    """

    _engines: ClassVar[dict[tuple, _V3Engine]] = {}

    def __init__(self, credentials: V3Credentials) -> None:
        from pysnmp.carrier.base import AbstractTransportDispatcher
        from pysnmp.entity import config as engine_config
        from pysnmp.entity.engine import SnmpEngine

        outbox: list[bytes] = []

        class Mailbox(AbstractTransportDispatcher):
            def send_message(self, outgoingMessage, transportDomain, transportAddress):
                outbox.append(bytes(outgoingMessage))

        self.outbox = outbox
        self.engine = SnmpEngine()
        self.engine.register_transport_dispatcher(Mailbox())
        auth = getattr(engine_config, _AUTH[credentials.auth_protocol or "SHA"])
        priv = getattr(engine_config, _PRIV[credentials.priv_protocol or "AES"])
        engine_config.add_v3_user(
            self.engine,
            credentials.user,
            auth if credentials.auth_key else engine_config.USM_AUTH_NONE,
            credentials.auth_key,
            priv if credentials.priv_key else engine_config.USM_PRIV_NONE,
            credentials.priv_key,
        )
        self.security_name = v2c.OctetString(credentials.user)
        self.level = credentials.level
        self.outcomes: dict[int, tuple[Any, Any]] = {}

    @classmethod
    def for_credentials(cls, credentials: V3Credentials) -> _V3Engine:
        engine = cls._engines.get(credentials.key())
        if engine is None:
            engine = cls._engines[credentials.key()] = cls(credentials)
        return engine

    def _callback(
        self,
        snmpEngine,
        messageProcessingModel,
        securityModel,
        securityName,
        securityLevel,
        contextEngineId,
        contextName,
        pduVersion,
        PDU,
        statusInformation,
        sendPduHandle,
        cbCtx,
    ) -> None:
        self.outcomes[sendPduHandle] = (statusInformation, PDU)

    def send(self, domain: tuple, address: tuple, pdu: Any) -> tuple[int, bytes]:
        """Encode `pdu` for `address`: (handle, datagram). Raises StatusInformation."""
        dispatcher = self.engine.message_dispatcher
        self.outbox.clear()
        handle = dispatcher.send_pdu(
            self.engine,
            transportDomain=domain,
            transportAddress=address,
            messageProcessingModel=3,  # SNMPv3
            securityModel=3,  # USM
            securityName=self.security_name,
            securityLevel=self.level,
            contextEngineId=None,  # the agent's, once discovered
            contextName=b"",
            pduVersion=1,  # SNMPv2 PDUs
            PDU=pdu,
            expectResponse=True,
            timeout=1 << 30,  # in timer ticks, which never advance: timeouts are ours
            cbFun=self._callback,
            cbCtx=None,
        )
        datagram = self.outbox.pop() if self.outbox else b""
        self.outbox.clear()
        return handle, datagram

    def receive(self, domain: tuple, address: tuple, data: bytes, handle: int):
        """Feed one datagram; the (statusInformation, PDU) for `handle`, or None."""
        try:
            self.engine.message_dispatcher.receive_message(self.engine, domain, address, data)
        except Exception:  # pysnmp raises assorted errors on garbage
            self.outbox.clear()
            raise BadMessage("undecodable datagram") from None
        self.outbox.clear()  # a report the engine wanted to send back: not ours to send
        return self.outcomes.pop(handle, None)

    def release(self, handle: int) -> None:
        """Forget a request that timed out (the engine's own timer never runs)."""
        self.outcomes.pop(handle, None)
        self.engine.message_dispatcher.release_state_information(self.engine, handle, 3)


# --------------------------------------------------------------------------------------
# The client: one GET, with timeout and retransmissions


class _Exchange:
    """One poll's request/answer logic, independent of the socket."""

    garbage = False

    def request(self) -> bytes:  # the next transmission
        raise NotImplementedError

    def receive(self, data: bytes) -> PollResult | Literal[True] | None:
        """A datagram: a result, None (not ours: keep waiting), True (send again now)."""
        raise NotImplementedError

    def abandon(self) -> None:  # a transmission timed out
        pass

    def silence(self, refused: bool, attempts: int) -> PollResult:
        if self.garbage:
            return PollResult(BAD_VALUE, detail="only undecodable datagrams came back")
        if refused:
            return PollResult(ERROR, detail="port unreachable (no agent listening)")
        return PollResult(TIMEOUT, detail=f"no answer to {attempts} transmission(s)")


class _V2cExchange(_Exchange):
    def __init__(self, snmp: SnmpConfig) -> None:
        self.oid = snmp.oid
        self.request_id = random.getrandbits(31)
        self.datagram = encode_get_v2c(snmp.community, snmp.oid, self.request_id)

    def request(self) -> bytes:
        return self.datagram  # retransmissions reuse the request-id: any answer counts

    def receive(self, data: bytes) -> PollResult | None:
        try:
            request_id, pdu = decode_response_v2c(data)
        except BadMessage:
            self.garbage = True
            return None
        if request_id != self.request_id:
            return None
        return checked_value_of(pdu, self.oid)


class _V3Exchange(_Exchange):
    def __init__(self, engine: _V3Engine, snmp: SnmpConfig, domain: tuple, address: tuple):
        self.engine = engine
        self.oid = snmp.oid
        self.domain = domain
        self.address = address
        self.pdu = v2c.GetRequestPDU()
        v2c.apiPDU.set_defaults(self.pdu)
        v2c.apiPDU.set_varbinds(self.pdu, [(snmp.oid, v2c.null)])
        self.handle: int | None = None
        self.rounds = 0
        self.discovered = False

    def request(self) -> bytes:
        self.handle, datagram = self.engine.send(self.domain, self.address, self.pdu)
        return datagram

    def receive(self, data: bytes) -> PollResult | Literal[True] | None:
        assert self.handle is not None
        try:
            outcome = self.engine.receive(self.domain, self.address, data, self.handle)
        except BadMessage:
            self.garbage = True
            return None
        if outcome is None:
            return None
        self.handle = None
        status, pdu = outcome
        if status:
            indication = status["errorIndication"]
            kind = indication.__class__.__name__
            if kind in _RESEND and self.rounds < V3_DISCOVERY_ROUNDS:
                self.rounds += 1
                self.discovered = True
                return True
            reason = _V3_ERRORS.get(kind, str(indication))
            return PollResult(ERROR, detail=f"SNMPv3: {reason}")
        if v2c.apiPDU.get_request_id(pdu) != v2c.apiPDU.get_request_id(self.pdu):
            return PollResult(ERROR, detail="SNMPv3: answer with another request-id")
        return checked_value_of(pdu, self.oid)

    def abandon(self) -> None:
        if self.handle is not None:
            self.engine.release(self.handle)
            self.handle = None

    def silence(self, refused: bool, attempts: int) -> PollResult:
        result = super().silence(refused, attempts)
        if result.result == TIMEOUT and self.discovered:
            # net-snmp drops a message it cannot decrypt without a report
            return PollResult(
                TIMEOUT,
                detail=f"{result.detail}; the agent answered engine discovery but not the "
                "encrypted request: check priv_key_file and priv_protocol",
            )
        return result


class SnmpClient:
    """GET `snmp.oid` from `snmp.host:snmp.port`, as configured (v2c or v3)."""

    def __init__(self, snmp: SnmpConfig) -> None:
        self.snmp = snmp
        self._v3: _V3Engine | None = None
        self._v3_error: str | None = None
        if snmp.version == "3":
            try:
                self._v3 = _V3Engine.for_credentials(V3Credentials(snmp))
            except (OSError, ValueError) as exc:
                self._v3_error = f"SNMPv3 credentials: {exc}"
            except snmp_error.PySnmpError as exc:  # pragma: no cover - a pysnmp refusal
                self._v3_error = f"SNMPv3 credentials refused by pysnmp: {exc}"

    async def get(self) -> PollResult:
        """One poll: 1 + `retries` transmissions, each waiting `timeout`."""
        if self._v3_error:
            return PollResult(ERROR, detail=self._v3_error)
        snmp = self.snmp
        try:
            infos = await trio.socket.getaddrinfo(snmp.host, snmp.port, type=socket.SOCK_DGRAM)
        except OSError as exc:
            return PollResult(ERROR, detail=f"cannot resolve {snmp.host}: {exc}")
        family, _type, _proto, _name, address = infos[0]
        with trio.socket.socket(family, socket.SOCK_DGRAM) as sock:
            try:
                await sock.connect(address)
            except OSError as exc:
                return PollResult(ERROR, detail=f"socket error: {exc}")
            if self._v3 is not None:
                domain = _UDP6_DOMAIN if family == socket.AF_INET6 else _UDP_DOMAIN
                exchange: _Exchange = _V3Exchange(self._v3, snmp, domain, address[:2])
            else:
                exchange = _V2cExchange(snmp)
            try:
                return await self._exchange(sock, exchange)
            except OSError as exc:
                return PollResult(ERROR, detail=f"socket error: {exc}")
            except snmp_error.StatusInformation as exc:  # v3 encoding refused
                return PollResult(ERROR, detail=f"SNMPv3: {exc.get('errorIndication', exc)}")
            finally:
                exchange.abandon()

    async def _exchange(self, sock: trio.socket.SocketType, exchange: _Exchange) -> PollResult:
        timeout = self.snmp.timeout
        attempts = 0
        refused = False
        while attempts <= self.snmp.retries:
            await sock.send(exchange.request())
            attempts += 1
            deadline = trio.current_time() + timeout
            while True:
                with trio.move_on_at(deadline):
                    try:
                        data = await sock.recv(MAX_DATAGRAM)
                    except ConnectionRefusedError:
                        # ICMP port unreachable from an earlier send; wait out the timeout
                        # anyway (an agent may be starting) and retransmit as planned
                        refused = True
                        continue
                    outcome = exchange.receive(data)
                    if outcome is True:  # v3 discovery: send again, not a retransmission
                        await sock.send(exchange.request())
                        deadline = trio.current_time() + timeout
                        continue
                    if outcome is not None:
                        return outcome
                    continue
                exchange.abandon()
                break
        return exchange.silence(refused, attempts)
