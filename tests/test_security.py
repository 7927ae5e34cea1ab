"""The runner sockets live in a folder only the serving user can open, gone after exit."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from tests.conftest import Server, cmdline


def socket_folder(server: Server) -> Path:
    for pid in server.runners():
        words = cmdline(pid).split(b"\0")
        address = words[words.index(b"--address") + 1].decode()
        return Path(address.removeprefix("unix:")).parent
    raise AssertionError("no runner process found")


def test_runner_sockets_are_private_to_the_serving_user_and_removed_on_exit(
    serve: object,
) -> None:
    server: Server = serve()  # type: ignore[operator]
    folder = socket_folder(server)
    info = folder.stat()
    assert stat.S_IMODE(info.st_mode) == 0o700
    assert info.st_uid == os.getuid()
    sockets = sorted(path.name for path in folder.glob("*.sock"))
    assert sockets == [
        "iris_clf-0.sock", "mlp-0.sock", "text-0.sock", "text_features-0.sock", "tokenize-0.sock"
    ]
    assert all(stat.S_ISSOCK((folder / name).stat().st_mode) for name in sockets)
    assert server.stop() == 0
    assert not folder.exists()
