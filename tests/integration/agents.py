"""A server's agent for the agent-check tests (test_agent_check.py, the dashboard's): a
thread TCP server on loopback answering the line a test chooses, changed between checks."""

from __future__ import annotations

import socket
import socketserver
import threading

from tests.integration.harness import free_port

SILENT = None  # the agent accepts and says nothing until lbproxy gives up


class _AgentHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        agent: Agent = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        sock.settimeout(10)
        with agent.lock:
            answer = agent.answer
            agent.asked += 1
        try:
            if agent.expect_send:
                agent.received.append(sock.recv(100))
            if answer is SILENT:
                while sock.recv(100):  # until lbproxy's timeout closes it
                    pass
                return
            sock.sendall(answer)
        except OSError:
            pass


class Agent(socketserver.ThreadingTCPServer):
    """A server's agent: answers `answer` (bytes; SILENT: nothing) to every check and
    closes; `asked` counts the checks."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, answer: bytes | None, expect_send: bool = False) -> None:
        self.answer = answer
        self.asked = 0
        self.expect_send = expect_send
        self.received: list[bytes] = []
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", free_port()), _AgentHandler)
        self.port = self.server_address[1]
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def say(self, answer: bytes | None) -> None:
        with self.lock:
            self.answer = answer

    def stop(self) -> None:
        self.shutdown()
        self.server_close()
