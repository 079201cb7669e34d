"""The SNMP poller: one GET per real server every `snmp.interval`, feeding the pool.

Every pysnmp call of the project is in this module (pysnmp 7.0 renamed its packet-level
API without aliases; one module is one place to follow the next rename).

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

Results, as counted in `lbproxy_snmp_polls_total{result}`:
  ok         an integer value (INTEGER, Gauge32, Counter32/64, Unsigned32, TimeTicks)
  bad_value  an answer that is not an integer (OctetString, noSuchObject, noSuchInstance,
             endOfMibView), or only undecodable datagrams came back
  timeout    no answer to any transmission
  error      an SNMP error status, a v3 security error (wrong digest, unknown user,
             unsupported security level, decryption error), ICMP port unreachable, a
             socket error, or a key file that cannot be read
Everything but `ok` is "no answer" for the dynamic weight (dynamic_weight.py). net-snmp
drops a v3 message it cannot decrypt without a report, so a wrong priv key is a timeout;
when the agent answered engine discovery in that same poll, the log says so and points at
priv_key_file.

The pollers
-----------
`SnmpPollers` runs one task per real server of every virtual server whose scheduler is
`dwd`, `dwr`, or `least-load` with `load_source: snmp`, in the Server's service
nursery, kept in step by the one reconciler (reconcile.py): `sync()` is called after
start-up and after every reload; it starts pollers for new real servers, stops those of
removed ones, and restarts one whose `snmp` block changed. The first poll comes within
a second of the start, later ones at a random phase within the interval, so many
servers' polls spread out instead of arriving together. Each poll's result goes
through dynamic_weight.py (on_no_answer, stale_after, smoothing) into the pool's two
validated entry points, `report_value` and `set_dynamic_weight`; counts go to
`RealServer.counters.snmp_polls` and `Pool.poll_durations`, which the metrics module reads at
scrape time.

`serve_v2c_agent` is a tiny SNMPv2c agent on the same messages, for `lbproxy demo` and
the unit tests.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal

import trio
from pyasn1.codec.ber import decoder, encoder
from pyasn1.type import univ
from pysnmp.proto import api
from pysnmp.proto import error as snmp_error

from lbproxy.config.model import SnmpConfig
from lbproxy.config.secret_files import SECRETS
from lbproxy.control.reconcile import Configured, Reconciler
from lbproxy.core.dynamic_weight import DynamicWeight, Report, SetWeight
from lbproxy.core.pool import Pool, RealServer
from lbproxy.net.barrier import record

log = logging.getLogger("lbproxy.snmp")

OK, TIMEOUT, ERROR, BAD_VALUE = "ok", "timeout", "error", "bad_value"
RESULTS = (OK, TIMEOUT, ERROR, BAD_VALUE)

MAX_DATAGRAM = 65535
FIRST_POLL_WITHIN = 1.0  # seconds: see Poller.run
V3_DISCOVERY_ROUNDS = 4  # engine-ID / time-window reports answered per poll (as pysnmp)

_v2c = api.PROTOCOL_MODULES[api.SNMP_VERSION_2C]
_RESPONSE_TAGS = _v2c.ResponsePDU.tagSet
_NO_SUCH = (_v2c.NoSuchObject, _v2c.NoSuchInstance, _v2c.EndOfMibView)


# --------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, slots=True)
class PollResult:
    result: str  # ok | timeout | error | bad_value
    value: int | None = None
    detail: str = ""  # for the log: why it is not ok


# --------------------------------------------------------------------------------------
# SNMPv2c messages (pysnmp's packet-level API)


class BadMessage(Exception):
    """A datagram that is not an SNMP response we can read."""


def encode_get_v2c(community: str, oid: str, request_id: int) -> bytes:
    """An SNMPv2c GetRequest for one OID."""
    pdu = _v2c.GetRequestPDU()
    _v2c.apiPDU.set_defaults(pdu)
    _v2c.apiPDU.set_request_id(pdu, request_id)
    _v2c.apiPDU.set_varbinds(pdu, [(oid, _v2c.null)])
    message = _v2c.Message()
    _v2c.apiMessage.set_defaults(message)
    _v2c.apiMessage.set_community(message, community)
    _v2c.apiMessage.set_pdu(message, pdu)
    return encoder.encode(message)


def decode_response_v2c(data: bytes) -> tuple[int, Any]:
    """(request_id, response PDU) of an SNMPv2c Response; BadMessage for anything else."""
    try:
        message, _rest = decoder.decode(data, asn1Spec=_v2c.Message())
        pdu = _v2c.apiMessage.get_pdu(message)
        if pdu.tagSet != _RESPONSE_TAGS:
            raise BadMessage(f"not a Response PDU ({pdu.__class__.__name__})")
        return int(_v2c.apiPDU.get_request_id(pdu)), pdu
    except BadMessage:
        raise
    except Exception as exc:  # anyone can send us a datagram: any decoding failure is garbage
        raise BadMessage(f"undecodable datagram ({exc.__class__.__name__})") from None


def value_of(pdu: Any, oid: str) -> PollResult:
    """The poll result a Response PDU carries for a GET of `oid`."""
    status = int(_v2c.apiPDU.get_error_status(pdu))
    if status:
        name = _v2c.apiPDU.get_error_status(pdu).prettyPrint()
        return PollResult(ERROR, detail=f"agent answered error-status {name}")
    varbinds = _v2c.apiPDU.get_varbinds(pdu)
    if len(varbinds) != 1:
        return PollResult(BAD_VALUE, detail=f"{len(varbinds)} variables in the answer")
    name, value = varbinds[0]
    if str(name) != oid:
        return PollResult(BAD_VALUE, detail=f"answer for another OID ({name})")
    return classify(value)


def _checked_value_of(pdu: Any, oid: str) -> PollResult:
    try:
        return value_of(pdu, oid)
    except Exception as exc:  # a Response that decodes but makes no sense
        return PollResult(BAD_VALUE, detail=f"unreadable answer ({exc.__class__.__name__})")


def classify(value: Any) -> PollResult:
    """ok with the integer, or bad_value saying what came instead."""
    if isinstance(value, _NO_SUCH):
        return PollResult(BAD_VALUE, detail=f"{value.__class__.__name__} (OID not served)")
    if isinstance(value, univ.Integer):  # Integer32, Gauge32, Counter32/64, TimeTicks...
        return PollResult(OK, value=int(value))
    try:
        shown = value.prettyPrint()
    except Exception:  # pragma: no cover - a pyasn1 object that cannot print itself
        shown = "?"
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return PollResult(BAD_VALUE, detail=f"not an integer: {value.__class__.__name__} {shown!r}")


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
        self.security_name = _v2c.OctetString(credentials.user)
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
        return _checked_value_of(pdu, self.oid)


class _V3Exchange(_Exchange):
    def __init__(self, engine: _V3Engine, snmp: SnmpConfig, domain: tuple, address: tuple):
        self.engine = engine
        self.oid = snmp.oid
        self.domain = domain
        self.address = address
        self.pdu = _v2c.GetRequestPDU()
        _v2c.apiPDU.set_defaults(self.pdu)
        _v2c.apiPDU.set_varbinds(self.pdu, [(snmp.oid, _v2c.null)])
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
        if _v2c.apiPDU.get_request_id(pdu) != _v2c.apiPDU.get_request_id(self.pdu):
            return PollResult(ERROR, detail="SNMPv3: answer with another request-id")
        return _checked_value_of(pdu, self.oid)

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


# --------------------------------------------------------------------------------------
# A tiny SNMPv2c agent (for `lbproxy demo` and tests; not a real agent)


def answer_get_v2c(request: bytes, community: str, values: Mapping[str, int | None]) -> bytes:
    """The Response to an SNMPv2c GetRequest, or b"" to stay silent (wrong community,
    not a GET, garbage). `values`: OID -> integer, None for noSuchInstance."""
    try:
        message, _rest = decoder.decode(request, asn1Spec=_v2c.Message())
        if str(_v2c.apiMessage.get_community(message)) != community:
            return b""
        pdu = _v2c.apiMessage.get_pdu(message)
        if pdu.tagSet != _v2c.GetRequestPDU.tagSet:
            return b""
        answer = _v2c.apiMessage.get_response(message)
        varbinds = []
        for name, _null in _v2c.apiPDU.get_varbinds(pdu):
            value = values.get(str(name))
            if str(name) not in values:
                varbinds.append((name, _v2c.NoSuchObject("")))
            elif value is None:
                varbinds.append((name, _v2c.NoSuchInstance("")))
            else:
                varbinds.append((name, _v2c.Integer(int(value))))
        _v2c.apiPDU.set_varbinds(_v2c.apiMessage.get_pdu(answer), varbinds)
        return encoder.encode(answer)
    except Exception:  # garbage in: nothing out
        return b""


async def serve_v2c_agent(
    sock: trio.socket.SocketType,
    values: Mapping[str, int | None],
    community: str = "public",
) -> None:
    """Answer SNMPv2c GETs on a bound UDP socket from `values` (read at every request,
    so the caller changes a value by changing the mapping), until cancelled."""
    while True:
        request, peer = await sock.recvfrom(MAX_DATAGRAM)
        answer = answer_get_v2c(request, community, values)
        if answer:
            await sock.sendto(answer, peer)


# --------------------------------------------------------------------------------------
# The poller of one real server


class Poller:
    """Polls one real server's agent and feeds its pool, until cancelled."""

    def __init__(self, pool: Pool, rs: RealServer, snmp: SnmpConfig) -> None:
        self.pool = pool
        self.rs = rs
        self.snmp = snmp
        self.last: PollResult | None = None
        if snmp.host is None:  # the loader fills it in; a hand-made config may not
            snmp = replace(snmp, host=rs.address.host)
        self.client = SnmpClient(snmp)
        self.state = DynamicWeight(
            snmp.on_no_answer, snmp.stale_after or 3 * snmp.interval, snmp.smoothing
        )
        self.where = f"{pool.name}/{rs.name} (snmp {snmp.host}:{snmp.port})"  # for the log
        self._logged_failure: str | None = None

    async def run(self) -> None:
        clock = trio.current_time
        # Timing: the first poll comes within min(interval, 1 s) of the start, so weights
        # are known soon after start-up or a reload (not up to a whole interval later);
        # the second one to two intervals after it (a random phase), then one every
        # interval. Many servers' polls so spread over the interval instead of arriving
        # together, and a poll slower than the interval skips a beat, never bursts.
        interval = self.snmp.interval
        await trio.sleep(random.uniform(0, min(interval, FIRST_POLL_WITHIN)))
        next_poll: float | None = None
        while True:
            started = clock()
            result = await self.client.get()
            now = clock()
            self.record(result, now - started)
            self.apply(result, now)
            if next_poll is None:
                next_poll = started + random.uniform(0, interval)
            next_poll += interval
            if next_poll <= now:  # a poll longer than the interval: skip, don't burst
                next_poll = now + interval - (now - next_poll) % interval
            while True:
                hold_until = self.state.hold_until()
                wake = next_poll if hold_until is None else min(next_poll, hold_until)
                await trio.sleep_until(wake)
                if wake >= next_poll:
                    break
                self._set(self.state.expire(clock()), clock())

    def record(self, result: PollResult, duration: float) -> None:
        """Count the poll where the metrics module reads it at scrape time."""
        self.rs.counters.snmp_polls[result.result] += 1
        self.rs.counters.snmp_last = (result.result, result.value)  # for the admin API's document
        self.pool.poll_durations.observe(duration)
        self.last = result

    def apply(self, result: PollResult, now: float) -> None:
        """Feed one poll's result through dynamic_weight.py into the pool."""
        if result.result == OK:
            assert result.value is not None
            first = self.state.answering is not True
            self._set(self.state.answered(result.value, now), now)
            if first:
                log.info(
                    "%s answers: value %d, dynamic weight %s",
                    self.where,
                    result.value,
                    _fmt(self.rs.dynamic_weight),
                )
                self._logged_failure = None
            else:
                log.debug("%s: value %d", self.where, result.value)
            return
        action = self.state.unanswered(now, self.rs.static_weight)
        message = f"{result.result}: {result.detail}"
        if message != self._logged_failure:
            self._logged_failure = message
            if action is None:
                what = (
                    f"holding weight {_fmt(self.rs.dynamic_weight)} for up to "
                    f"{self.state.stale_after:g}s"
                )
            else:
                what = (
                    f"on_no_answer {self.snmp.on_no_answer}: dynamic weight {_fmt(action.weight)}"
                )
            level = logging.ERROR if result.result == ERROR else logging.WARNING
            self._set(action, now)
            if self.pool.fallback:  # nothing else says so when no agent ever answered
                what += f"; {self.pool.name} is on static weights (every dynamic weight is 0)"
            log.log(level, "%s: no usable answer (%s); %s", self.where, message, what)
            return
        self._set(action, now)

    def _set(self, action: Report | SetWeight | None, now: float) -> None:
        if action is None:
            return
        if isinstance(action, Report):
            self.pool.report_value(self.rs, action.value, now)
        else:
            if action.reason == "hold expired":
                log.warning(
                    "%s: held value is older than stale_after (%gs); dynamic weight 0",
                    self.where,
                    self.state.stale_after,
                )
            self.pool.set_dynamic_weight(self.rs, action.weight, now)


def _fmt(weight: float | None) -> str:
    if weight is None:
        return "none"
    return str(int(weight)) if math.isfinite(weight) and weight == int(weight) else f"{weight:g}"


# --------------------------------------------------------------------------------------
# All pollers of the running Server


class SnmpPollers(Reconciler[tuple[str, str], tuple[Pool, RealServer, SnmpConfig]]):
    """The SNMP pollers of a Server, kept in step with its virtual servers.

    Poll counts go where the metrics module reads them: `RealServer.counters.snmp_polls[result]`
    and the per-virtual-server histogram `Pool.poll_durations`.
    """

    def wanted(
        self, virtual_servers: Iterable[Configured]
    ) -> dict[tuple[str, str], tuple[Pool, RealServer, SnmpConfig]]:
        wanted = {}
        for vs in virtual_servers:
            pool = vs.pool
            if not pool.polls_snmp:
                continue
            for rs in pool.servers:
                if rs.config.snmp is not None:
                    wanted[(pool.name, rs.name)] = (pool, rs, rs.config.snmp)
        return wanted

    def start(
        self, key: tuple[str, str], spec: tuple[Pool, RealServer, SnmpConfig]
    ) -> Callable[[], Awaitable[None]]:
        return functools.partial(self._run_one, Poller(*spec))

    @staticmethod
    async def _run_one(poller: Poller) -> None:
        # A poller that fails unexpectedly must not take the proxy down with it (its
        # exception would cancel the service nursery): log it and start it again.
        while True:
            try:
                await poller.run()
            except Exception as exc:  # restarted after an interval
                record("poll", exc, poller.where)
                await trio.sleep(poller.snmp.interval)

    @property
    def polled(self) -> list[tuple[str, str]]:
        return sorted(self._tasks)
