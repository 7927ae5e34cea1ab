"""The handshake's checks, frame by frame, and where a process's token comes from."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest

from batchserve.api.dispatch import Link
from batchserve.runner.core.config import Config, ConfigError, TransportConfig
from batchserve.runner.core.handshake import Refused, admit, answer, opening, welcomed
from batchserve.runner.core.security import Credentials, read_token
from batchserve.runner.core.timeouts import Timeouts
from batchserve.runner.core.wire import (
    PROTOCOL_VERSION,
    Address,
    Call,
    Failure,
    FailureCode,
    FrameReader,
    Hello,
    Welcome,
    decode,
    encode,
)

TOKEN = b"a-token-of-enough-length"


def round_trip(message: object) -> object:
    data = b"".join(bytes(chunk) for chunk in encode(message))  # type: ignore[arg-type]
    (body,) = FrameReader().feed(data)
    return decode(body)


def test_hello_and_welcome_round_trip_exactly() -> None:
    hello = Hello(PROTOCOL_VERSION, "iris_clf", 100, bytes(range(32)), b"p" * 32)
    assert round_trip(hello) == hello
    assert round_trip(Welcome(b"q" * 32)) == Welcome(b"q" * 32)


def test_a_hello_of_another_version_is_read_as_far_as_its_version() -> None:
    body = bytearray(b"\x07" + bytes(8) + (99).to_bytes(2, "little") + b"laid out otherwise")
    assert decode(body) == Hello(99, "", 0, b"")


def handshake(runner_token: bytes | None, api_token: bytes | None) -> None:
    first = opening("m", 8)
    hello = answer(round_trip(first), "m", api_token)  # type: ignore[arg-type]
    welcome = admit(first, round_trip(hello), runner_token)  # type: ignore[arg-type]
    welcomed(first, hello, round_trip(welcome), api_token)  # type: ignore[arg-type]


def test_both_ends_with_the_token_pass() -> None:
    handshake(TOKEN, TOKEN)
    handshake(None, None)


@pytest.mark.parametrize(("runner", "api", "why"), [
    (TOKEN, b"another-token-entirely", "its token does not match this runner's"),
    (TOKEN, None, "it holds no token, and this runner requires one"),
])
def test_the_runner_refuses_a_client_without_the_token(
    runner: bytes, api: bytes | None, why: str
) -> None:
    with pytest.raises(Refused, match=why):
        handshake(runner, api)


def test_the_api_refuses_a_runner_that_cannot_prove_the_token() -> None:
    with pytest.raises(Refused, match="it could not prove it holds the token"):
        handshake(None, TOKEN)


def test_a_proof_is_good_for_one_connection_only() -> None:
    first = opening("m", 8)
    recorded = answer(first, "m", TOKEN)
    assert admit(first, recorded, TOKEN)
    with pytest.raises(Refused, match="its token does not match"):
        admit(opening("m", 8), recorded, TOKEN)  # a replay on a new connection


def test_versions_and_names_must_agree() -> None:
    first = opening("m", 8)
    old = Hello(PROTOCOL_VERSION + 1, "m", 0, bytes(32))
    with pytest.raises(Refused, match=f"protocol version {PROTOCOL_VERSION + 1}; this end "):
        admit(first, old, None)
    with pytest.raises(Refused, match="it asked for runner 'n'; this is 'm'"):
        admit(first, answer(opening("n", 8), "n", None), None)
    with pytest.raises(Refused, match="it serves runner 'm', not 'n'"):
        answer(first, "n", None)
    with pytest.raises(Refused, match="it sent a Call frame before its Hello"):
        admit(first, Call(1, 1.0, 1, {}), None)


def test_a_refusal_reaches_the_client_as_its_reason() -> None:
    first = opening("m", 8)
    hello = answer(first, "m", None)
    refusal = Failure(0, FailureCode.HANDSHAKE, "its token does not match this runner's")
    with pytest.raises(Refused, match="it refused this connection: its token does not"):
        welcomed(first, hello, refusal, None)


def test_tcp_needs_a_token_unless_insecure() -> None:
    tcp, unix = Address.parse("tcp:10.0.0.5:7000"), Address.parse("unix:/tmp/m.sock")
    with pytest.raises(ConfigError, match="tcp:10.0.0.5:7000 is a TCP address but no token"):
        Credentials().check(tcp)
    Credentials(insecure=True).check(tcp)
    Credentials(token=TOKEN).check(tcp)
    Credentials().check(unix)


def test_the_token_file_wins_over_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHSERVE_TOKEN", "from-the-environment-1234")
    assert read_token(Config(runners={})) == b"from-the-environment-1234"
    (tmp_path / "token").write_text("from-the-file-0123456789\n")
    config = Config(runners={}, transport=TransportConfig(token_file=tmp_path / "token"))
    assert read_token(config) == b"from-the-file-0123456789"
    monkeypatch.setenv("BATCHSERVE_TOKEN", "short")
    with pytest.raises(ConfigError, match=r"the token in \$BATCHSERVE_TOKEN has 5 characters; "
                                          "it must have at least 16"):
        read_token(Config(runners={}))


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.mark.anyio
async def test_an_api_link_refuses_a_runner_of_another_version(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that opens with a Hello of version 99 never counts as connected."""

    ended = asyncio.Event()

    async def runner(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.writelines(encode(Hello(99, "m", 8, bytes(32))))
        await reader.read()  # until the link closes
        writer.close()
        ended.set()

    server = await asyncio.start_server(runner, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    link = Link("m", Address.parse(f"tcp:127.0.0.1:{port}"),
                Timeouts(link_idle_s=30), Credentials(insecure=True))
    caplog.set_level(logging.WARNING, "batchserve.api.dispatch")
    task = asyncio.create_task(link.maintain())
    try:
        async with asyncio.timeout(30):
            await link.lost.wait()  # the link closed the connection
        assert link.refused and not link.connected
    finally:
        task.cancel()
        link.close()
        await ended.wait()
        server.close()
        await server.wait_closed()
    assert caplog.messages == [
        f"runner m at tcp:127.0.0.1:{port} is unreachable: it speaks protocol version 99; "
        f"this end speaks {PROTOCOL_VERSION}"
    ]
