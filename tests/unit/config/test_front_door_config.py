"""Configuration of front-door routing (SPEC §13): sni, backup, queue; every mistake
reported as FILE:LINE, and `lbproxy check` shows the new keys."""

from __future__ import annotations

from pathlib import Path

from lbproxy.config.model import QueueConfig
from lbproxy.config.reader import load
from lbproxy.config.summary import summary
from tests.unit.config.support import problems, write

SHARED = """\
virtual_servers:
  - name: api
    listen: 127.0.0.1:8443
    sni: [API.example.com., "*.apps.example.com"]
    queue: {max: 10, timeout: 250ms, abort_on_close: true}
    real_servers:
      - {name: a, address: 127.0.0.1:9001}
      - {name: b, address: 127.0.0.1:9002, backup: true}
  - name: web
    listen: 127.0.0.1:8443
    queue:
    real_servers:
      - {name: c, address: 127.0.0.1:9003}
"""


def test_sni_backup_and_queue_are_read(tmp_path: Path) -> None:
    config = load([write(tmp_path, "front.yaml", SHARED)])
    api, web = config.virtual_servers
    assert api.sni == ("api.example.com", "*.apps.example.com")  # lower case, no dot
    assert web.sni == ()
    assert [rs.backup for rs in api.real_servers] == [False, True]
    assert api.queue == QueueConfig(max=10, timeout=0.25, abort_on_close=True)
    # `queue:` alone: the defaults, a client that closes its side still served
    assert web.queue == QueueConfig(max=1000, timeout=5.0, abort_on_close=False)
    text = summary(config)
    assert "sni         api.example.com, *.apps.example.com" in text
    assert "queue       up to 10 clients for 0.25s, a client that closes is dropped" in text
    assert "queue       up to 1000 clients for 5s\n" in text
    assert "backup" in text


def test_bad_values_are_reported_at_their_lines(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "bad.yaml",
        """\
        virtual_servers:
          - name: api
            listen: 127.0.0.1:8443
            sni: ["a.*.example.com", ok.example.com]
            queue: {max: 0, timeout: -1s, size: 3}
            real_servers:
              - {name: a, address: 127.0.0.1:9001, backup: "yes"}
        """,
    )
    found = problems([path])
    assert found[0].startswith(f"{path}:4: sni must be a host name") and "first label" in found[0]
    assert any(p.startswith(f"{path}:5: queue.max must be") for p in found)
    assert any(p.startswith(f"{path}:5: queue.timeout must be") for p in found)
    assert any(p.startswith(f"{path}:5: unknown key 'size' in queue of") for p in found)
    assert any(p.startswith(f"{path}:7: backup must be true or false") for p in found)


def test_a_name_twice_in_one_virtual_server(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "twice.yaml",
        """\
        virtual_servers:
          - name: api
            listen: 127.0.0.1:8443
            sni:
              - ok.example.com
              - OK.Example.com.
            real_servers: [{name: a, address: 127.0.0.1:9001}]
        """,
    )
    assert problems([path]) == [f"{path}:6: duplicate sni name 'ok.example.com' (first at line 5)"]


def shared(tmp_path: Path, second: str, first: str = "sni: [api.example.com]") -> str:
    return write(
        tmp_path,
        "shared.yaml",
        f"""\
        virtual_servers:
          - name: api
            listen: 127.0.0.1:8443
            {first}
            real_servers: [{{name: a, address: 127.0.0.1:9001}}]
          - name: web
            listen: 127.0.0.1:8443
            {second}
            real_servers: [{{name: b, address: 127.0.0.1:9002}}]
        """,
    )


def test_a_name_routed_to_two_virtual_servers(tmp_path: Path) -> None:
    path = shared(tmp_path, "sni: [www.example.com, API.Example.com]")
    assert problems([path]) == [
        f"{path}:8: sni name 'api.example.com' on 127.0.0.1:8443 is routed to virtual "
        "server api already (at line 4)"
    ]


def test_two_defaults_on_one_address_clash(tmp_path: Path) -> None:
    path = shared(tmp_path, "scheduler: rr", first="scheduler: rr")
    [problem] = problems([path])
    assert problem.startswith(f"{path}:7: listen address 127.0.0.1:8443 clashes with")


def test_one_default_beside_sni_is_fine_and_overlapping_addresses_still_clash(
    tmp_path: Path,
) -> None:
    assert len(load([shared(tmp_path, "scheduler: rr")]).virtual_servers) == 2
    path = write(
        tmp_path,
        "wild.yaml",
        """\
        virtual_servers:
          - {name: api, listen: 127.0.0.1:8443, sni: [a.example.com],
             real_servers: [{name: a, address: 127.0.0.1:9001}]}
          - {name: any, listen: 0.0.0.0:8443, sni: [b.example.com],
             real_servers: [{name: b, address: 127.0.0.1:9002}]}
        """,
    )
    [problem] = problems([path])
    assert problem.startswith(f"{path}:4: listen address 0.0.0.0:8443 clashes with")


def test_virtual_servers_sharing_an_address_agree_on_accept_proxy(tmp_path: Path) -> None:
    path = shared(tmp_path, "accept_proxy: true")
    assert problems([path]) == [
        f"{path}:8: virtual servers sharing 127.0.0.1:8443 must agree on accept_proxy "
        "(api at line 3 has false)"
    ]


def test_accept_proxy_from_is_read_and_defaults_to_the_private_ranges(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "trust.yaml",
        """\
        virtual_servers:
          - name: api
            listen: 127.0.0.1:8443
            accept_proxy: true
            accept_proxy_from: [192.0.2.10, 2001:db8::/64]
            real_servers: [{name: a, address: 127.0.0.1:9001}]
          - name: web
            listen: 127.0.0.1:8444
            accept_proxy: true
            real_servers: [{name: b, address: 127.0.0.1:9002}]
        """,
    )
    api, web = load([path]).virtual_servers
    assert [str(n) for n in api.accept_proxy_from] == ["192.0.2.10/32", "2001:db8::/64"]
    assert [str(n) for n in web.accept_proxy_from] == [
        "127.0.0.0/8",
        "::1/128",
        "10.0.0.0/8",
        "172.16.0.0/12",
        "192.168.0.0/16",
        "fc00::/7",
    ]


def test_accept_proxy_from_without_accept_proxy_is_an_error(tmp_path: Path) -> None:
    path = shared(tmp_path, "accept_proxy_from: [10.0.0.0/8]\n            sni: [b.example.com]")
    assert problems([path]) == [f"{path}:8: accept_proxy_from needs accept_proxy: true"]


def test_virtual_servers_sharing_an_address_agree_on_accept_proxy_from(tmp_path: Path) -> None:
    path = shared(
        tmp_path,
        "accept_proxy: true\n            accept_proxy_from: [10.0.0.0/8]",
        "accept_proxy: true\n            sni: [a.example.com]",
    )
    assert problems([path]) == [
        f"{path}:10: virtual servers sharing 127.0.0.1:8443 must agree on accept_proxy_from "
        "(see api at line 3)"
    ]
    agreeing = shared(
        tmp_path,
        "accept_proxy: true\n            accept_proxy_from: [10.0.0.0/8]",
        "accept_proxy: true\n            accept_proxy_from: [10.0.0.0/8]\n"
        "            sni: [a.example.com]",
    )
    assert len(load([agreeing]).virtual_servers) == 2


def test_accept_proxy_from_is_refused_on_udp(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "udp.yaml",
        """\
        virtual_servers:
          - name: dns
            protocol: udp
            listen: 127.0.0.1:5300
            accept_proxy_from: [10.0.0.0/8]
            real_servers: [{name: a, address: 127.0.0.1:53}]
        """,
    )
    assert f"{path}:5: accept_proxy_from is for TCP; a UDP virtual server refuses it" in problems(
        [path]
    )
