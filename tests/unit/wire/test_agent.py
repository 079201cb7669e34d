"""The agent-check line parser (lbproxy/wire/agent.py) against the answers HAProxy's
documentation of `agent-check` gives, and agents in the wild send."""

from __future__ import annotations

import pytest

from lbproxy.wire.agent import LINE_LIMIT, AgentAnswer, BadAnswer, describe, line_of, parse


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        # HAProxy's documentation, word by word
        (b"75%", AgentAnswer(weight_percent=75)),
        (b"maxconn:30", AgentAnswer(max_connections=30)),
        (b"ready", AgentAnswer(admin="ready")),
        (b"drain", AgentAnswer(admin="drain")),
        (b"maint", AgentAnswer(admin="maint")),
        (b"up", AgentAnswer(admin="ready", health="up")),
        (b"down", AgentAnswer(health="down")),
        (b"fail", AgentAnswer(health="fail")),
        (b"stopped", AgentAnswer(health="stopped")),
        # "optionally followed by a description string after a sharp ('#')"
        (b"down#missing process", AgentAnswer(health="down", reason="missing process")),
        (b"stopped # intentionally", AgentAnswer(health="stopped", reason="intentionally")),
        # "a series of words delimited by spaces, tabs or commas in any order"
        (b"75%, maxconn:30 ,drain", AgentAnswer(75, 30, "drain")),
        (b"drain\t75%", AgentAnswer(75, None, "drain")),
        (b"maxconn:0", AgentAnswer(max_connections=0)),  # 0: unlimited
        (b"0%", AgentAnswer(weight_percent=0)),
        (b"256%", AgentAnswer(weight_percent=256)),
        # case-insensitive, as agents in the wild answer ("UP 99%", "DRAIN 99%")
        (b"UP 99%", AgentAnswer(99, None, "ready", "up")),
        (b"DRAIN 99%", AgentAnswer(99, None, "drain")),
        (b"READY 100%", AgentAnswer(100, None, "ready")),
        # the last word of a kind counts
        (b"drain ready", AgentAnswer(admin="ready")),
        (b"down up", AgentAnswer(admin="ready", health="up")),
        (b"up down # oops", AgentAnswer(admin="ready", health="down", reason="oops")),
        # control characters never reach a log line or the API
        (b"drain # a\x1b[31mred\x00", AgentAnswer(admin="drain", reason="a [31mred")),
    ],
)
def test_documented_answers(line, expected):
    assert parse(line) == expected


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b"9999%", "weight 9999% above 256%"),
        (b"257%", "weight 257% above 256%"),
        (b"ready 100", "unknown word '100'"),  # a weight needs its %
        (b"bananas", "unknown word 'bananas'"),
        (b"50% bananas", "unknown word 'bananas'"),
        (b"-5%", "unknown word '-5%'"),
        (b"maxconn:", "unknown word 'maxconn:'"),
        (b"maxconn:-1", "unknown word 'maxconn:-1'"),
        (b"maxconn:99999999999", "unknown word 'maxconn:99999999999'"),
        (b"", "no word"),
        (b"  , # only a reason", "no word"),
        (b"\xff\xfe", "a word that is not ASCII"),
        (b"x" * (LINE_LIMIT + 1), f"a line longer than {LINE_LIMIT} bytes"),
    ],
)
def test_bad_answers_change_nothing(line, why):
    assert parse(line) == BadAnswer(why)


def test_a_line_ends_at_lf_or_close_and_is_bounded():
    assert line_of(b"50%", closed=False) is None  # more may come
    assert line_of(b"50%\r\nrest", closed=False) == b"50%"
    assert line_of(b"50%", closed=True) == b"50%"
    assert line_of(b"50%\r", closed=True) == b"50%"
    assert line_of(b"", closed=True) == b""  # the caller counts it `fail`
    full = b"a" * LINE_LIMIT
    assert line_of(full + b"\r\n", closed=False) == full
    assert line_of(full + b"\r", closed=False) is None  # the LF may still come
    assert line_of(full + b"b", closed=False) is None
    too_long = BadAnswer(f"a line longer than {LINE_LIMIT} bytes")
    assert line_of(full + b"bc", closed=False) == too_long
    assert line_of(full + b"b\n", closed=False) == too_long
    assert line_of(full + b"b", closed=True) == too_long


def test_describe_gives_back_an_equivalent_line():
    for line in (b"75%, maxconn:30 ,drain # deploy", b"up drain", b"ready down", b"maint"):
        answer = parse(line)
        assert isinstance(answer, AgentAnswer)
        assert parse(describe(answer).encode()) == answer
