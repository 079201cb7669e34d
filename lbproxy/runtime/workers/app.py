"""The supervisor's admin endpoint (the package header, lbproxy/runtime/workers/__init__.py)."""

from __future__ import annotations

import urllib.parse
from collections.abc import Sequence
from typing import Any, Protocol

from lbproxy.admin import dashboard
from lbproxy.admin.api import (
    AdminApp,
    Answer,
    asked_by,
    json_body,
    parse_explain_client,
    parse_listing_limit,
    read_body,
)
from lbproxy.admin.routes import HTTPError, Request


class WorkerSlot(Protocol):
    @property
    def ready(self) -> bool: ...  # its process has bound every listener and caught up

    @property
    def ever_ready(self) -> bool: ...  # some process of the slot was ready once


class Supervisor(Protocol):
    """What the app asks of the supervisor (supervisor.py's Supervisor): its workers'
    states, and the merged answers and changes it gets from them."""

    @property
    def workers(self) -> Sequence[WorkerSlot]: ...

    @property
    def draining(self) -> bool: ...

    async def metrics(self) -> bytes: ...

    async def workers_document(self) -> dict[str, Any]: ...

    async def worker_document(self, index: int) -> dict[str, Any]: ...

    async def merged_document(self) -> dict[str, Any]: ...

    async def patch(self, vs_name: str, rs_name: str, body: bytes) -> tuple[int, bytes]: ...

    async def reload(self, config_paths: list[str] | None = None) -> tuple[bool, list[str]]: ...

    async def locate(
        self, path: str, vs_name: str = "", client: tuple | None = None
    ) -> tuple[int, bytes]: ...

    async def report_load(self, path: str, body: bytes) -> tuple[int, bytes]: ...

    async def explain(self, path: str) -> tuple[int, bytes]: ...

    async def shutdown_sessions(self, vs_name: str, rs_name: str) -> tuple[int, bytes]: ...

    async def add_server(self, vs_name: str, body: bytes) -> tuple[int, bytes]: ...

    async def remove_server(self, vs_name: str, rs_name: str) -> tuple[int, bytes]: ...

    async def per_source(self, vs_name: str, limit: int) -> tuple[int, bytes]: ...

    async def clear_per_source(
        self, vs_name: str, network: str | None, who: str
    ) -> tuple[int, bytes]: ...


class SupervisorApp(AdminApp):
    """AdminApp's routes (admin/routes.py), answered from the workers, and the workers'
    own routes besides. The matching, the method check and the authorization are
    AdminApp's; each handler here replaces the single process's."""

    def __init__(
        self, supervisor: Supervisor, token: str | None, socket_path: str | None = None
    ) -> None:
        # Not a ProxyControl: its changes are async, sent to every worker. Each handler
        # that would call a ProxyControl method is replaced below; what AdminApp's own
        # code still reads (config, config_paths; upgrade and admin_sock through
        # getattr) it has.
        self.server = supervisor  # type: ignore[assignment]  # see above
        self.supervisor = supervisor
        self.token = token
        self.socket_path = socket_path

    # /api/v1/upgrade: AdminApp's handler, through Supervisor.upgrade.

    async def on_dashboard(self, request: Request) -> Answer:
        return 200, dashboard.page(), "html"  # the same page, fed by the merged document

    async def on_metrics(self, request: Request) -> Answer:
        return 200, await self.supervisor.metrics(), "metrics"

    async def on_readyz(self, request: Request) -> Answer:
        supervisor = self.supervisor
        workers = supervisor.workers
        if supervisor.draining:
            return 503, b"draining\n", "text"
        if all(w.ever_ready for w in workers) and any(w.ready for w in workers):
            return 200, b"ready\n", "text"
        return 503, b"starting\n", "text"

    def worker_count(self) -> int:
        return len(self.supervisor.workers)

    async def on_workers(self, request: Request) -> Answer:
        return 200, json_body(await self.supervisor.workers_document()), "json"

    async def on_worker(self, request: Request) -> Answer:
        index = request.params[0]
        if not index.isdigit():
            raise HTTPError(404, f"no such path: {request.path}")
        return 200, json_body(await self.supervisor.worker_document(int(index))), "json"

    async def on_virtual_servers(self, request: Request) -> Answer:
        return 200, json_body(await self.supervisor.merged_document()), "json"

    async def on_virtual_server(self, request: Request) -> Answer:
        document = await self.supervisor.merged_document()
        return 200, json_body(_find(document, request.params[0])), "json"

    async def on_real_server(self, request: Request) -> Answer:
        vs_name, rs_name = request.params
        supervisor = self.supervisor
        if request.method == "GET":
            vs = _find(await supervisor.merged_document(), vs_name)
            for rs in vs["real_servers"]:
                if rs["name"] == rs_name:
                    return 200, json_body(rs), "json"
            raise HTTPError(404, f"no real server {rs_name!r} in virtual server {vs_name!r}")
        body = await read_body(request.receive)
        if request.method == "DELETE":
            status, answer = await supervisor.remove_server(vs_name, rs_name)
        else:
            status, answer = await supervisor.patch(vs_name, rs_name, body)
        return status, answer, "json"

    async def on_real_servers(self, request: Request) -> Answer:
        body = await read_body(request.receive)
        status, answer = await self.supervisor.add_server(request.params[0], body)
        return status, answer, "json"

    async def on_shutdown_sessions(self, request: Request) -> Answer:
        await read_body(request.receive)  # nothing is read from it
        status, answer = await self.supervisor.shutdown_sessions(*request.params)
        return status, answer, "json"

    async def on_reload(self, request: Request) -> Answer:
        paths = await self._config_paths(request)
        ok, messages = await self.supervisor.reload(paths)
        if ok:
            return 200, json_body({"result": "ok", "changes": messages}), "json"
        messages = self._shown_errors(request, messages)
        return 400, json_body({"error": "invalid configuration", "errors": messages}), "json"

    async def on_locate(self, request: Request) -> Answer:
        (vs_name,) = request.params
        query = request.scope.get("query_string", b"").decode("latin-1")
        target = f"/api/v1/virtual-servers/{urllib.parse.quote(vs_name, safe='')}/locate"
        client = request.scope.get("client")
        status, answer = await self.supervisor.locate(
            target + (f"?{query}" if query else ""),
            vs_name,
            None if client is None else tuple(client),
        )
        return status, answer, "json"

    async def on_explain(self, request: Request) -> Answer:
        (vs_name,) = request.params
        query = request.scope.get("query_string", b"")
        parse_explain_client(query)  # a bad client is refused here, no worker asked
        target = f"/api/v1/virtual-servers/{urllib.parse.quote(vs_name, safe='')}/explain"
        status, answer = await self.supervisor.explain(f"{target}?{query.decode('ascii')}")
        return status, answer, "json"

    async def on_load(self, request: Request) -> Answer:
        body = await read_body(request.receive)  # over 64 KiB: 413, as a PATCH
        quoted = [urllib.parse.quote(name, safe="") for name in request.params]
        status, answer = await self.supervisor.report_load(
            f"/api/v1/virtual-servers/{quoted[0]}/real-servers/{quoted[1]}/load", body
        )
        return status, answer, "json"

    async def on_per_source(self, request: Request) -> Answer:
        """GET: the workers' tables merged; DELETE: every worker clears every network."""
        if request.method == "GET":
            limit = parse_listing_limit(request.scope.get("query_string", b""))
            status, answer = await self.supervisor.per_source(request.params[0], limit)
            return status, answer, "json"
        return await self._clear_per_source(request, None)

    async def _clear_per_source(self, request: Request, network: str | None) -> Answer:
        """Every worker clears (on_per_source_network and _prefix are AdminApp's)."""
        await read_body(request.receive)  # nothing is read from it
        status, answer = await self.supervisor.clear_per_source(
            request.params[0], network, asked_by(request.scope)
        )
        return status, answer, "json"


def _find(document: dict[str, Any], name: str) -> dict[str, Any]:
    for vs in document.get("virtual_servers", []):
        if vs["name"] == name:
            return vs
    raise HTTPError(404, f"no virtual server {name!r}")
