"""A real Prometheus server scrapes the real `/metrics` of a running batchserve."""

from __future__ import annotations

import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.conftest import Server, wait_for


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture
def prometheus(bundled: Server, tmp_path: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server is not installed; the README's test command installs it"
    target = bundled.url.removeprefix("http://")
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        f"scrape_configs:\n  - job_name: batchserve\n    static_configs:\n"
        f"      - targets: ['{target}']\n"
    )
    url = f"http://127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address={url.removeprefix('http://')}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _ok(f"{url}/-/ready"), 60, "prometheus to be ready")
        yield url
    finally:
        process.terminate()
        process.wait(30)


def _ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def query(prometheus: str, expression: str) -> list[dict[str, object]]:
    answer = httpx.get(f"{prometheus}/api/v1/query", params={"query": expression}, timeout=5)
    answer.raise_for_status()
    return list(answer.json()["data"]["result"])


def test_prometheus_scrapes_batch_sizes_and_dispatcher_state(
    bundled: Server, prometheus: str
) -> None:
    rows = np.ones((3, 256), dtype=np.float32)
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [3, 256],
                        "data": rows.ravel().tolist()}]}
    with bundled.client() as client:
        for _ in range(20):
            assert client.post("/v2/models/mlp/infer", json=body).status_code == 200
        expected = client.get("/metrics").text
    assert 'batchserve_adaptive_batch_size_count{method="__call__",runner="mlp"}' in expected

    def scraped() -> bool:
        result = query(prometheus, 'sum(batchserve_adaptive_batch_size_sum{runner="mlp"})')
        return bool(result) and float(result[0]["value"][1]) >= 60  # type: ignore[index]

    wait_for(scraped, 60, "prometheus to scrape 60 rows of mlp batches")
    up = query(prometheus, 'up{job="batchserve"}')
    assert [float(series["value"][1]) for series in up] == [1.0]  # type: ignore[index]
    for gauge in ("batchserve_dispatcher_batch_cap", "batchserve_dispatcher_window_seconds",
                  "batchserve_latency_model_slope_seconds", "batchserve_arrival_rate"):
        assert query(prometheus, f'{gauge}{{runner="mlp"}}'), f"{gauge} was not scraped"
    codes = query(prometheus, 'batchserve_requests_total{runner="mlp",code="200"}')
    assert sum(float(series["value"][1]) for series in codes) >= 20  # type: ignore[index]
