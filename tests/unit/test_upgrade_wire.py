"""The hand-over's wire (lbproxy/runtime/upgrade.py): JSON and descriptors over a real
Unix socketpair, more descriptors than one sendmsg may carry."""

from __future__ import annotations

import os
import socket
import threading

from lbproxy.runtime.upgrade import receive_message, send_message
from lbproxy.wire.fd_frames import SCM_MAX_FD


def test_a_message_with_more_descriptors_than_one_sendmsg_carries():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    pipes = [os.pipe() for _ in range(SCM_MAX_FD + 50)]
    document = {"sockets": [f"s{i}" for i in range(len(pipes))], "state": "x" * 300_000}
    try:
        # A large state: the sender blocks until the receiver reads, as in an upgrade.
        sender = threading.Thread(target=send_message, args=(ours, document, [w for _, w in pipes]))
        sender.start()
        received, fds = receive_message(theirs)
        sender.join(10)
        assert received == document
        assert len(fds) == len(pipes)
        for (read_end, _), fd in zip(pipes, fds, strict=True):  # the same pipes, in order
            os.write(fd, b"!")
            assert os.read(read_end, 1) == b"!"
            os.close(fd)
    finally:
        for read_end, write_end in pipes:
            os.close(read_end)
            os.close(write_end)
        ours.close()
        theirs.close()


def test_end_of_file_before_a_whole_message_is_none():
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    ours.sendall(b"\x00\x00\x00\x10{")  # 16 bytes announced, 1 sent
    ours.close()
    assert receive_message(theirs) == (None, [])
    theirs.close()
