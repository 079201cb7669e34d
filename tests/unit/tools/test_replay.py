"""`lbproxy simulate --replay` (SPEC §25): the two log parsers, and the replay's
arithmetic (shares, peaks, moved clients, gates) on small hand-made logs."""

from __future__ import annotations

import dataclasses
import gzip
import json

import pytest

from lbproxy.config.model import Config
from lbproxy.tools.replay import (
    compare,
    gates,
    open_log,
    read_log,
    replay,
    replay_all,
)
from lbproxy.tools.traffic_log import Logged, Malformed, parse_haproxy, parse_lbproxy
from tests.factories import virtual_server

T0 = 1_796_464_800.0  # 2026-12-05T10:00:00Z


def access(start: str, duration: float, client: str, vs: str = "web", port: int = 40000) -> str:
    return json.dumps(
        {
            "time": "2026-12-05T10:00:09.000Z",
            "level": "info",
            "logger": "lbproxy.access",
            "message": "...",
            "start": f"2026-12-05T10:00:{start}Z",
            "duration_s": duration,
            "client": client,
            "client_port": port,
            "virtual_server": vs,
            "real_server": "x",
            "bytes_in": 1,
            "bytes_out": 2,
            "end": "closed",
            "protocol": "tcp",
        }
    )


def config(scheduler: str, servers: str = "ab", name: str = "web", **options) -> Config:
    vs = virtual_server(scheduler, {n: {} for n in servers}, **options)
    return Config(virtual_servers=(dataclasses.replace(vs, name=name),))


# -- the parsers -------------------------------------------------------------------------


def test_lbproxy_line_parses_to_its_facts():
    parsed = parse_lbproxy(access("01.250000", 2.5, "10.0.0.7", port=5555))
    assert parsed == Logged(T0 + 1.25, 2.5, "web", "10.0.0.7", 5555)


def test_lbproxy_other_loggers_and_blank_lines_are_skipped():
    assert parse_lbproxy('{"logger": "lbproxy.proxy", "message": "started"}') is None
    assert parse_lbproxy("   \n") is None


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("not json", "not a JSON object: not json"),
        ("[1, 2]", "not a JSON object: [1, 2]"),
        ('{"logger": "lbproxy.access"}', "no start"),
        (access("01.0", 1, "c").replace('"2026-12-05T10:00:01.0Z"', "7"), "start is not an"),
        (access("xx", 1, "c"), "start is not an ISO 8601 time: 2026-12-05T10:00:xxZ"),
        (access("01.0", -1, "c"), "duration_s is not a number of seconds >= 0: -1"),
        (access("01.0", 1, "c").replace('"duration_s": 1', '"duration_s": NaN'), "duration_s"),
        (access("01.0", 1, "c").replace('"duration_s": 1', '"duration_s": true'), "duration_s"),
        (access("01.0", 1, "c").replace('"duration_s": 1', '"duration_s": 1e999'), "duration_s"),
        (access("01.0", 1, ""), "client is not an address: ''"),
        (access("01.0", 1, "c", vs=""), "virtual_server is not a name: ''"),
        (access("01.0", 1, "c", port=70000), "client_port is not a port: 70000"),
    ],
)
def test_lbproxy_malformed_lines_say_what_is_wrong(line, reason):
    parsed = parse_lbproxy(line)
    assert isinstance(parsed, Malformed)
    assert parsed.reason.startswith(reason), parsed.reason


def test_lbproxy_start_without_a_zone_is_utc():
    line = access("01.5", 1, "c").replace("01.5Z", "01.5")
    assert parse_lbproxy(line).start == T0 + 1.5  # type: ignore[union-attr]


# A line HAProxy 2.6 wrote (`log stdout format raw`), and one through syslog
HAPROXY_RAW = "127.0.0.1:45544 [05/Dec/2026:10:00:02.799] fe web/a 1/-1/3005 0 SC 2/2/1/0/3 0/0"
HAPROXY_SYSLOG = (
    "<134>Dec  5 10:00:02 localhost haproxy[14387]: 10.0.1.2:33313 "
    "[05/Dec/2026:10:00:01.443] fnt bck/srv1 0/0/5007 212 -- 0/0/0/0/3 0/0"
)


def test_haproxy_tcplog_parses_to_its_facts():
    assert parse_haproxy(HAPROXY_RAW) == Logged(T0 + 2.799, 3.005, "web", "127.0.0.1", 45544, "fe")
    assert parse_haproxy(HAPROXY_SYSLOG) == Logged(
        T0 + 1.443, 5.007, "bck", "10.0.1.2", 33313, "fnt"
    )


def test_haproxy_logasap_ipv6_and_no_server():
    line = "::1:4000 [05/Dec/2026:10:00:00.000] fe web/<NOSRV> -1/-1/+12 +0 SC 0/0/0/0/0 0/0"
    assert parse_haproxy(line) == Logged(T0, 0.012, "web", "::1", 4000, "fe")


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("Proxy fe started.", "not an HAProxy tcplog line"),
        (HAPROXY_RAW.replace("05/Dec", "31/Feb"), "no such date: 31/Feb/2026:10:00:02"),
        (HAPROXY_RAW.replace("05/Dec", "05/Foo"), "no such date"),
        (HAPROXY_RAW.replace("1/-1/3005", "1/-1/-1"), "no total time (Tt -1)"),
        (HAPROXY_RAW.replace(":45544", ":99999"), "client port 99999 out of range"),
    ],
)
def test_haproxy_malformed_lines_say_what_is_wrong(line, reason):
    parsed = parse_haproxy(line)
    assert isinstance(parsed, Malformed)
    assert parsed.reason.startswith(reason), parsed.reason


# -- reading a log ----------------------------------------------------------------------


def test_read_log_sorts_by_start_counts_and_names_the_first_five_malformed():
    lines = [
        access("03.0", 1.0, "c"),  # written at its end: after the one that started first
        access("01.0", 1.0, "a"),
        *["garbage"] * 6,
        '{"logger": "lbproxy.proxy", "message": "x"}',
        access("02.0", 0.5, "b"),
    ]
    traffic = read_log(lines, "lbproxy", "t.log")
    assert list(traffic.starts) == [0.0, 1.0, 2.0]
    assert [traffic.clients[i] for i in traffic.client_ids] == ["a", "b", "c"]
    assert (traffic.lines, len(traffic), traffic.malformed) == (10, 3, 6)
    assert [n for n, _ in traffic.first_malformed] == [3, 4, 5, 6, 7]
    assert traffic.first_start == T0 + 1.0
    assert traffic.span == 3.0


def test_a_gzip_log_reads_as_its_text(tmp_path):
    path = tmp_path / "access.log.gz"
    with gzip.open(path, "wt") as out:
        out.write(access("01.0", 1.0, "a") + "\n")
    with open_log(str(path)) as lines:
        assert len(read_log(lines, "lbproxy")) == 1


# -- the replay's arithmetic ------------------------------------------------------------


def test_rr_shares_and_peaks_follow_the_logged_times():
    # a [0, 2), b [1, 3), c [1.5, 3.5), d [3, 4): rr places a, b, c, d on x, y, x, y
    traffic = read_log(
        [
            access("00.0", 2.0, "a"),
            access("01.0", 2.0, "b"),
            access("01.5", 2.0, "c"),
            access("03.0", 1.0, "d"),
        ],
        "lbproxy",
    )
    result = replay(traffic, config("rr", "xy"), "rr.yaml").virtual_servers["web"]
    assert result.connections == {"x": 2, "y": 2}
    assert result.shares() == {"x": 0.5, "y": 0.5}
    # x holds a and c at 1.5; y's b ends at 3, exactly when d starts: gone before it
    assert result.peaks == {"x": 2, "y": 1}
    assert result.peak_ratio() == 2 / 1.5


def test_lc_sees_the_held_connections():
    # a holds x for 10 s; b, c, d arrive one after the other and each ends before the
    # next: least connections sends them all to y
    traffic = read_log(
        [access("00.0", 10, "a")] + [access(f"0{i}.0", 0.5, "b") for i in range(1, 4)],
        "lbproxy",
    )
    result = replay(traffic, config("lc", "xy"), "lc").virtual_servers["web"]
    assert result.connections == {"x": 1, "y": 3}
    assert result.peaks == {"x": 1, "y": 1}


def test_a_virtual_server_the_configuration_lacks_is_counted():
    traffic = read_log(
        [
            access("00.0", 1, "a"),
            access("00.5", 1, "a", vs="api"),
            access("00.6", 1, "b", vs="api"),
        ],
        "lbproxy",
    )
    result = replay(traffic, config("rr"), "one")
    assert result.missing == {"api": 2}
    assert list(result.virtual_servers) == ["web"]


def tcplog(second: int, frontend: str, backend: str, client: str = "10.0.0.1") -> str:
    return (
        f"{client}:4000{second} [05/Dec/2026:10:00:0{second}.000] {frontend} {backend}/a "
        "0/0/5000 10 -- 1/1/1/0/0 0/0"
    )


def test_haproxy_lines_meet_the_imports_copy_for_their_frontend_or_the_shared_one():
    # `lbproxy import` merges the frontends that take clients alike into one virtual
    # server named after the backend, and names BACKEND-FRONTEND a copy for another
    lines = [tcplog(0, "ft_a", "bk"), tcplog(1, "ft_b", "bk"), tcplog(2, "ft_c", "bk")]
    traffic = read_log(lines, "haproxy")
    shared = dataclasses.replace(config("rr", "xy", name="bk").virtual_servers[0])
    copy = dataclasses.replace(shared, name="bk-ft_c")
    result = replay(traffic, Config(virtual_servers=(shared, copy)), "imported")
    assert result.missing == {}
    # ft_a's and ft_b's lines share bk's pool: rr goes on from x to y
    assert result.virtual_servers["bk"].connections == {"x": 1, "y": 1}
    assert result.virtual_servers["bk-ft_c"].connections == {"x": 1, "y": 0}


def test_no_server_available_is_not_placed():
    traffic = read_log([access("00.0", 1, "a")], "lbproxy")
    disabled = config("rr", "x")
    vs = disabled.virtual_servers[0]
    off = dataclasses.replace(vs.real_servers[0], state="disabled")
    disabled = Config(virtual_servers=(dataclasses.replace(vs, real_servers=(off,)),))
    result = replay(traffic, disabled, "off").virtual_servers["web"]
    assert (result.not_placed, result.placed, result.first) == (1, 0, {0: None})


def test_moved_clients_between_two_configurations():
    # four clients, two connections each; rr sends each client's first to x, y, x, y
    clients = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"]
    lines = [access(f"0{i}.0", 0.1, c) for i, c in enumerate(clients)]
    lines += [access(f"0{i + 4}.0", 0.1, c) for i, c in enumerate(clients)]
    traffic = read_log(lines, "lbproxy")
    first, other = replay_all(traffic, [("rr", config("rr", "xy")), ("wrr", config("rr", "yx"))])
    # the same rr, the servers listed the other way round: every client's first server
    # is the other one
    assert first.moved is None
    (moved,) = other.moved  # type: ignore[misc]
    assert (moved.virtual_server, moved.clients, moved.moved, moved.percent) == ("web", 4, 4, 100)
    same = replay(traffic, config("rr", "xy"), "again")
    assert compare(first, same)[0].moved == 0


def test_maglev_moves_only_the_clients_of_a_removed_server():
    clients = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(1000)]
    lines = [access(f"{i // 100:02d}.{i % 100:02d}", 0.01, c) for i, c in enumerate(clients[:900])]
    traffic = read_log(lines, "lbproxy")
    before, after = replay_all(
        traffic, [("abcd", config("maglev", "abcd")), ("abc", config("maglev", "abc"))]
    )
    on_d = sum(1 for server in before.virtual_servers["web"].first.values() if server == "d")
    (moved,) = after.moved  # type: ignore[misc]
    assert moved.clients == 900
    # maglev's promise: those on d move, and at most a few percent of the others
    assert on_d <= moved.moved <= on_d + 0.05 * (900 - on_d)


def test_gates_say_which_and_by_how_much():
    clients = ["a", "b", "c", "d"]
    lines = [access(f"0{i}.0", 5.0, c) for i, c in enumerate(clients)]
    traffic = read_log(lines, "lbproxy")
    results = replay_all(traffic, [("one", config("rr", "xy")), ("two", config("rr", "yx"))])
    # rr over x, y, all held: peaks 2 and 2: ratio 1
    assert gates(results, max_moved=None, max_peak_ratio=1.0) == []
    (failure,) = gates(results, max_moved=25.0, max_peak_ratio=None)
    assert (failure.gate, failure.configuration, failure.value) == ("max-moved", "two", 100.0)
    assert failure.line() == (
        "gate --max-moved 25 exceeded by 75 points: two, virtual server web: "
        "4 of 4 clients moved (100%) from one"
    )
    assert gates(results, max_moved=100.0, max_peak_ratio=None) == []


def test_peak_ratio_gate():
    # one server of three takes everything: its peak 2 over the mean peak 2/3 is 3
    lines = [access("00.0", 5.0, "a"), access("01.0", 5.0, "b")]
    traffic = read_log(lines, "lbproxy")
    result = replay(traffic, config("first", "xyz"), "first.yaml")
    assert result.virtual_servers["web"].peaks == {"x": 2, "y": 0, "z": 0}
    (failure,) = gates([result], max_moved=None, max_peak_ratio=2.5)
    assert failure.gate == "max-peak-ratio" and failure.value == 3.0
    assert failure.line() == (
        "gate --max-peak-ratio 2.5 exceeded by 0.5: first.yaml, virtual server web: "
        "peak 2 on x over a mean peak of 0.6667 is 3"
    )
    assert gates([result], max_moved=None, max_peak_ratio=3.0) == []


def test_a_server_standing_by_is_not_in_the_mean_peak():
    # rr over x and y, all held: peaks 2 and 2; z is a backup (or disabled, or weight 0)
    # and holds nothing, as it should: the ratio is 1, not 2 / (4 / 3)
    lines = [access(f"0{i}.0", 9.0, c) for i, c in enumerate("abcd")]
    traffic = read_log(lines, "lbproxy")
    for standing_by in ({"backup": True}, {"state": "disabled"}, {"weight": 0}):
        vs = virtual_server("rr", {"x": {}, "y": {}, "z": standing_by})
        cfg = Config(virtual_servers=(dataclasses.replace(vs, name="web"),))
        result = replay(traffic, cfg, "c").virtual_servers["web"]
        assert result.peaks == {"x": 2, "y": 2, "z": 0}
        assert result.peak_ratio() == 1.0, standing_by
    # an enabled server that took nothing still counts: that is what the gate is for
    result = replay(traffic, config("first", "xyz"), "c").virtual_servers["web"]
    assert result.peak_ratio() == 4 / (4 / 3)
