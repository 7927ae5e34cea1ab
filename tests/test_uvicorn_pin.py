"""The HTTP connection's use of uvicorn's internals, against the uvicorn installed."""

from __future__ import annotations

import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchserve.api.http import connection

ROOT = Path(__file__).resolve().parent.parent


def test_the_installed_uvicorn_has_every_internal_the_connection_uses() -> None:
    missing = connection.missing_internals()
    assert not missing, f"uvicorn {version('uvicorn')} lacks {missing}"
    connection.check_uvicorn()


def test_the_installed_uvicorn_is_in_the_range_pyproject_pins() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = [Requirement(text) for text in project["dependencies"]]
    uvicorn = next(pin for pin in pins if pin.name == "uvicorn")
    assert uvicorn.specifier and version("uvicorn") in uvicorn.specifier, uvicorn


def test_a_uvicorn_without_them_is_refused_naming_its_version(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(HttpToolsProtocol, "_start_asgi_task")
    monkeypatch.delattr(connection.httptools_impl, "STATUS_LINE")
    with pytest.raises(connection.UnsupportedUvicorn) as caught:
        connection.check_uvicorn()
    text = str(caught.value)
    assert f"uvicorn {version('uvicorn')} lacks" in text
    assert "STATUS_LINE" in text and "HttpToolsProtocol._start_asgi_task" in text
