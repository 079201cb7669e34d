"""`lbproxy import` reads environment variables and `.if` blocks as the real HAProxy
2.6 does: the same conditions decided alike by `haproxy -c`, and the same addresses
listened on by HAProxy running the file and by the import, in the same environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lbproxy.tools.importer.haproxy_conditions import Malformed, evaluate
from tests.integration.harness import free_port, listening, wait_for
from tests.integration.real_haproxy import Haproxy
from tests.tools import need, requires

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(120),
    requires("haproxy", package="haproxy"),
]

ENV = {"A": "1", "EMPTY": "", "MODE": "staging", "LIST": "a b"}


def haproxy_decides(tmp_path: Path, condition: str) -> bool | str:
    """What `haproxy -c` makes of `.if CONDITION`: True (the block is read), False, or
    "malformed" (HAProxy refuses the condition)."""
    config = tmp_path / "condition.cfg"
    config.write_text(f'global\n.if {condition}\n    .alert "taken"\n.endif\n')
    checked = subprocess.run(
        [need("haproxy", "haproxy"), "-c", "-f", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        env={"PATH": os.environ.get("PATH", ""), **ENV},
    )
    output = checked.stdout + checked.stderr
    if "'taken'" in output:
        return True
    if "in '.if'" in output:
        return "malformed"
    assert checked.returncode == 2 and "no listener" in output, output
    return False


CONDITIONS = [
    "",
    "0",
    "1",
    "-1",
    "0x10",
    "010",
    "08",
    "!0",
    "! ! 1",
    "1 && 0 || 1",
    "0 || 1 && 0",
    "(0 || 1) && 0",
    "!(1 && 0)",
    "defined(A)",
    "defined(EMPTY)",
    "defined(NOT_SET)",
    "defined()",
    'streq("$MODE",staging)',
    'streq("${MODE-x}",x)',
    'streq("${NOT_SET-x}",x)',
    'strneq("${EMPTY-x}",x)',
    "streq('a b',\"a b\")",
    "streq(a\\,b,a)",
    "streq(,)",
    "yes",
    "1 &&",
    "(1",
    "defined",
    "defined (A)",
    "feature(X",
    "streq",
    "streq(a)",
    "streq(a,b,c)",
    "1 1",
]


@pytest.mark.parametrize("condition", CONDITIONS)
def test_conditions_are_decided_as_haproxy_decides(tmp_path, condition):
    from lbproxy.tools.importer.haproxy_grammar import split_words

    words, error = split_words(f".if {condition}", ENV.get)
    assert error is None
    ours = evaluate(" ".join(words[1:]), ENV)
    expected = haproxy_decides(tmp_path, condition)
    assert ("malformed" if isinstance(ours, Malformed) else ours) == expected


CONFIG = """
defaults
    mode tcp
    timeout connect 1s
    timeout client 5s
    timeout server 5s
.if defined(PROD)
frontend prod
    bind 127.0.0.1:{p1}
    default_backend b
.elif streq("$MODE",staging) && !defined(NOT_SET)
frontend staging
    bind ${{LB_ADDR}}:{p2}
    bind "${{NOT_SET-127.0.0.1}}:{p3}"
    .if 0
    bind 127.0.0.1:{p4}
    .else
    bind '$LB_ADDR:{p5}'
    .endif
    default_backend b
.else
frontend other
    bind 127.0.0.1:{p6}
    default_backend b
.endif
backend b
    server s "${{SERVER}}:{server}"
"""


@pytest.mark.parametrize(
    "env, listened",
    [
        ({"MODE": "staging", "LB_ADDR": "127.0.0.1"}, ["p2", "p3", "p5"]),
        ({"MODE": "prod", "PROD": "1"}, ["p1"]),
        ({"MODE": "prod"}, ["p6"]),
    ],
)
def test_the_import_listens_where_haproxy_listens_in_the_same_environment(tmp_path, env, listened):
    ports = {f"p{n}": free_port() for n in range(1, 7)}
    config = CONFIG.format(server=free_port(), **ports)
    env = {"PATH": os.environ.get("PATH", ""), "SERVER": "127.0.0.1", **env}
    haproxy = Haproxy(tmp_path / "haproxy", config, [ports[p] for p in listened], env=env)
    try:
        haproxy.start()
        source = tmp_path / "haproxy.cfg"
        source.write_text(config)
        imported = subprocess.run(
            [sys.executable, "-m", "lbproxy", "import", str(source)],
            capture_output=True,
            text=True,
            timeout=60,
            env={**env, "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        )
        assert imported.returncode == 0, imported.stderr
        document = yaml.safe_load(imported.stdout)
        addresses = []
        for vs in document["virtual_servers"]:
            addresses += [vs["listen"]] if isinstance(vs["listen"], str) else vs["listen"]
        wait_for(lambda: all(listening(ports[p]) for p in listened), 10, "haproxy to listen")
        haproxy_ports = sorted(name for name, port in ports.items() if listening(port))
        assert haproxy_ports == listened, haproxy.log()
        assert sorted(f"127.0.0.1:{ports[p]}" for p in listened) == sorted(addresses)
    finally:
        haproxy.stop()
