"""The deployment files work as shipped: the systemd unit, the container image's
configuration, the Kubernetes manifests and the Grafana dashboard, each checked against
the configuration it runs and, where it names something lbproxy serves, against a real
`lbproxy run`."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from lbproxy.config.reader import load
from tests import tools
from tests.integration.harness import (
    ROOT,
    counted,
    free_port,
    http,
    local_http,
    open_and_read_name,
    ready,
    run_cli,
    stop_traced,
    vs_config,
    wait_for,
    with_admin,
)

CONTRIB = ROOT / "contrib"
REFERENCE_METRICS = {
    "lbproxy_connections", "lbproxy_active_connections", "lbproxy_bytes",
    "lbproxy_rejected_connections", "lbproxy_connect_failures", "lbproxy_real_server_up",
    "lbproxy_real_server_weight", "lbproxy_health_checks", "lbproxy_snmp_polls",
    "lbproxy_snmp_poll_duration_seconds", "lbproxy_dynamic_weight_fallback",
    "lbproxy_throttle_mode", "lbproxy_connection_duration_seconds", "lbproxy_config_reloads",
    "lbproxy_workers_ready", "lbproxy_worker_restarts",
}  # fmt: skip
UNIT = CONTRIB / "lbproxy.service"


# -- systemd -----------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def seconds(text: str) -> float:
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(ms|s|min|m)?", text)
    assert match, text
    scale = {"ms": 0.001, "s": 1, "min": 60, "m": 60, None: 1}[match[2]]
    return float(match[1]) * scale


def test_unit_file_has_what_the_readme_promises():
    settings = unit_settings(UNIT.read_text())
    one = {key: values[-1] for key, values in settings.items()}
    assert one["Type"] == "notify"
    assert one["NotifyAccess"] == "all"  # the new process of an upgrade sends MAINPID=
    assert one["ExecReload"] == "/bin/kill -HUP $MAINPID"
    assert one["ExecStart"].endswith("lbproxy run /etc/lbproxy")
    assert int(one["LimitNOFILE"]) >= 65536
    assert one.get("DynamicUser") == "yes" or one.get("User") not in (None, "", "root")
    assert one["AmbientCapabilities"] == "CAP_NET_BIND_SERVICE"
    assert one["CapabilityBoundingSet"] == "CAP_NET_BIND_SERVICE"
    assert one["NoNewPrivileges"] == "yes"
    assert one["ProtectSystem"] == "strict"
    assert one["PrivateTmp"] == "yes"  # workers > 1 need a writable /tmp
    # systemd must wait longer than the drain the shipped configuration asks for
    drain = load([str(ROOT / "configs")]).global_.drain_timeout
    assert seconds(one["TimeoutStopSec"]) > drain


@tools.requires("systemd-analyze", package="systemd")
def test_unit_file_passes_systemd_analyze_verify(tmp_path):
    # `verify` checks that every Exec*= binary exists: point them at this checkout's
    # own lbproxy (the unit names /opt/lbproxy/bin/lbproxy, the virtual environment of
    # docs/howto/install.md; tests/integration/test_packaging.py verifies it with one).
    lbproxy = Path(sys.executable).parent / "lbproxy"
    assert lbproxy.exists()
    unit = tmp_path / "lbproxy.service"
    unit.write_text(UNIT.read_text().replace("/opt/lbproxy/bin/lbproxy", str(lbproxy)))
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    output = verify.stdout + verify.stderr
    assert verify.returncode == 0, output
    assert "lbproxy.service" not in output, output  # no warning about our unit at all
    security = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    exposure = re.search(r"exposure level for lbproxy\.service: (\d+\.\d+)", security.stdout)
    if exposure is None:  # an older systemd-analyze without --offline
        pytest.skip(f"systemd-analyze security --offline unsupported: {security.stderr.strip()}")
    assert float(exposure[1]) < 3.0, security.stdout  # systemd calls below 3 "OK"


SOCKET_UNIT = CONTRIB / "lbproxy.socket"


def test_socket_unit_passes_what_the_shipped_configuration_listens_on():
    """Every ListenStream= of contrib/lbproxy.socket is an address the configuration the
    unit's comment installs (configs/global.yaml and configs/wlc.yaml) listens on: else
    `lbproxy run` would refuse to start ("matches no virtual server")."""
    settings = unit_settings(SOCKET_UNIT.read_text())
    config = load([str(ROOT / "configs" / "global.yaml"), str(ROOT / "configs" / "wlc.yaml")])
    listened = {str(a) for vs in config.virtual_servers for a in vs.listen}
    listened.add(str(config.global_.admin.listen))
    assert settings["ListenStream"] and set(settings["ListenStream"]) <= listened
    assert settings["Accept"] == ["no"]
    assert settings["Service"] == ["lbproxy.service"]
    assert "contrib/lbproxy.socket" in SOCKET_UNIT.read_text()  # how to install it


@tools.requires("systemd-analyze", package="systemd")
def test_socket_unit_passes_systemd_analyze_verify(tmp_path):
    lbproxy = Path(sys.executable).parent / "lbproxy"
    (tmp_path / "lbproxy.service").write_text(
        UNIT.read_text().replace("/opt/lbproxy/bin/lbproxy", str(lbproxy))
    )
    (tmp_path / "lbproxy.socket").write_text(SOCKET_UNIT.read_text())
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "lbproxy.socket")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    output = verify.stdout + verify.stderr
    assert verify.returncode == 0, output
    assert "lbproxy.socket" not in output, output


def _syscall_set(group: str, seen: set[str]) -> set[str]:
    """The system calls in a systemd-analyze syscall-filter group, groups expanded."""
    out = subprocess.run(
        ["systemd-analyze", "syscall-filter", group], capture_output=True, text=True, timeout=30
    ).stdout
    names: set[str] = set()
    for line in out.splitlines()[1:]:
        line = line.strip()
        if line.startswith("@") and line not in seen:
            seen.add(line)
            names |= _syscall_set(line, seen)
        elif line and not line.startswith(("#", "@")):
            names.add(line)
    return names


@tools.requires("strace", package="strace")
@tools.requires("systemd-analyze", package="systemd")
def test_unit_sandbox_allows_every_system_call_and_socket_family_lbproxy_uses(
    name_servers, tmp_path
):
    """Trace a real `lbproxy run` (two workers, health checks, SNMP polls, spliced bytes,
    the admin API, a reload, a drain, systemd notify) and check that the unit's
    SystemCallFilter= and RestrictAddressFamilies= allow all it does."""
    settings = {key: values[-1] for key, values in unit_settings(UNIT.read_text()).items()}
    allowed = _syscall_set(settings["SystemCallFilter"], set())
    families = set(settings["RestrictAddressFamilies"].split())
    servers = name_servers("a")
    port, polled, admin_port = free_port(), free_port(), free_port()
    config = tmp_path / "lbproxy.yaml"
    config.write_text(
        "global:\n"
        f"  admin: {{listen: 127.0.0.1:{admin_port}}}\n"
        "  drain_timeout: 1s\n"
        "  workers: 2\n"
        "virtual_servers:\n"
        "  - name: web\n"
        f"    listen: 127.0.0.1:{port}\n"
        "    health_check: {type: tcp, interval: 300ms}\n"
        f"    real_servers: [{{name: a, address: 127.0.0.1:{servers[0].port}}}]\n"
        "  - name: polled\n"
        f"    listen: 127.0.0.1:{polled}\n"
        "    scheduler: dwd\n"
        f"    snmp: {{port: {free_port()}, interval: 300ms, timeout: 100ms,"
        " on_no_answer: static}\n"
        f'    real_servers: [{{name: a, address: "localhost:{servers[0].port}"}}]\n'
    )
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(str(tmp_path / "notify.sock"))
    trace = tmp_path / "trace"
    log = (tmp_path / "lbproxy.log").open("wb")
    tracer = subprocess.Popen(
        ["strace", "-f", "-qq", "-o", str(trace), sys.executable, "-m", "lbproxy", "run",
         str(config)],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
        env={**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify.sock")},
    )  # fmt: skip
    try:
        wait_for(lambda: ready(admin_port), timeout=60, what="/readyz under strace")
        for target in (port, polled):
            sock, _ = open_and_read_name(target)
            sock.sendall(b"x" * 100_000)
            echoed = 0
            while echoed < 100_000:
                echoed += len(sock.recv(65536))
            sock.close()
        base = f"http://127.0.0.1:{admin_port}"
        for path in ("/", "/metrics", "/api/v1/virtual-servers"):
            assert http("GET", base + path)[0] == 200
        url = f"{base}/api/v1/virtual-servers/web/real-servers/a"
        assert local_http("PATCH", url, {"state": "drain"})[0] == 200  # the admin socket
        assert local_http("POST", f"{base}/api/v1/reload", {})[0] == 200

        def checks_and_polls() -> tuple[float, float]:
            return (
                counted(admin_port, "lbproxy_health_checks_total"),
                counted(admin_port, "lbproxy_snmp_polls_total"),
            )

        checks, polls = checks_and_polls()

        def a_few_more() -> bool:  # a few health checks and SNMP polls more
            checks_now, polls_now = checks_and_polls()
            return checks_now >= checks + 2 and polls_now >= polls + 2

        wait_for(a_few_more, 30, "two more health checks and SNMP polls")
        assert stop_traced(tracer) == 0
    finally:
        if tracer.poll() is None:
            stop_traced(tracer)
        log.close()
        notify.close()
    used, socket_families = set(), set()
    for line in trace.read_text().splitlines():
        match = re.match(r"\d+\s+([a-z0-9_]+)\((.*)", line)
        if match:
            used.add(match[1])
            if match[1] in ("socket", "socketpair"):
                socket_families.add(match[2].split(",", 1)[0])
    # it traced the workers too: they splice the bytes; the supervisor notifies
    assert {"splice", "sendto", "socketpair", "execve"} <= used, sorted(used)
    assert {"AF_INET", "AF_UNIX"} <= socket_families, socket_families
    assert used - allowed == set(), f"SystemCallFilter= would refuse {sorted(used - allowed)}"
    assert socket_families - families == set(), socket_families


# -- the container image ------------------------------------------------------------------


def dockerfile() -> str:
    return (ROOT / "Dockerfile").read_text()


def test_dockerfile_ships_the_container_configuration_and_exposes_its_ports():
    text = dockerfile()
    assert "COPY configs/container/ /etc/lbproxy/" in text
    assert 'CMD ["run", "/etc/lbproxy"]' in text
    (exposed,) = re.findall(r"^EXPOSE (.+)$", text, re.M)
    config = load([str(ROOT / "configs" / "container")])
    admin = config.global_.admin.listen
    listens = [address for vs in config.virtual_servers for address in vs.listen]
    # reachable from outside the container: every interface, not its loopback
    assert admin.host == "0.0.0.0" and all(a.host in ("0.0.0.0", "::") for a in listens)
    assert {int(port) for port in exposed.split()} == {admin.port, *(a.port for a in listens)}
    (healthcheck,) = re.findall(r"LBPROXY_ADMIN=http://127\.0\.0\.1:(\d+)", text)
    assert int(healthcheck) == admin.port
    check = run_cli("check", str(ROOT / "configs" / "container"))
    assert check.returncode == 0, check.stderr
    # The documentation's and the Dockerfile's own `docker run` publish exactly those ports.
    docs = "".join(page.read_text() for page in (ROOT / "docs").rglob("*.md"))
    runs = re.findall(r"docker run [^\n`]*", docs + text)
    assert runs
    for command in runs:
        published = {int(p) for p in re.findall(r"-p \d+:(\d+)", command)}
        assert ":/etc/lbproxy" not in command or "configs:/etc" not in command, command
        assert published <= {admin.port, *(a.port for a in listens)}, command


# -- Kubernetes ----------------------------------------------------------------------------


def manifests() -> dict[tuple[str, str], dict]:
    found = {}
    for path in sorted((CONTRIB / "kubernetes").glob("*.yaml")):
        for document in yaml.safe_load_all(path.read_text()):
            if document:
                found[(document["kind"], document["metadata"]["name"])] = document
    return found


def write_configmap(configmap: dict, folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in configmap["data"].items():
        (folder / name).write_text(text)
    return folder


def test_kubernetes_manifests_agree_with_the_configuration_they_mount(tmp_path):
    found = manifests()
    assert {kind for kind, _ in found} >= {"Deployment", "ConfigMap", "Service"}
    (deployment,) = [d for (kind, _), d in found.items() if kind == "Deployment"]
    pod = deployment["spec"]["template"]
    spec = pod["spec"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = spec["containers"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}

    # The configuration: the ConfigMap mounted where `lbproxy run` reads it.
    assert container["args"][0] == "run"
    (config_path,) = container["args"][1:]
    configmap = found[("ConfigMap", mounts[config_path]["configMap"]["name"])]
    folder = write_configmap(configmap, tmp_path / "etc-lbproxy")
    check = run_cli("check", str(folder))
    assert check.returncode == 0, check.stdout + check.stderr
    config = load([str(folder)])

    # Ports: every listener and the admin endpoint, on every interface of the pod.
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}
    admin = config.global_.admin.listen
    assert admin.host == "0.0.0.0"
    listens = [address for vs in config.virtual_servers for address in vs.listen]
    assert all(address.host in ("0.0.0.0", "::") for address in listens)
    assert set(ports.values()) == {admin.port, *(address.port for address in listens)}

    # Probes: /healthz for liveness, /readyz for readiness, on the admin port.
    for probe, path in (("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")):
        get = container[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == admin.port

    # Stopping: the grace period covers the preStop pause and the whole drain.
    pause = 0.0
    pre_stop = container.get("lifecycle", {}).get("preStop", {})
    if "exec" in pre_stop:
        command = pre_stop["exec"]["command"]
        assert command[0] == "sleep"
        pause = float(command[1])
    elif "sleep" in pre_stop:
        pause = float(pre_stop["sleep"]["seconds"])
    assert spec["terminationGracePeriodSeconds"] > config.global_.drain_timeout + pause

    # The token: a mounted Secret, readable by the pod's group, never by everyone
    # (lbproxy refuses a world-readable token file).
    token_file = Path(config.global_.admin.token_file)
    secret_mount = str(token_file.parent)
    secret = mounts[secret_mount]["secret"]
    assert secret["defaultMode"] & 0o004 == 0 and secret["defaultMode"] & 0o040
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]
    # The image's user, as the Dockerfile makes it.
    (uid,) = re.findall(r"useradd [^\n]*--uid (\d+)", dockerfile())
    assert spec["securityContext"]["runAsUser"] == int(uid)
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "/tmp" in mounts and "emptyDir" in mounts["/tmp"]  # workers' admin sockets

    # Services select the pods and target ports the container has.
    services = [d for (kind, _), d in found.items() if kind == "Service"]
    assert services
    for service in services:
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        for port in service["spec"]["ports"]:
            target = port.get("targetPort", port["port"])
            assert target in ports or target in ports.values(), (service, port)
    served = {
        ports.get(p.get("targetPort"), p.get("targetPort"))
        for s in services
        for p in s["spec"]["ports"]
    }
    assert served == set(ports.values())


def test_kubernetes_probe_paths_answer_from_the_configmap_config(tmp_path, lbproxy):
    """Run the ConfigMap's configuration (its ports moved to free loopback ones, the
    Secret replaced by a file of the same mode) and ask the probes' paths."""
    found = manifests()
    (deployment,) = [d for (kind, _), d in found.items() if kind == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    configmap = next(d for (kind, _), d in found.items() if kind == "ConfigMap")
    folder = write_configmap(configmap, tmp_path / "etc-lbproxy")
    config = load([str(folder)])
    admin_port = free_port()
    token = tmp_path / "token"
    token.write_text("k8s-token\n")
    token.chmod(0o440)
    text = "\n".join((folder / name).read_text() for name in sorted(configmap["data"]))
    text = text.replace(str(config.global_.admin.listen), f"127.0.0.1:{admin_port}")
    text = text.replace(config.global_.admin.token_file, str(token))
    for vs in config.virtual_servers:
        for address in vs.listen:
            text = text.replace(str(address), f"127.0.0.1:{free_port()}")
    text = text.replace("drain_timeout: 30s", "drain_timeout: 1s")
    proxy = lbproxy(text)
    wait_for(lambda: ready(admin_port), what="/readyz")
    for probe in ("livenessProbe", "readinessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert http("GET", f"http://127.0.0.1:{admin_port}{path}")[0] == 200
    # the token from the mounted file is the one changes need
    url = f"http://127.0.0.1:{admin_port}/api/v1/reload"
    assert http("POST", url, {})[0] == 401
    assert http("POST", url, {}, token="k8s-token")[0] == 200
    assert proxy.proc.poll() is None


# -- Grafana -------------------------------------------------------------------------------


def dashboard_queries(node) -> list[str]:
    """Every PromQL text in a Grafana dashboard: targets' `expr` and variables' queries."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            promql = key in ("expr", "definition") or (key == "query" and "lbproxy_" in value)
            if isinstance(value, str) and promql:
                found.append(value)
            else:
                found += dashboard_queries(value)
    elif isinstance(node, list):
        for item in node:
            found += dashboard_queries(item)
    return found


def test_grafana_dashboard_names_only_metrics_lbproxy_exports(name_servers, lbproxy):
    dashboard = json.loads((CONTRIB / "grafana" / "lbproxy.json").read_text())
    queries = dashboard_queries(dashboard)
    assert len(queries) >= 20
    named = {name for query in queries for name in re.findall(r"\blbproxy_[a-z0-9_]+", query)}
    # A real lbproxy with everything the dashboard shows: two workers (the supervisor's
    # own metrics), an SNMP-polled virtual server (no agent: polls fail) and a throttle.
    servers = name_servers("a", "b")
    port, polled_port, admin_port = free_port(), free_port(), free_port()
    config = with_admin(vs_config(port, servers, "rr", "health_check: {type: none}"), admin_port)
    config = config.replace("global:\n", "global:\n  workers: 2\n", 1)
    config += (
        "  - name: polled\n"
        f"    listen: 127.0.0.1:{polled_port}\n"
        "    scheduler: dwd\n"
        f"    snmp: {{port: {free_port()}, timeout: 200ms, interval: 1s}}\n"
        "    throttle: {max_connections: 100}\n"
        "    real_servers:\n"
        f"      - {{name: a, address: 127.0.0.1:{servers[0].port}}}\n"
    )
    lbproxy(config)
    wait_for(lambda: ready(admin_port), timeout=20, what="/readyz")
    status, body = http("GET", f"http://127.0.0.1:{admin_port}/metrics")
    assert status == 200
    exported = {
        sample.name
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }
    missing = sorted(named - exported)
    assert not missing, f"the dashboard queries metrics /metrics does not export: {missing}"
    # and it shows every metric of the reference (SPEC §8) and the supervisor's two
    shown = {re.sub(r"_(total|bucket|sum|count)$", "", name) for name in named}
    assert shown >= REFERENCE_METRICS, REFERENCE_METRICS - shown


def test_every_grafana_panel_uses_the_data_source_variable():
    dashboard = json.loads((CONTRIB / "grafana" / "lbproxy.json").read_text())
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]


# -- contrib/cluster: three instances and Redis (docker compose) ---------------------------

COMPOSE = CONTRIB / "cluster" / "compose.yaml"


def with_key_file(folder: Path, tmp_path: Path) -> Path:
    """A copy of the example's configuration folder whose key_file (a compose secret,
    /run/secrets/cluster.key) is a key file in `tmp_path`."""
    key = tmp_path / "cluster.key"
    key.write_text("e" * 64 + "\n")
    key.chmod(0o600)
    copy = tmp_path / "lbproxy"
    copy.mkdir()
    for path in folder.glob("*.yaml"):
        (copy / path.name).write_text(path.read_text().replace(CLUSTER_KEY_FILE, str(key)))
    return copy


CLUSTER_KEY_FILE = "/run/secrets/cluster.key"


def test_the_cluster_example_agrees_with_the_configuration_it_mounts(tmp_path):
    document = yaml.safe_load(COMPOSE.read_text())
    services = document["services"]
    lbproxies = {name: s for name, s in services.items() if s.get("image") == "lbproxy"}
    assert sorted(lbproxies) == ["lb1", "lb2", "lb3"]
    # one configuration for all: the folder mounted at /etc/lbproxy, where the image runs it
    (mount,) = {volume for s in lbproxies.values() for volume in s["volumes"]}
    source, target, mode = mount.split(":")
    assert (target, mode) == ("/etc/lbproxy", "ro")
    assert 'CMD ["run", "/etc/lbproxy"]' in dockerfile()
    shipped = COMPOSE.parent / source
    folder = with_key_file(shipped, tmp_path)
    check = run_cli("check", str(folder))
    assert check.returncode == 0, check.stdout + check.stderr
    from tests.unit.config.support import schema_validator

    for path in sorted(shipped.glob("*.yaml")):  # and editors that read the schema agree
        assert path.read_text().startswith(
            "# yaml-language-server: $schema=../../../docs/lbproxy.schema.json\n"
        )
        assert (path.parent / "../../../docs/lbproxy.schema.json").resolve().exists()
        assert list(schema_validator().iter_errors(yaml.safe_load(path.read_text()))) == []
    config = load([str(folder)])
    redis = config.global_.cluster.redis
    assert redis is not None and redis.name is None  # the member name is the host name
    assert sorted(s["hostname"] for s in lbproxies.values()) == ["lb1", "lb2", "lb3"]
    # Redis: the compose service, with the password from the secret both sides mount
    url = urllib.parse.urlsplit(redis.url)
    assert url.hostname in services and "redis-server" in " ".join(
        services[url.hostname]["command"]
    )
    secret_of = {
        name: {s["target"]: s["source"] for s in service.get("secrets", [])}
        for name, service in services.items()
    }
    for name in lbproxies:
        assert redis.password_file in secret_of[name]
        assert CLUSTER_KEY_FILE in secret_of[name]  # the cluster's key: the instances only
    assert (shipped / "global.yaml").read_text().count(f"key_file: {CLUSTER_KEY_FILE}") == 1
    (secret,) = set(secret_of[url.hostname].values())
    assert secret_of["lb1"][redis.password_file] == secret
    assert "--requirepass" in services[url.hostname]["command"][-1]
    assert document["secrets"][secret]["file"] == "./redis.password"
    assert document["secrets"][secret_of["lb1"][CLUSTER_KEY_FILE]]["file"] == "./cluster.key"
    ignored = (COMPOSE.parent / ".gitignore").read_text().split()
    assert "redis.password" in ignored and "cluster.key" in ignored
    for name in lbproxies:  # the image's user can read them
        for grant in lbproxies[name]["secrets"]:
            assert grant["uid"] == "10001" and grant["mode"] == 0o400
        assert "--uid 10001" in dockerfile()
    # real servers: compose services on the port they listen on
    for vs in config.virtual_servers:
        for rs in vs.real_servers:
            assert rs.address.host in services, rs
            assert str(rs.address.port) in services[rs.address.host]["command"]
    # ports: each instance publishes the listener and the admin endpoint, on its own host ports
    wanted = {
        config.global_.admin.listen.port,
        *(a.port for vs in config.virtual_servers for a in vs.listen),
    }
    published = []
    for service in lbproxies.values():
        pairs = [port.split(":") for port in service["ports"]]
        assert {int(inside) for _, inside in pairs} == wanted
        published += [int(outside) for outside, _ in pairs]
    assert len(set(published)) == len(published)
    # stopping waits for the drain
    for service in lbproxies.values():
        assert seconds(service["stop_grace_period"]) > config.global_.drain_timeout


def test_the_cluster_example_runs_as_a_cluster(tmp_path, lbproxy):
    """Its files with a real redis-server and two `lbproxy run`: the addresses that
    compose resolves replaced by loopback ones, everything else as shipped."""
    from tests.integration.redis_server import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        tools.missing("redis-server", "redis-server")
    config = load([str(with_key_file(COMPOSE.parent / "lbproxy", tmp_path))])
    redis_config = config.global_.cluster.redis
    secret = tmp_path / "redis.password"
    secret.write_text("example-secret\n")
    secret.chmod(0o600)
    with RedisServer(tmp_path / "redis").start(password="example-secret") as redis:
        instances = []
        try:
            for name in ("lb1", "lb2"):
                admin, port = free_port(), free_port()
                text = "\n".join(
                    (COMPOSE.parent / "lbproxy" / f).read_text()
                    for f in ("global.yaml", "web.yaml")
                )
                text = (
                    text.replace(redis_config.url, redis.url)
                    .replace(redis_config.password_file, str(secret))
                    .replace(CLUSTER_KEY_FILE, str(tmp_path / "cluster.key"))
                    .replace("0.0.0.0:9100", f"127.0.0.1:{admin}")
                    .replace("0.0.0.0:8080", f"127.0.0.1:{port}")
                    .replace("# name:", f"name: {name} #")
                )
                for app in ("app-1", "app-2", "app-3"):
                    text = text.replace(f"{app}:8000", f"127.0.0.1:{free_port()}")
                proxy = lbproxy(text, [admin], folder=tmp_path / name)
                instances.append((proxy, admin))

            def document(admin: int) -> dict:
                status, body = http("GET", f"http://127.0.0.1:{admin}/api/v1/virtual-servers")
                assert status == 200
                return json.loads(body)

            for _, admin in instances:
                wait_for(lambda a=admin: document(a)["cluster"]["connected"], 10.0, "connected")
            (_, one), (_, two) = instances
            status, _ = local_http(
                "PATCH", f"http://127.0.0.1:{one}/api/v1/virtual-servers/web/real-servers/app-2",
                {"state": "drain"},
            )  # fmt: skip
            assert status == 200

            def state(admin: int) -> str:
                (vs,) = document(admin)["virtual_servers"]
                return next(rs["state"] for rs in vs["real_servers"] if rs["name"] == "app-2")

            wait_for(lambda: state(two) == "drain", 2.0, "the drain on the other instance")
        finally:
            for proxy, _ in instances:
                proxy.stop()
