"""Bad runtime changes are refused whole: PATCH bodies over real HTTP, `set-weight`, events.

A static weight is an integer from 0 to 65535, as in the configuration file: 1.5, 3.0,
true, "3", -1 or NaN is a 400 naming the problem (exit 2 for `set-weight`), and nothing
changes, on one process and on every worker of `workers: 2`.
"""

from __future__ import annotations

import json
import urllib.request

import pytest

from tests.integration.harness import (
    ask_name,
    free_port,
    local_http,
    ready,
    run_cli,
    vs_config,
    wait_for,
    with_admin,
    worker_servers,
    workers_config,
)

WEIGHT_RULE = "weight must be an integer from 0 to 65535, got "
STATE_RULE = "state must be one of enabled, drain, disabled, got "

# (raw body, a fragment of the error it must get) -- every one answers 400
BAD_BODIES = [
    (b'{"weight": 1.5}', WEIGHT_RULE + "1.5"),
    (b'{"weight": 0.5}', WEIGHT_RULE + "0.5"),
    (b'{"weight": 3.0}', WEIGHT_RULE + "3.0 (write 3"),
    (b'{"weight": 1e2}', WEIGHT_RULE + "100.0 (write 100"),
    (b'{"weight": true}', WEIGHT_RULE + "true (a boolean is not a weight)"),
    (b'{"weight": false}', WEIGHT_RULE + "false (a boolean is not a weight)"),
    (b'{"weight": "3"}', WEIGHT_RULE + '"3" (a string; write the number without quotes)'),
    (b'{"weight": "heavy"}', WEIGHT_RULE + '"heavy"'),
    (b'{"weight": -1}', WEIGHT_RULE + "-1"),
    (b'{"weight": 65536}', WEIGHT_RULE + "65536"),
    (b'{"weight": 123456789012345678901234567890}', WEIGHT_RULE + "1234567890123"),
    (b'{"weight": 1e400}', WEIGHT_RULE + "Infinity"),
    (b'{"weight": -1e400}', WEIGHT_RULE + "-Infinity"),
    (b'{"weight": NaN}', "NaN is not a JSON number"),
    (b'{"weight": Infinity}', "Infinity is not a JSON number"),
    (b'{"weight": null}', WEIGHT_RULE + "null"),
    (b'{"weight": [2]}', WEIGHT_RULE + "[2]"),
    (b'{"weight": {"value": 2}}', WEIGHT_RULE + '{"value": 2}'),
    (b'{"state": 1}', STATE_RULE + "1"),
    (b'{"state": true}', STATE_RULE + "true"),
    (b'{"state": null}', STATE_RULE + "null"),
    (b'{"state": "Drain"}', STATE_RULE + '"Drain" (did you mean "drain"?)'),
    (b'{"state": "off"}', STATE_RULE + '"off"'),
    (b'{"state": ["drain"]}', STATE_RULE + '["drain"]'),
    (
        b'{"colour": "red"}',
        'unknown key "colour" in the body; the keys are "weight", "state", '
        '"close_after" and "close_rate"',
    ),
    (b'{"weight": 2, "colour": "red"}', 'unknown key "colour"'),
    (b'{"weight": 2, "state": "nope"}', STATE_RULE + '"nope"'),  # the weight is not applied
    (b'{"weight": 1.5, "state": "drain"}', WEIGHT_RULE + "1.5"),  # nor is the state
    (b'{"weight": 2, "weight": 2}', 'key "weight" appears twice in the body'),
    (b"{}", "body changes nothing"),
    (b'[{"weight": 2}]', "body must be a JSON object"),
    (b'"drain"', "body must be a JSON object"),
    (b"2", "body must be a JSON object"),
    (b"null", "body must be a JSON object"),
    (b'{"weight": 2', "body is not valid JSON (Expecting ',' delimiter)"),
    (b"weight=2", "body is not valid JSON"),
    (b"", "body is empty"),
    (b"  \n", "body is empty"),
    (b'{"state": "dr\xffain"}', "body is not UTF-8 JSON"),
]


def patch(url: str, body: bytes) -> tuple[int, dict]:
    """Through the admin socket: over TCP a change needs the token (SPEC §21)."""
    status, answer = local_http("PATCH", url, body, {"Content-Type": "application/json"})
    return status, json.loads(answer)


def get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def refuse_every_bad_body(url: str) -> list[str]:
    """PATCH each bad body; the problems (not a 400, or an error not naming it)."""
    problems = []
    for body, expected in BAD_BODIES:
        status, document = patch(url, body)
        if status != 400 or expected not in document.get("error", ""):
            problems.append(f"{body!r}: {status} {document}")
    return problems


@pytest.fixture
def three(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port)
    proxy = lbproxy(config)
    admin = f"http://127.0.0.1:{admin_port}"
    return proxy, port, admin, f"{admin}/api/v1/virtual-servers/web/real-servers"


def test_a_bad_patch_body_is_400_naming_the_problem_and_changes_nothing(three):
    proxy, port, _, url = three
    before = get(f"{url}/b")
    assert refuse_every_bad_body(f"{url}/b") == []
    assert get(f"{url}/b") == before  # weight 1, enabled: not 1.5, not 2, not drain
    assert "web/b: weight" not in proxy.log() and "web/b: state" not in proxy.log()
    assert proxy.log().count("web/b: change refused: ") == len(BAD_BODIES)
    assert sorted(ask_name(port) for _ in range(6)) == ["a", "a", "b", "b", "c", "c"]

    status, document = patch(f"{url}/b", b"x" * (64 * 1024 + 1))
    assert status == 413 and document == {"error": "body too large: more than 65536 bytes"}
    # unknown names are still 404, whatever the body
    assert patch(f"{url}/zz", b'{"weight": 1.5}')[0] == 404
    assert patch(f"{url[: -len('/web/real-servers')]}/no/real-servers/b", b"{}")[0] == 404


def test_a_valid_patch_applies_weight_and_state_together(three):
    proxy, port, _, url = three
    status, document = patch(f"{url}/b", b'{"weight": 4, "state": "drain"}')
    assert status == 200, document
    assert document["weight"]["static"] == 4 and document["state"] == "drain"
    assert "b" not in [ask_name(port) for _ in range(4)]
    status, document = patch(f"{url}/b", b'{"state": "enabled"}')
    assert status == 200 and document["state"] == "enabled"
    status, document = patch(f"{url}/a", b'{"weight": 0}')
    assert status == 200 and document["weight"] == {"static": 0, "dynamic": None, "effective": 0}
    assert patch(f"{url}/a", b'{"weight": 65535}')[1]["weight"]["static"] == 65535
    assert "web/b: weight 1 -> 4" in proxy.log()


def test_workers_refuse_a_bad_body_at_the_supervisor(name_servers, lbproxy):
    servers = name_servers("a", "b", "c")
    port, admin_port = free_port(), free_port()
    proxy = lbproxy(workers_config(port, servers, admin_port))
    wait_for(lambda: ready(admin_port), what="/readyz")
    url = f"http://127.0.0.1:{admin_port}/api/v1/virtual-servers/web/real-servers"
    before = [worker_servers(admin_port, index)["b"] for index in (1, 2)]
    assert refuse_every_bad_body(f"{url}/b") == []
    assert [worker_servers(admin_port, index)["b"] for index in (1, 2)] == before
    # One refusal each, by the supervisor: no worker saw the bodies (a worker that did
    # would log its own refusal, and an override to replay on a restart).
    assert proxy.log().count("web/b: change refused: ") == len(BAD_BODIES)
    assert patch(f"{url}/zz", b'{"weight": 1.5}')[0] == 404
    status, document = patch(f"{url}/b", b'{"weight": 5, "state": "drain"}')
    assert status == 200 and document["weight"]["static"] == 5 and document["state"] == "drain"
    for index in (1, 2):
        b = worker_servers(admin_port, index)["b"]
        assert b["weight"]["static"] == 5 and b["state"] == "drain"


@pytest.mark.parametrize("weight", ["1.5", "3.0", "abc", "-1", "-0.5", "65536", "1e3", " 3", ""])
def test_set_weight_refuses_a_bad_weight_before_asking_the_api(three, weight):
    _, _, admin, url = three
    out = run_cli("set-weight", "web", "b", weight, "--admin", admin)
    assert out.returncode == 2, out
    assert f"weight must be an integer from 0 to 65535, got {weight!r}" in out.stderr
    assert "Traceback" not in out.stderr
    assert get(f"{url}/b")["weight"]["static"] == 1


def test_set_weight_checks_the_weight_without_an_endpoint():
    # Nothing listens there: exit 2 (bad usage), not 1 (endpoint unreachable).
    out = run_cli("set-weight", "web", "b", "1.5", "--admin", f"127.0.0.1:{free_port()}")
    assert out.returncode == 2 and "cannot reach" not in out.stderr
    assert "weight must be an integer from 0 to 65535, got '1.5'" in out.stderr


def test_set_weight_sets_an_integer_weight(three):
    _, _, admin, url = three
    out = run_cli("set-weight", "web", "b", "7", "--admin", admin)
    assert out.returncode == 0, out.stderr
    assert "web/b: state enabled, health up, weight 7 (effective 7)" in out.stdout
    assert get(f"{url}/b")["weight"]["static"] == 7


def test_simulate_events_take_the_same_weight_rule(tmp_path):
    config = tmp_path / "lb.yaml"
    config.write_text(
        "virtual_servers:\n"
        "  - name: web\n"
        f"    listen: 127.0.0.1:{free_port()}\n"
        "    scheduler: wrr\n"
        "    real_servers:\n"
        "      - {name: a, address: 127.0.0.1:9001}\n"
        "      - {name: b, address: 127.0.0.1:9002}\n"
    )
    events = tmp_path / "events.yaml"
    events.write_text("- {before: 3, weight: {a: 1.5}}\n- {before: 4, weight: {b: true}}\n")
    out = run_cli("simulate", str(config), "-n", "6", "--events", str(events))
    assert out.returncode == 2, out
    assert f"{events}:1: {WEIGHT_RULE}1.5 (real server a)" in out.stderr
    assert f"{events}:2: {WEIGHT_RULE}true (a boolean is not a weight) (real server b)" in (
        out.stderr
    )
