"""lbproxy/admin/http_server.py in-process, over real loopback and Unix sockets, with small
ASGI apps that do what the admin apps never do: raise, stream, answer nothing, hang.

(What the admin app itself sees through a real `lbproxy run` is in test_admin_http.py.)
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile

import h11
import trio

from lbproxy.admin import http_server


async def read_all(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some(65536):
        data += chunk
    return data


async def exchange(port: int, request: bytes) -> list:
    """Send `request`, read until the server closes; the h11 events of the answers."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        await stream.send_eof()
        data = await read_all(stream)
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))
    client.send(h11.EndOfMessage())
    client.receive_data(data)
    client.receive_data(b"")
    events = []
    while True:
        try:
            event = client.next_event()
        except h11.RemoteProtocolError as exc:  # the answer was cut: what came, then this
            events.append(exc)
            return events
        if event is h11.PAUSED:  # one answer done, the next follows (pipelined)
            client.start_next_cycle()
            client.send(h11.Request(method="GET", target="/", headers=[("host", "t")]))
            client.send(h11.EndOfMessage())
            continue
        events.append(event)
        if type(event) is h11.ConnectionClosed or event is h11.NEED_DATA:
            return events


def serving(app, body, family=socket.AF_INET):
    """Run `body(address)` against `app` served on a fresh socket; then stop the server
    (cancel, as the callers do) and return what body returned."""

    async def main():
        if family == socket.AF_UNIX:
            folder = tempfile.mkdtemp()
            address = os.path.join(folder, "admin.sock")
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(address)
        else:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            address = sock.getsockname()[1]
        sock.listen(16)
        with trio.fail_after(10):
            async with trio.open_nursery() as nursery:
                await nursery.start(http_server.serve, app, sock)
                result = await body(address)
                nursery.cancel_scope.cancel()
        sock.close()
        return result

    return trio.run(main)


async def answer(send, status=200, body=b"ok\n"):
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


def test_an_app_that_raises_gets_a_500_logged_once_and_the_server_goes_on(caplog):
    async def app(scope, receive, send):
        if scope["type"] == "http":
            if scope["path"] == "/boom":
                raise ValueError("a bug")
            await answer(send)

    async def body(port):
        first = await exchange(port, b"GET /boom HTTP/1.1\r\nHost: t\r\n\r\n")
        second = await exchange(port, b"GET /fine HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        return first, second

    with caplog.at_level(logging.ERROR, "lbproxy.http_server"):
        first, second = serving(app, body)
    assert first[0].status_code == 500 and (b"connection", b"close") in first[0].headers
    assert first[1].data == b'{"error": "internal error"}\n'
    assert type(first[-1]) is h11.ConnectionClosed
    assert second[0].status_code == 200 and second[1].data == b"ok\n"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "GET /boom failed" in errors[0].getMessage()
    assert errors[0].exc_info[0] is ValueError


def test_an_app_that_answers_nothing_or_half_an_answer():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        if scope["path"] == "/half":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"part", "more_body": True})

    async def body(port):
        nothing = await exchange(port, b"GET /nothing HTTP/1.1\r\nHost: t\r\n\r\n")
        half = await exchange(port, b"GET /half HTTP/1.1\r\nHost: t\r\n\r\n")
        return nothing, half

    nothing, half = serving(app, body)
    assert nothing[0].status_code == 500
    assert half[0].status_code == 200 and (b"transfer-encoding", b"chunked") in half[0].headers
    assert half[1].data == b"part" and isinstance(half[-1], h11.RemoteProtocolError)  # cut


def test_a_streamed_answer_is_chunked_and_keep_alive_goes_on():
    async def app(scope, receive, send):
        if scope["type"] == "http":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            for part in (b"a", b"b", b"c"):
                await send({"type": "http.response.body", "body": part, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def body(port):
        return await exchange(port, b"GET / HTTP/1.1\r\nHost: t\r\n\r\n" * 2)

    events = serving(app, body)
    data = [e.data for e in events if type(e) is h11.Data]
    assert data == [b"a", b"b", b"c"] * 2 and type(events[-1]) is h11.ConnectionClosed
    assert [type(e) for e in events].count(h11.EndOfMessage) == 2
    responses = [e for e in events if type(e) is h11.Response]
    assert len(responses) == 2
    assert all((b"transfer-encoding", b"chunked") in e.headers for e in responses)


def test_scope_receive_and_lifespan_over_a_unix_socket():
    seen = []

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                seen.append(message["type"])
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        seen.append(scope)
        seen.append(await receive())
        seen.append(await receive())
        await answer(send)

    async def body(path):
        stream = await trio.open_unix_socket(path)
        async with stream:
            await stream.send_all(
                b"POST /a%20b/c?x=1&y=2 HTTP/1.1\r\nHost: t\r\nX-Thing: V\r\n"
                b"Content-Length: 5\r\nConnection: close\r\n\r\nhello"
            )
            return await read_all(stream)

    data = serving(app, body, socket.AF_UNIX)
    assert data.startswith(b"HTTP/1.1 200 ") and data.endswith(b"\r\n\r\nok\n")
    assert seen[0] == "lifespan.startup" and seen[-1] == "lifespan.shutdown"
    scope, first, second = seen[1:4]
    assert (scope["method"], scope["path"], scope["raw_path"]) == ("POST", "/a b/c", b"/a%20b/c")
    assert scope["query_string"] == b"x=1&y=2" and scope["http_version"] == "1.1"
    assert (b"x-thing", b"V") in scope["headers"] and scope["client"] is None
    assert first == {"type": "http.request", "body": b"hello", "more_body": False}
    assert second == {"type": "http.disconnect"}


def test_stop_lets_an_answer_finish_closes_idle_connections_and_cuts_a_hung_app():
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await trio.sleep(0.3 if scope["path"] == "/slow" else 60)
        await answer(send)

    results = {}

    async def main():
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        port = sock.getsockname()[1]
        with trio.fail_after(10):
            await serve_and_stop(sock, port)
        sock.close()

    async def serve_and_stop(sock, port):
        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as server:
                await server.start(http_server.serve, app, sock)

                async def client(name, request):
                    stream = await trio.open_tcp_stream("127.0.0.1", port)
                    async with stream:
                        if request:
                            await stream.send_all(request)
                        results[name] = (await read_all(stream), trio.current_time())

                for name, request in (
                    ("idle", b""),
                    ("slow", b"GET /slow HTTP/1.1\r\nHost: t\r\n\r\n"),
                    ("hung", b"GET /hung HTTP/1.1\r\nHost: t\r\n\r\n"),
                ):
                    outer.start_soon(client, name, request)
                await trio.sleep(0.1)
                results["stop"] = trio.current_time()
                server.cancel_scope.cancel()
            results["stopped"] = trio.current_time()

    trio.run(main)
    stop = results["stop"]
    assert results["idle"][0] == b"" and results["idle"][1] - stop < 0.1
    assert results["slow"][0].startswith(b"HTTP/1.1 200 ") and results["slow"][0].endswith(b"ok\n")
    assert results["hung"][0] == b""
    assert http_server.GRACE - 0.1 < results["hung"][1] - stop < http_server.GRACE + 0.6
    assert results["stopped"] - stop < http_server.GRACE + 1.2
