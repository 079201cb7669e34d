"""Fuzz the agent-check line reader and parser (lbproxy/wire/agent.py): any bytes, in any
segments, give a line, a BadAnswer or "more", never an exception; a line is never longer
than 512 bytes; a good answer's values are in range; and a well-formed line, however its
words are cased, ordered and separated, parses to what it says."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lbproxy.wire.agent import LINE_LIMIT, MAX_PERCENT, AgentAnswer, BadAnswer, line_of, parse

WORDS = ["ready", "drain", "maint", "up", "down", "fail", "stopped"]


@given(st.lists(st.binary(max_size=700), max_size=6), st.booleans())
def test_any_bytes_in_any_segments(chunks, closed):
    received = b""
    result = None
    for chunk in chunks:
        received += chunk
        result = line_of(received[: LINE_LIMIT + 2], closed=False)
        if result is not None:
            break
    if result is None and closed:
        result = line_of(received[: LINE_LIMIT + 2], closed=True)
    if isinstance(result, bytes):
        assert len(result) <= LINE_LIMIT
        assert b"\n" not in result
        answer = parse(result)
        assert isinstance(answer, AgentAnswer | BadAnswer)
        if isinstance(answer, AgentAnswer):
            assert answer.weight_percent is None or 0 <= answer.weight_percent <= MAX_PERCENT
            assert answer.max_connections is None or answer.max_connections >= 0
            assert answer.admin in (None, "ready", "drain", "maint")
            assert answer.health in (None, "up", "down", "fail", "stopped")
            assert all(ord(c) >= 0x20 and ord(c) != 0x7F for c in answer.reason)
    else:
        assert result is None or isinstance(result, BadAnswer)


@given(st.binary(max_size=2000))
def test_parse_never_raises(data):
    assert isinstance(parse(data), AgentAnswer | BadAnswer)


@given(
    st.integers(0, MAX_PERCENT),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["ready", "drain", "maint"]),
    st.permutations([0, 1, 2]),
    st.lists(st.sampled_from([" ", ",", "\t", " , "]), min_size=2, max_size=2),
    st.booleans(),
    st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=50),
)
def test_well_formed_lines_parse_to_what_they_say(
    percent, maxconn, admin, order, separators, upper, reason
):
    words = [f"{percent}%", f"maxconn:{maxconn}", admin]
    words = [words[i].upper() if upper else words[i] for i in order]
    line = words[0] + separators[0] + words[1] + separators[1] + words[2]
    if reason:
        line += " #" + reason
    answer = parse(line.encode())
    assert answer == AgentAnswer(percent, maxconn, admin, None, reason.strip())


@given(st.integers(MAX_PERCENT + 1, 10**9))
def test_a_weight_above_256_percent_is_a_bad_answer(percent):
    assert isinstance(parse(f"ready {percent}%".encode()), BadAnswer)
