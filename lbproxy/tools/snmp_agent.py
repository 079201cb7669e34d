"""A tiny SNMPv2c agent on wire/snmp.py's messages, for `lbproxy demo` and the unit
tests; not a real agent."""

from __future__ import annotations

from collections.abc import Mapping

import trio
from pyasn1.codec.ber import decoder, encoder

from lbproxy.wire.snmp import MAX_DATAGRAM, v2c


def answer_get_v2c(request: bytes, community: str, values: Mapping[str, int | None]) -> bytes:
    """The Response to an SNMPv2c GetRequest, or b"" to stay silent (wrong community,
    not a GET, garbage). `values`: OID -> integer, None for noSuchInstance."""
    try:
        message, _rest = decoder.decode(request, asn1Spec=v2c.Message())
        if str(v2c.apiMessage.get_community(message)) != community:
            return b""
        pdu = v2c.apiMessage.get_pdu(message)
        if pdu.tagSet != v2c.GetRequestPDU.tagSet:
            return b""
        answer = v2c.apiMessage.get_response(message)
        varbinds = []
        for name, _null in v2c.apiPDU.get_varbinds(pdu):
            value = values.get(str(name))
            if str(name) not in values:
                varbinds.append((name, v2c.NoSuchObject("")))
            elif value is None:
                varbinds.append((name, v2c.NoSuchInstance("")))
            else:
                varbinds.append((name, v2c.Integer(int(value))))
        v2c.apiPDU.set_varbinds(v2c.apiMessage.get_pdu(answer), varbinds)
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
