"""What the supervisor and a worker say to each other: both ends read the messages here.

They talk over a socketpair the worker inherits (`lbproxy run --worker-fd FD`), in frames
with descriptors (lbproxy/wire/fd_frames.py, sent and received by
lbproxy/net/fd_channel.py, the framing an upgrade's hand-over uses too):

    supervisor -> worker
      Init                      first, pickled: the running configuration (a restarted
                                worker runs what the others run, even when the files were
                                edited since), the worker's index and admin socket path,
                                the TCP listening sockets it inherits (pass_fds keeps
                                their numbers) and the secret files read before the drop
      {"listeners": [KEY, ...]}  with one descriptor per key, in order: the TCP listening
                                sockets a reload adds, kept for that reload
      {"upgraded": true}        a new supervisor serves: close the UDP sockets now
      {"state": true}           an upgrade is starting: what its new workers start from
    worker -> supervisor
      {"ready": true}           every listener is bound
      {"error": MESSAGE}        it cannot start; it exits 1
      {"taken": true}           the answer to "listeners" and "upgraded"
      {"state": SNAPSHOT}       the answer to "state": the worker's runtime state with its
                                servers' health and timelines (runtime/state.py
                                `snapshot(..., handover=True)`), as text

The worker reads on until end of file, which means the supervisor is gone (killed, even
with SIGKILL): it then stops accepting and drains, so no orphan keeps the ports. The
supervisor reads on until end of file too, which means the worker has exited.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from lbproxy.config.model import Config
from lbproxy.net.fd_channel import Channel, close_all
from lbproxy.wire.fd_frames import FrameError, decode_document, encode_document

READY = "ready"
ERROR = "error"
TAKEN = "taken"
LISTENERS = "listeners"
UPGRADED = "upgraded"
STATE = "state"


@dataclass(frozen=True)
class Init:
    """The first message, the supervisor's: everything a worker starts from."""

    config: Config
    index: int  # 1..N, the worker slot's
    admin: str  # the path of the worker's admin socket
    listeners: dict[str, int]  # the inherited TCP listening sockets' numbers, by address
    secrets: dict[str, str]  # lbproxy/config/secret_files.py, by path
    # An upgrade's first workers only: one old worker's "state" answer, restored before
    # the first accept as a process without workers restores its old process's.
    state: str | None = None


def encode_init(init: Init) -> bytes:
    return pickle.dumps(init)


def decode_init(body: bytes) -> Init:
    """The Init in `body`; ValueError (or pickle's own errors) when it is none. Unpickled:
    the socketpair is the supervisor's and this worker's alone."""
    init = pickle.loads(body)
    if not isinstance(init, Init):
        raise ValueError(f"the first message is a {type(init).__name__}, not the Init")
    return init


@dataclass
class Message:
    """One message after the Init: its document and the descriptors that came with it."""

    document: dict[str, Any]
    fds: list[int]

    def says(self, kind: str) -> bool:
        return kind in self.document

    @property
    def error(self) -> str:
        return str(self.document.get(ERROR, ""))

    @property
    def listener_keys(self) -> list[str]:
        keys = self.document.get(LISTENERS)
        if not isinstance(keys, list):
            return []
        return [key for key in keys if isinstance(key, str)]


def message(kind: str, value: Any = True) -> bytes:
    """A message's frame body: {kind: value}."""
    return encode_document({kind: value})


async def send(channel: Channel, kind: str, value: Any = True, fds: Sequence[int] = ()) -> None:
    await channel.send(message(kind, value), fds)


async def receive(channel: Channel) -> Message | None:
    """The next message; None at end of file; FrameError for one that is not a message
    of this protocol (its descriptors closed)."""
    received = await channel.receive()
    if received is None:
        return None
    try:
        return Message(decode_document(received.body), received.fds)
    except FrameError:
        close_all(received.fds)
        raise
