"""SNMPv2c messages without I/O: a GetRequest encoded, a Response decoded and read.

pysnmp's packet-level API (`pysnmp.proto.api`, v2c module) builds a GetRequest and
parses the Response. pysnmp is called here, in control/snmp_client.py (SNMPv3 through
its engine) and in tools/snmp_agent.py (the demo's agent): pysnmp 7.0 renamed its
packet-level API without aliases, and these three modules are where to follow the next
rename.

Results, as counted in `lbproxy_snmp_polls_total{result}`:
  ok         an integer value (INTEGER, Gauge32, Counter32/64, Unsigned32, TimeTicks)
  bad_value  an answer that is not an integer (OctetString, noSuchObject, noSuchInstance,
             endOfMibView), or only undecodable datagrams came back
  timeout    no answer to any transmission
  error      an SNMP error status, a v3 security error (wrong digest, unknown user,
             unsupported security level, decryption error), ICMP port unreachable, a
             socket error, or a key file that cannot be read
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyasn1.codec.ber import decoder, encoder
from pyasn1.type import univ
from pysnmp.proto import api

OK, TIMEOUT, ERROR, BAD_VALUE = "ok", "timeout", "error", "bad_value"
RESULTS = (OK, TIMEOUT, ERROR, BAD_VALUE)

MAX_DATAGRAM = 65535

# pysnmp's SNMPv2c protocol module: its messages, PDUs and value types
v2c = api.PROTOCOL_MODULES[api.SNMP_VERSION_2C]
_RESPONSE_TAGS = v2c.ResponsePDU.tagSet
_NO_SUCH = (v2c.NoSuchObject, v2c.NoSuchInstance, v2c.EndOfMibView)


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
    pdu = v2c.GetRequestPDU()
    v2c.apiPDU.set_defaults(pdu)
    v2c.apiPDU.set_request_id(pdu, request_id)
    v2c.apiPDU.set_varbinds(pdu, [(oid, v2c.null)])
    message = v2c.Message()
    v2c.apiMessage.set_defaults(message)
    v2c.apiMessage.set_community(message, community)
    v2c.apiMessage.set_pdu(message, pdu)
    encoded: bytes = encoder.encode(message)  # pyasn1 is untyped (Any); wire/ is strict
    return encoded


def decode_response_v2c(data: bytes) -> tuple[int, Any]:
    """(request_id, response PDU) of an SNMPv2c Response; BadMessage for anything else."""
    try:
        message, _rest = decoder.decode(data, asn1Spec=v2c.Message())
        pdu = v2c.apiMessage.get_pdu(message)
        if pdu.tagSet != _RESPONSE_TAGS:
            raise BadMessage(f"not a Response PDU ({pdu.__class__.__name__})")
        return int(v2c.apiPDU.get_request_id(pdu)), pdu
    except BadMessage:
        raise
    except Exception as exc:  # anyone can send us a datagram: any decoding failure is garbage
        raise BadMessage(f"undecodable datagram ({exc.__class__.__name__})") from None


def value_of(pdu: Any, oid: str) -> PollResult:
    """The poll result a Response PDU carries for a GET of `oid`."""
    status = int(v2c.apiPDU.get_error_status(pdu))
    if status:
        name = v2c.apiPDU.get_error_status(pdu).prettyPrint()
        return PollResult(ERROR, detail=f"agent answered error-status {name}")
    varbinds = v2c.apiPDU.get_varbinds(pdu)
    if len(varbinds) != 1:
        return PollResult(BAD_VALUE, detail=f"{len(varbinds)} variables in the answer")
    name, value = varbinds[0]
    if str(name) != oid:
        return PollResult(BAD_VALUE, detail=f"answer for another OID ({name})")
    return classify(value)


def checked_value_of(pdu: Any, oid: str) -> PollResult:
    """`value_of`, with bad_value for a Response that decodes but cannot be read."""
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
