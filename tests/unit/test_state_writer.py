"""StateWriter's file handling (lbproxy/runtime/state.py): atomic, private, one writer."""

from __future__ import annotations

import os

from lbproxy.runtime.state import StateWriter, write_atomically


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary_file(tmp_path):
    path = tmp_path / "state.json"
    path.write_bytes(b"old")
    write_atomically(str(path), b"new")
    assert path.read_bytes() == b"new"
    assert path.stat().st_mode & 0o777 == 0o600
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_file_another_process_wrote_since_ends_this_writer(tmp_path):
    path = str(tmp_path / "state.json")
    writer = StateWriter(server=None)  # type: ignore[arg-type]
    assert writer._write(path, b"mine 1") and writer._write(path, b"mine 2")
    write_atomically(path, b"the new process's")  # as an upgrade's new lbproxy does
    assert not writer._write(path, b"stale")
    assert not writer.enabled
    assert (tmp_path / "state.json").read_bytes() == b"the new process's"


def test_a_failed_write_keeps_the_old_file(tmp_path):
    folder = tmp_path / "gone"
    writer = StateWriter(server=None)  # type: ignore[arg-type]
    assert not writer._write(str(folder / "state.json"), b"x")  # no such folder: logged
    assert writer.enabled  # retried at the next look
