"""The keys of TLS and HTTPS health checks (SPEC §22): how each value is read, which check
types take them, and how `lbproxy check` describes such a check.

PURE in the sense of the configuration package (no trio, no sockets, no clock); like
secret_files.py it reads a file: `verify` names a CA file, read here so that a missing or
unreadable one, or one without a certificate, is a FILE:LINE error at load, not a check
that fails at run time.

The rules across keys (`misplaced_keys`):
- `tls: true` is for the checks whose servers may speak implicit TLS (TLS_OVER): `http`
  (HTTPS), `send_expect`, `redis`, `smtp` (SMTPS); not for `pgsql` nor `mysql`, which
  start TLS inside their own protocol (a handshake first would not be understood), and
  not for `tls` (TLS already);
- `sni` and `verify` need a check that speaks TLS: `type: tls`, or one with `tls: true`;
- `alpn` is for `tls` (an HTTPS check speaks HTTP/1.1 and offers nothing else);
- `method`, `host` and `expect_body` are for `http` (and `expect_body` not with HEAD).
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from collections.abc import Collection

import yaml

from lbproxy.config.model import HealthCheckConfig
from lbproxy.config.values import Invalid, accepting, scalar, shown

# RFC 1123 host names (lower-cased, without a final dot): what a server name may be.
_SERVER_NAME = re.compile(r"(?=.{1,253}$)[a-z0-9_](?:[a-z0-9_-]{0,62})(?:\.[a-z0-9_-]{1,63})*")
# RFC 9110 §9.1: a method is a token; the registered ones are upper case.
_METHOD = re.compile(r"[A-Z][A-Z0-9_-]{0,31}")
# A Host header: a name or an IP, with an optional port ([v6] in brackets). No spaces, no
# CR or LF: the value goes into a request line by line.
_HOST_HEADER = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")
# RFC 7301: a protocol name is 1 to 255 bytes; printable ASCII is all anyone uses.
_ALPN_NAME = re.compile(r"[\x21-\x7e]{1,255}")

TLS_TYPES = ("tls",)  # check types that are TLS whatever else they say
# Check types that run over TLS with `tls: true` (implicit TLS, as HAProxy's check-ssl).
TLS_OVER = ("http", "send_expect", "redis", "smtp")
# Check types whose protocol starts TLS itself: why `tls: true` is refused there.
_TLS_INSIDE = {
    "pgsql": "PostgreSQL starts TLS inside its protocol (SSLRequest)",
    "mysql": "MySQL starts TLS inside its handshake",
}


def speaks_tls(check: HealthCheckConfig) -> bool:
    """The check's connection starts with a TLS handshake."""
    return check.type in TLS_TYPES or (check.type in TLS_OVER and check.tls)


@accepting(
    "a server name like db.example.com",
    {"type": "string", "pattern": r"^[A-Za-z0-9_.-]+$"},
)
def server_name(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    requirement = f"{label} must be a server name like db.example.com, got {shown(node)}"
    if not isinstance(value, str):
        raise Invalid(requirement, node)
    name = value.lower().removesuffix(".")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        pass
    else:  # RFC 6066 §3: never an IP literal
        raise Invalid(
            f"{label}: an IP address is not sent as a server name; leave {label} out "
            "and the address is verified",
            node,
        )
    if not _SERVER_NAME.fullmatch(name) or ".." in name:
        raise Invalid(requirement, node)
    return name


@accepting(
    "a protocol name like h2 or http/1.1, or a list of them",
    {
        "anyOf": [
            {"type": "string", "minLength": 1, "maxLength": 255},
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1, "maxLength": 255},
                "minItems": 1,
            },
        ]
    },
)
def alpn_protocols(node: yaml.Node, label: str) -> tuple[str, ...]:
    items = node.value if isinstance(node, yaml.SequenceNode) else [node]
    if not items:
        raise Invalid(f"{label} must name at least one protocol", node)
    names = []
    for item in items:
        value = scalar(item, label)
        if not isinstance(value, str) or not _ALPN_NAME.fullmatch(value):
            raise Invalid(
                f"{label} must be protocol names like h2 or http/1.1 (printable ASCII, "
                f"at most 255 characters), got {shown(item)}",
                item,
            )
        names.append(value)
    return tuple(names)


def ca_file_problem(path: str) -> str | None:
    """Why `path` cannot serve as the CA file of a check, or None."""
    if not os.path.exists(path):
        return f"{path} does not exist"
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    try:
        context.load_verify_locations(cafile=path)
    except ssl.SSLError:  # an OSError too: first
        return f"{path} holds no PEM certificate"
    except OSError as exc:
        return f"cannot read {path}: {(exc.strerror or str(exc)).lower()}"
    if not context.get_ca_certs():
        return f"{path} holds no CA certificate"
    return None


@accepting(
    "none, or the path of a PEM file of CA certificates",
    {"anyOf": [{"const": "none"}, {"type": "string", "minLength": 1}]},
)
def verify_with(node: yaml.Node, label: str) -> str | None:
    value = scalar(node, label)
    if value == "none":
        return None
    if not isinstance(value, str) or not value:
        raise Invalid(f"{label} must be none or the path of a CA file, got {shown(node)}", node)
    problem = ca_file_problem(value)
    if problem:
        raise Invalid(f"{label}: {problem}", node)
    return value


@accepting("an HTTP method like GET, HEAD or OPTIONS", {"type": "string", "pattern": "^[A-Z]"})
def http_method(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not _METHOD.fullmatch(value):
        raise Invalid(
            f"{label} must be an HTTP method like GET, HEAD or OPTIONS (upper case), "
            f"got {shown(node)}",
            node,
        )
    return value


@accepting(
    "a host name or IP, with an optional :PORT",
    {"type": "string", "pattern": r"^[A-Za-z0-9_.\[\]:-]+$"},
)
def host_header(node: yaml.Node, label: str) -> str:
    value = scalar(node, label)
    if not isinstance(value, str) or not _HOST_HEADER.fullmatch(value):
        raise Invalid(
            f"{label} must be a host name or IP with an optional :PORT (the Host header), "
            f"got {shown(node)}",
            node,
        )
    return value


def misplaced_keys(check: HealthCheckConfig, written: Collection[str]) -> list[tuple[str, str]]:
    """(key, message) for each key written that the check's type does not take."""
    problems = []
    if "tls" in written and check.type not in TLS_OVER:
        allowed = f"{', '.join(TLS_OVER[:-1])} and {TLS_OVER[-1]}"
        if check.type in _TLS_INSIDE:
            why = _TLS_INSIDE[check.type]
            message = (
                f"health_check.tls is not for {check.type} checks: {why}, which the check "
                f"does not do (tls is for {allowed} checks)"
            )
        else:
            hint = " (a tls check is TLS already)" if check.type == "tls" else ""
            message = f"health_check.tls is for {allowed} checks{hint}"
        problems.append(("tls", message))
    for key in ("sni", "verify"):
        if key in written and not speaks_tls(check):
            problems.append((key, f"health_check.{key} needs type: tls, or a check with tls: true"))
    if "alpn" in written and check.type != "tls":
        problems.append(("alpn", "health_check.alpn is for tls checks"))
    for key in ("method", "host", "expect_body"):
        if key in written and check.type != "http":
            problems.append((key, f"health_check.{key} is for http checks"))
    if "expect_body" in written and check.type == "http" and check.method == "HEAD":
        problems.append(("expect_body", "health_check.expect_body: a HEAD answer has no body"))
    return problems


def describe(check: HealthCheckConfig) -> str | None:
    """What a person would call a tls or http check, or None for the other types:
    `tls with SNI db.example (ALPN h2, verified by ca.pem)`, `https GET /primary
    expecting 200 and a body matching 'running' (not verified)`."""
    details = []
    if check.type == "tls":
        text = "tls" + (f" with SNI {check.sni}" if check.sni else "")
        if check.send is not None:
            text += f", sending {check.send!r}"
        if check.expect is not None:
            text += f", expecting {check.expect!r}"
        if check.alpn:
            details.append(f"ALPN {', '.join(check.alpn)}")
    elif check.type == "http":
        statuses = " or ".join(str(code) for code in check.expect_status)
        text = f"{'https' if check.tls else 'http'} {check.method} {check.path}"
        if check.host:
            text += f" (Host {check.host})"
        text += f" expecting {statuses}"
        if check.expect_body is not None:
            text += f" and a body matching {check.expect_body!r}"
        if check.tls and check.sni:
            details.append(f"SNI {check.sni}")
    else:
        return None
    if speaks_tls(check):
        details.append(f"verified by {check.verify}" if check.verify else "not verified")
    return f"{text} ({', '.join(details)})" if details else text
