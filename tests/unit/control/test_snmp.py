"""The SNMP client (control/snmp_client.py, wire/snmp.py) against a tiny in-process agent,
and the poller (control/snmp.py) against a pool.

The agent here is built on the same pysnmp messages as the client (as the issue allows
for fast tests); the real net-snmp agent is in tests/integration/test_snmp.py.
"""

from __future__ import annotations

import logging
import socket

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from pyasn1.codec.ber import decoder, encoder

from lbproxy.config.model import SnmpConfig
from lbproxy.control import snmp, snmp_client
from lbproxy.core.pool import Pool
from lbproxy.tools import snmp_agent
from lbproxy.wire import snmp as wire_snmp
from tests.factories import virtual_server

OID = "1.3.6.1.4.1.8072.9999.1.0"
v2c = wire_snmp.v2c


def response(request: bytes, value=None, *, error_status: int = 0, request_id=None) -> bytes:
    message, _ = decoder.decode(request, asn1Spec=v2c.Message())
    answer = v2c.apiMessage.get_response(message)
    pdu = v2c.apiMessage.get_pdu(answer)
    if request_id is not None:
        v2c.apiPDU.set_request_id(pdu, request_id)
    if error_status:
        v2c.apiPDU.set_error_status(pdu, error_status)
        v2c.apiPDU.set_error_index(pdu, 1)
    v2c.apiPDU.set_varbinds(pdu, [(OID, v2c.Integer(0) if value is None else value)])
    return encoder.encode(answer)


class Agent:
    """A UDP agent on 127.0.0.1: `behave(n, request)` -> datagrams to send back."""

    def __init__(self, behave) -> None:
        self.behave = behave
        self.requests: list[bytes] = []
        self.sock = trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM)

    async def bind(self) -> int:
        await self.sock.bind(("127.0.0.1", 0))
        return self.sock.getsockname()[1]

    async def serve(self) -> None:
        while True:
            data, peer = await self.sock.recvfrom(65535)
            self.requests.append(data)
            for reply in self.behave(len(self.requests), data):
                await self.sock.sendto(reply, peer)


def get(behave, *, timeout=0.2, retries=1, port=None, extra=None):
    """Run one client GET against an Agent with `behave`; (result, agent)."""

    async def main():
        agent = Agent(behave)
        agent_port = await agent.bind()
        config = SnmpConfig(
            oid=OID, host="127.0.0.1", port=port or agent_port, timeout=timeout, retries=retries
        )
        with agent.sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agent.serve)
                result = await snmp_client.SnmpClient(config).get()
                if extra is not None:
                    await extra(agent)
                nursery.cancel_scope.cancel()
        return result, agent

    return trio.run(main)


# -- messages ---------------------------------------------------------------------


def test_encode_and_decode_round_trip():
    request = wire_snmp.encode_get_v2c("public", OID, 12345)
    request_id, pdu = wire_snmp.decode_response_v2c(response(request, v2c.Integer(7)))
    assert request_id == 12345
    assert wire_snmp.value_of(pdu, OID) == wire_snmp.PollResult("ok", 7)


@pytest.mark.parametrize(
    ("value", "result"),
    [
        (v2c.Integer(-3), "ok"),
        (v2c.Gauge32(42), "ok"),
        (v2c.Counter64(2**40), "ok"),
        (v2c.OctetString("busy"), "bad_value"),
        (v2c.NoSuchObject(""), "bad_value"),
        (v2c.NoSuchInstance(""), "bad_value"),
        (v2c.EndOfMibView(""), "bad_value"),
        (v2c.IpAddress("10.0.0.1"), "bad_value"),
    ],
)
def test_only_integers_are_values(value, result):
    assert wire_snmp.classify(value).result == result


@pytest.mark.parametrize(
    "data",
    [b"", b"garbage", b"\x30\x03\x02\x01", wire_snmp.encode_get_v2c("public", OID, 1)],
)
def test_garbage_and_requests_are_not_responses(data):
    with pytest.raises(wire_snmp.BadMessage):
        wire_snmp.decode_response_v2c(data)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_datagram_decodes_or_is_bad_message(data):
    good = response(wire_snmp.encode_get_v2c("public", OID, 77), v2c.Integer(5))
    if data.draw(st.booleans()):
        datagram = data.draw(st.binary(max_size=80))
    else:  # a valid answer with some bytes changed, cut or added
        datagram = bytearray(good)
        for _ in range(data.draw(st.integers(1, 4))):
            datagram[data.draw(st.integers(0, len(datagram) - 1))] = data.draw(st.integers(0, 255))
        datagram = bytes(datagram[: data.draw(st.integers(0, len(datagram)))])
    try:
        _request_id, pdu = wire_snmp.decode_response_v2c(datagram)
    except wire_snmp.BadMessage:
        return
    assert wire_snmp.value_of(pdu, OID).result in wire_snmp.RESULTS


# -- the client over UDP ----------------------------------------------------------


def test_ok():
    result, agent = get(lambda n, req: [response(req, v2c.Integer(7))])
    assert result == wire_snmp.PollResult("ok", 7)
    assert len(agent.requests) == 1


def test_a_string_is_a_bad_value():
    result, _ = get(lambda n, req: [response(req, v2c.OctetString("busy"))])
    assert result.result == "bad_value"
    assert "OctetString 'busy'" in result.detail


def test_no_such_instance_is_a_bad_value():
    result, _ = get(lambda n, req: [response(req, v2c.NoSuchInstance(""))])
    assert result.result == "bad_value"


def test_an_error_status_is_an_error():
    result, _ = get(lambda n, req: [response(req, error_status=5)])  # genErr
    assert result.result == "error"
    assert "genErr" in result.detail


def test_the_retransmission_is_answered():
    result, agent = get(lambda n, req: [] if n == 1 else [response(req, v2c.Integer(4))])
    assert result == wire_snmp.PollResult("ok", 4)
    assert len(agent.requests) == 2
    assert agent.requests[0] == agent.requests[1]  # the same request-id both times


def test_timeout_after_every_retry():
    async def later(agent):
        await trio.sleep(0.2)  # nothing is sent once the poll is over

    result, agent = get(lambda n, req: [], timeout=0.05, retries=2, extra=later)
    assert result.result == "timeout"
    assert len(agent.requests) == 3


def test_garbage_and_other_request_ids_are_ignored_while_waiting():
    def behave(n, req):
        return [
            b"garbage",
            response(req, v2c.Integer(1), request_id=1),
            response(req, v2c.Integer(9)),
        ]

    result, _ = get(lambda n, req: behave(n, req) if n == 1 else [])
    assert result == wire_snmp.PollResult("ok", 9)


def test_only_garbage_is_a_bad_value():
    result, agent = get(lambda n, req: [b"\x30\x03\x02\x01"], timeout=0.05)
    assert result.result == "bad_value"
    assert len(agent.requests) == 2  # garbage is no answer: it was retransmitted


def test_another_request_id_only_is_a_timeout():
    result, _ = get(lambda n, req: [response(req, v2c.Integer(1), request_id=1)], timeout=0.05)
    assert result.result == "timeout"


def test_port_unreachable_is_an_error():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    result, agent = get(lambda n, req: [], timeout=0.05, port=closed_port)
    assert result.result == "error"
    assert "port unreachable" in result.detail
    assert agent.requests == []


def test_a_cancelled_poll_sends_nothing_more():
    async def main():
        agent = Agent(lambda n, req: [])
        port = await agent.bind()
        config = SnmpConfig(oid=OID, host="127.0.0.1", port=port, timeout=0.2, retries=5)
        with agent.sock:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(agent.serve)
                # Cancelled once the agent has the first request (not after a fixed time,
                # which a loaded machine may not reach the first send in).
                with trio.fail_after(10):
                    async with trio.open_nursery() as poll:
                        poll.start_soon(snmp_client.SnmpClient(config).get)
                        while not agent.requests:
                            await trio.sleep(0.001)
                        poll.cancel_scope.cancel()
                sent = len(agent.requests)
                await trio.sleep(1.2)  # five retransmissions would have gone by now
                nursery.cancel_scope.cancel()
        return sent, len(agent.requests)

    sent, later = trio.run(main)
    assert sent == later == 1


def test_v3_with_an_unreadable_key_file_is_an_error(tmp_path):
    config = SnmpConfig(
        oid=OID, version="3", user="u", auth_key_file=str(tmp_path / "missing"), host="127.0.0.1"
    )
    result = trio.run(snmp_client.SnmpClient(config).get)
    assert result.result == "error"
    assert "SNMPv3 credentials" in result.detail


def test_v3_with_a_short_passphrase_is_an_error(tmp_path):
    (tmp_path / "k").write_text("short\n")
    config = SnmpConfig(
        oid=OID, version="3", user="u", auth_key_file=str(tmp_path / "k"), host="127.0.0.1"
    )
    result = trio.run(snmp_client.SnmpClient(config).get)
    assert "at least 8 characters" in result.detail


# -- the poller feeding a pool ----------------------------------------------------


def dwd_pool(policy="zero", **snmp_options):
    block = SnmpConfig(oid=OID, on_no_answer=policy, interval=5, stale_after=15, **snmp_options)
    config = virtual_server(
        "dwd", {"a": {"snmp": block, "weight": 3}, "b": {"snmp": block}}, snmp=block
    )
    return Pool(config, 0)


class FakeClient:
    def __init__(self, results):
        self.results = list(results)
        self.calls = 0

    async def get(self):
        self.calls += 1
        return self.results.pop(0) if self.results else wire_snmp.PollResult("timeout")


def poller(pool, name, results):
    rs = pool.by_name[name]
    p = snmp.Poller(pool, rs, rs.config.snmp)
    p.client = FakeClient(results)
    return p


OK7 = wire_snmp.PollResult("ok", 7)
LOST = wire_snmp.PollResult("timeout", detail="no answer to 2 transmission(s)")


def test_answers_become_weights_and_silence_follows_zero(caplog):
    pool = dwd_pool("zero")
    a = pool.by_name["a"]
    p = poller(pool, "a", [])
    with caplog.at_level(logging.INFO, "lbproxy"):
        p.apply(OK7, 1.0)
        assert (a.dynamic_weight, a.effective_weight, pool.fallback) == (7, 7, False)
        p.apply(LOST, 6.0)
    assert a.dynamic_weight == 0
    assert pool.fallback  # b never answered either: static weights
    assert "vs/a (snmp 127.0.0.1:161) answers: value 7, dynamic weight 7" in caplog.text
    assert "no usable answer (timeout: no answer to 2 transmission(s))" in caplog.text
    assert "vs is on static weights" in caplog.text


def test_static_policy_uses_the_configured_weight():
    pool = dwd_pool("static")
    a = pool.by_name["a"]
    assert a.dynamic_weight == 3  # before any answer, too
    p = poller(pool, "a", [])
    p.apply(OK7, 1.0)
    p.apply(LOST, 6.0)
    assert a.dynamic_weight == 3


def test_hold_then_expiry_through_the_poll_loop(caplog):
    pool = dwd_pool("hold")
    a = pool.by_name["a"]
    p = poller(pool, "a", [OK7])  # then timeouts

    async def main():
        with trio.move_on_after(12.0):  # polls at ~0-1 s, then every 5 s
            await p.run()
        during = a.dynamic_weight
        with trio.move_on_after(20.0):  # the held value is 15 s old by now
            await p.run()
        return during

    with caplog.at_level(logging.INFO, "lbproxy"):
        during = trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    assert during == 7
    assert a.dynamic_weight == 0
    assert caplog.text.count("holding weight 7 for up to 15s") == 1
    assert caplog.text.count("held value is older than stale_after (15s)") == 1


def test_polls_are_counted_for_the_metrics():
    pool = dwd_pool()
    p = poller(pool, "a", [OK7, wire_snmp.PollResult("bad_value", detail="x")])

    async def main():
        with trio.move_on_after(25):  # 0-1 s, then within 5 s, then every 5 s
            await p.run()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    a = pool.by_name["a"]
    assert a.counters.snmp_polls["ok"] == 1
    assert a.counters.snmp_polls["bad_value"] == 1
    assert a.counters.snmp_polls["timeout"] >= 1
    assert pool.poll_durations.count == sum(a.counters.snmp_polls.values())


def test_least_load_with_snmp_zero_gates_the_server():
    block = SnmpConfig(oid=OID, max_value=100)
    config = virtual_server(
        "least-load",
        {"a": {"snmp": block, "max_connections": 10}, "b": {"snmp": block, "max_connections": 10}},
        load_source="snmp",
        snmp=block,
    )
    pool = Pool(config, 0)
    pa, pb = poller(pool, "a", []), poller(pool, "b", [])
    pa.apply(wire_snmp.PollResult("ok", 50), 1)
    pb.apply(wire_snmp.PollResult("ok", 10), 1)
    assert pool.pick(1).name == "b"
    pb.apply(LOST, 6)  # zero: b takes nothing new
    assert {pool.pick(6).name for _ in range(3)} == {"a"}


def test_sync_starts_stops_and_restarts_pollers(monkeypatch):
    started = []

    async def fake_run(self):
        started.append((self.pool.name, self.rs.name, self.snmp.port))
        await trio.sleep_forever()

    monkeypatch.setattr(snmp.Poller, "run", fake_run)

    class VS:
        def __init__(self, pool):
            self.pool = pool

    async def main():
        pollers = snmp.SnmpPollers()
        pool = dwd_pool()
        wlc = Pool(virtual_server("wlc", {"x": {}}), 0)
        async with trio.open_nursery() as nursery:
            pollers.sync([VS(pool), VS(wlc)], nursery)
            await trio.sleep(0.01)
            assert pollers.polled == [("vs", "a"), ("vs", "b")]
            new = dwd_pool().config
            changed = new.real_servers[1].__class__(
                **{
                    **{f: getattr(new.real_servers[1], f) for f in ("name", "address")},
                    "snmp": SnmpConfig(oid=OID, port=1161),
                }
            )
            pool.reconfigure(new.__class__(**{**_fields(new), "real_servers": (changed,)}), 1)
            pollers.sync([VS(pool)], nursery)
            await trio.sleep(0.01)
            assert pollers.polled == [("vs", "b")]
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert started[2:] == [("vs", "b", 1161)]  # restarted with its new snmp block
    assert sorted(started[:2]) == [("vs", "a", 161), ("vs", "b", 161)]


def _fields(config):
    return {name: getattr(config, name) for name in config.__dataclass_fields__}


def test_the_demo_agent_answers_the_poller_and_follows_its_mapping():
    async def main():
        values = {OID: 7}
        results = []
        with trio.socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            await sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(snmp_agent.serve_v2c_agent, sock, values)
                for community, oid in [("public", OID), ("secret", OID), ("public", "1.3.6.1")]:
                    config = SnmpConfig(
                        oid=oid, host="127.0.0.1", port=port, community=community, timeout=0.05
                    )
                    results.append((await snmp_client.SnmpClient(config).get()).result)
                values[OID] = None
                config = SnmpConfig(oid=OID, host="127.0.0.1", port=port)
                results.append((await snmp_client.SnmpClient(config).get()).result)
                values[OID] = 3
                results.append(await snmp_client.SnmpClient(config).get())
                nursery.cancel_scope.cancel()
        return results

    assert trio.run(main) == [
        "ok",
        "timeout",
        "bad_value",
        "bad_value",
        wire_snmp.PollResult("ok", 3),
    ]
