"""The protocol checks' parsers (lbproxy/wire/health) against hostile servers: garbage,
half answers, answers cut anywhere, and more than the bound. Nothing a server sends
raises, a verdict's reason names the check, and what an exchange keeps never exceeds
what it was fed; through the runner (`converse`), never more than ANSWER_LIMIT is read.
"""

from __future__ import annotations

import struct

import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from lbproxy.control.checks import ANSWER_LIMIT, converse
from lbproxy.wire.health.exchange import Exchange, Verdict
from lbproxy.wire.health.mysql import MysqlExchange
from lbproxy.wire.health.pgsql import PgsqlExchange
from lbproxy.wire.health.redis import RedisExchange
from lbproxy.wire.health.smtp import SmtpExchange


def _exchanges() -> list[Exchange]:
    return [
        PgsqlExchange("lbproxy", "lbproxy"),
        MysqlExchange(None),
        MysqlExchange("lbproxy"),
        RedisExchange(None, None),
        RedisExchange("pw", "master"),
        SmtpExchange("lb.example"),
    ]


def _feed(exchange: Exchange, chunks: list[bytes]) -> Verdict | None:
    """Feed chunks until a verdict; None: still waiting. Checks the invariants."""
    fed = 0
    exchange.opening()
    for chunk in chunks:
        if not chunk:
            continue
        fed += len(chunk)
        step = exchange.received(chunk)
        assert isinstance(step.send, bytes)
        kept = len(getattr(exchange, "buffer", b""))
        assert kept <= fed
        if step.verdict is not None:
            if not step.verdict.ok:
                assert step.verdict.reason.startswith(f"{exchange.name}: ")
                assert step.verdict.reason.isprintable()
            return step.verdict
    return None


_prefixes = st.sampled_from(
    [b"", b"R", b"E", b"N", b"Z", b"\x0a", b"\xff", b"+", b"-", b"$", b"*", b"220", b"220-"]
)
_garbage = st.builds(lambda p, rest: p + rest, _prefixes, st.binary(max_size=300))
_chunked = st.lists(_garbage | st.binary(max_size=40), max_size=8)


@given(_chunked)
def test_garbage_never_raises(chunks):
    for exchange in _exchanges():
        verdict = _feed(exchange, chunks)
        if verdict is None:
            closed = exchange.closed()
            assert not closed.ok and closed.reason.startswith(f"{exchange.name}: ")


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[last:point])
        last = point
    return pieces


def _pg(kind: bytes, body: bytes) -> bytes:
    return kind + struct.pack("!I", len(body) + 4) + body


PG_TRUST = (
    _pg(b"R", b"\0\0\0\0")
    + _pg(b"S", b"server_version\x0015.1\x00")
    + _pg(b"K", b"\0\0\0\1\0\0\0\2")
    + _pg(b"Z", b"I")
)
PG_ERROR = _pg(b"E", b"SFATAL\x00VFATAL\x00C57P03\x00Mthe database system is starting up\x00\x00")
MYSQL_GREETING = (
    b"\x0a"
    + b"10.11.6-MariaDB\x00"
    + b"\x01\0\0\0"
    + b"abcdefgh"
    + b"\0"
    + b"\xff\xf7"
    + b"\0" * 20
)
MYSQL_PACKET = struct.pack("<I", len(MYSQL_GREETING))[:3] + b"\0" + MYSQL_GREETING


@given(st.lists(st.integers(0, 10_000), max_size=6))
def test_answers_cut_anywhere_give_the_same_verdict(cuts):
    cases = [
        (PgsqlExchange("u", "d"), PG_TRUST, Verdict(True)),
        (
            PgsqlExchange("u", "d"),
            PG_ERROR,
            Verdict(False, "pgsql: FATAL: the database system is starting up"),
        ),
        (MysqlExchange(None), MYSQL_PACKET, Verdict(True)),
        (RedisExchange(None, None), b"+PONG\r\n", Verdict(True)),
        (
            RedisExchange(None, "master"),
            b"+PONG\r\n$27\r\n# Replication\r\nrole:slave\r\n\r\n",
            Verdict(False, "redis: role:slave, want master"),
        ),
    ]
    for exchange, answer, expected in cases:
        pieces = _split(answer, cuts)
        assert _feed(exchange, pieces) == expected
        # every strict prefix leaves it waiting, and a close then fails it
        for end in {c % len(answer) for c in cuts}:
            fresh = type(exchange).__new__(type(exchange))
            fresh.__init__(*_args(exchange))
            assert _feed(fresh, [answer[:end]]) is None
            assert not fresh.closed().ok


def _args(exchange: Exchange) -> tuple:
    if isinstance(exchange, PgsqlExchange):
        return (exchange.user, exchange.database)
    if isinstance(exchange, MysqlExchange):
        return (exchange.user,)
    if isinstance(exchange, RedisExchange):
        return (None, exchange.role)
    raise AssertionError(exchange)


async def _through_the_runner(exchange: Exchange, answer: bytes) -> tuple[str, str]:
    client, server = trio.testing.memory_stream_pair()
    await server.send_all(answer)
    await server.aclose()
    return await converse(client, exchange, deadline=trio.current_time() + 5, timeout=5)


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(range(6)), st.binary(min_size=1, max_size=64), st.integers(0, 40_000))
def test_the_runner_reads_at_most_the_bound(which, head, size):
    exchange = _exchanges()[which]
    answer = head + b"x" * size
    result, reason = trio.run(_through_the_runner, exchange, answer)
    assert result in ("ok", "fail")
    assert reason == "" or reason.startswith(f"{exchange.name}: ")
    assert len(getattr(exchange, "buffer", b"")) <= ANSWER_LIMIT
    if len(answer) > ANSWER_LIMIT and result == "fail" and "longer" in reason:
        assert reason == f"{exchange.name}: answer longer than {ANSWER_LIMIT} bytes"


def _converse(exchange: Exchange, answers: list[bytes], cuts: list[int]) -> tuple[list, Verdict]:
    """Each answer (one per turn), cut into pieces; what the exchange sent each turn and
    its verdict. No verdict before the last piece of the last answer."""
    sent = [exchange.opening()]
    for turn, answer in enumerate(answers):
        pieces = [p for p in _split(answer, cuts) if p]
        for i, piece in enumerate(pieces):
            step = exchange.received(piece)
            last = i == len(pieces) - 1
            if not last:
                assert step.send == b"" and step.verdict is None
        sent.append(step.send)
        if turn < len(answers) - 1:
            assert step.verdict is None
    assert step.verdict is not None
    return sent, step.verdict


@given(st.lists(st.integers(0, 10_000), max_size=6))
def test_conversations_cut_anywhere(cuts):
    greeting = b"220-mail.example ESMTP\r\n220 ready\r\n"
    ehlo_ok = b"250-mail.example\r\n250-SIZE 1000\r\n250 HELP\r\n"
    sent, verdict = _converse(SmtpExchange("lb.example"), [greeting, ehlo_ok], cuts)
    assert sent == [b"", b"EHLO lb.example\r\n", b"QUIT\r\n"] and verdict.ok
    busy = b"421 4.3.2 too busy\r\n"
    sent, verdict = _converse(SmtpExchange("lb.example"), [greeting, busy], cuts)
    assert verdict == Verdict(False, "smtp: EHLO answered 421 4.3.2 too busy")

    ok_packet = b"\x07\0\0\x02" + b"\x00\x00\x00\x02\x00\x00\x00"
    sent, verdict = _converse(MysqlExchange("lbproxy"), [MYSQL_PACKET, ok_packet], cuts)
    response = sent[1]  # HandshakeResponse41, sequence 1, the user without a password
    assert int.from_bytes(response[:3], "little") == len(response) - 4 and response[3] == 1
    assert b"\0" * 23 + b"lbproxy\x00\x00mysql_native_password\x00" in response
    assert sent[2] == b"\x01\x00\x00\x00\x01" and verdict.ok  # COM_QUIT
    payload = b"\xff\x15\x04#28000Access denied for user 'lbproxy'@'10.0.0.1' (using password: NO)"
    err = struct.pack("<I", len(payload))[:3] + b"\x02" + payload
    _, verdict = _converse(MysqlExchange("lbproxy"), [MYSQL_PACKET, err], cuts)
    assert verdict == Verdict(
        False, "mysql: ERR 1045: Access denied for user 'lbproxy'@'10.0.0.1' (using password: NO)"
    )
