"""Monitoring a user can trust, on the real server with two API workers and two
runner processes: counters that add up, gauges true at scrape time, a `/metrics` page that
promtool accepts, and Debian's Prometheus running the shipped scrape config and alert rules
against it, with every panel query and alert expression returning data and the 503-ratio
alert firing while refusals are forced and resolving after.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from batchserve.api.reserve import EVERY
from tests.conftest import ROOT, Server, wait_for
from tests.test_prometheus import free_port, query

DASHBOARDS = ROOT / "dashboards"
ECHO = """
runners:
  echo:
    model: fixture_models:stall_echo
    workers: 2
    batching: {max_batch_size: 8, max_latency_ms: 100}
    inputs: [{name: x, datatype: FP32, shape: [-1, 4]}]
    outputs: [{name: y, datatype: FP32, shape: [-1, 4]}]
"""
PIPELINE = """
pipelines:
  echoed:  # the echo behind a pipeline's name: the pipeline panels have series to show
    max_latency_ms: 100
    steps: [{runner: echo}]
"""
INFER = "/v2/models/echo/infer"
MIXED = (None, 5000, 300)
NO_ANSWER = 0  # the connection dropped before a status came back
MORE_STALLED_ROUNDS = 10
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def body(rows: int, value: float = 1.0, timeout_us: int | None = None) -> dict[str, Any]:
    tensor = {"name": "x", "datatype": "FP32", "shape": [rows, 4], "data": [value] * (4 * rows)}
    request: dict[str, Any] = {"inputs": [tensor]}
    if timeout_us is not None:
        request["parameters"] = {"timeout": timeout_us}
    return request


async def _traffic(
    url: str, rounds: int, stalls: bool, timeouts: tuple[int | None, ...]
) -> collections.Counter[int]:
    """Requests of 1 row and of 20 (cut into 3 pieces), with each of `timeouts` (in
    microseconds; the short ones are refused); with `stalls`, each round starts with batches
    that stall the model for 200 ms, so requests queued behind them expire or are refused."""
    seen: collections.Counter[int] = collections.Counter()
    limits = httpx.Limits(max_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=10, limits=limits) as client:

        async def post(request: dict[str, Any]) -> None:
            try:
                seen[(await client.post(INFER, json=request)).status_code] += 1
            except httpx.TransportError:
                seen[NO_ANSWER] += 1

        for _ in range(rounds):
            stalled = [asyncio.create_task(post(body(1, -1.0))) for _ in range(2 * stalls)]
            if stalls:
                await asyncio.sleep(0.02)  # the stalling batches are now in the models
            await asyncio.gather(*stalled, *(
                post(body(rows, 1.0, timeout)) for rows in (1, 20)
                for timeout in timeouts for _ in range(5)
            ))
    return seen


def traffic(
    url: str, rounds: int = 3, stalls: bool = True, timeouts: tuple[int | None, ...] = MIXED
) -> collections.Counter[int]:
    return asyncio.run(_traffic(url, rounds, stalls, timeouts))


def scrape(server: Server) -> Samples:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text) for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(value for (n, have), value in samples.items() if n == name and want <= have)


def values(samples: Samples, name: str) -> list[float]:
    """Each process's value of gauge `name` (its runner's label and the process's)."""
    return [value for (n, _), value in samples.items() if n == name]


def batch_log(folder: Path) -> tuple[int, int]:
    """Batches and rows in every runner process's batch log, the dead one's included."""
    lines = [line for path in folder.glob("*.csv") for line in path.read_text().splitlines()[1:]]
    return len(lines), sum(int(line.split(",")[0]) for line in lines)


def mismatches(server: Server, seen: collections.Counter[int], logs: Path) -> list[str]:
    samples = scrape(server)
    problems = []
    for code in {200, 503} | set(seen) - {NO_ANSWER}:
        counted = total(samples, "batchserve_requests_total", code=str(code))
        if counted != seen[code]:
            problems.append(f"requests_total code {code}: {counted}, the client saw {seen[code]}")
    unavailable = total(samples, "batchserve_unavailable_total")
    if unavailable != seen[503]:
        problems.append(f"unavailable_total {unavailable} != {seen[503]} 503s")
    for reason in ("queue", "expired", "draining"):
        runner = total(samples, "batchserve_rejections_total", reason=reason)
        api = total(samples, "batchserve_unavailable_total", reason=reason)
        if runner != api:
            problems.append(f"{reason}: runners counted {runner}, API workers answered {api}")
    batches, rows = batch_log(logs)
    counted = total(samples, "batchserve_adaptive_batch_size_count")
    released = total(samples, "batchserve_batches_total")
    counted_rows = total(samples, "batchserve_adaptive_batch_size_sum")
    if not counted == released == batches or counted_rows != rows:
        problems.append(f"batches: histogram {counted} ({counted_rows} rows), released "
                        f"{released}, run {batches} ({rows} rows)")
    return problems


def settle(check: Callable[[], list[str]], timeout: float = 15.0) -> None:
    """Counters are written by many processes: wait for the last writes, then assert."""
    deadline = time.monotonic() + timeout
    while (problems := check()) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not problems, problems


def test_counters_add_up_across_two_workers_and_a_replaced_runner(
    serve: Callable[..., Server], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    logs = tmp_path / "batches"
    monkeypatch.setenv("BATCHSERVE_BATCH_LOG", str(logs))
    server = serve(ECHO, "--api-workers", "2")
    seen = traffic(server.url) + traffic(server.url, rounds=2, stalls=False)
    # Which runner process each stalling request lands on is random, and with it whether
    # one queued behind a stall expires: more stalled rounds, until both reasons are seen.
    check = functools.partial(mismatches, server, seen, logs)
    for _ in range(MORE_STALLED_ROUNDS):
        settle(check)  # the batch log is flushed every second
        samples = scrape(server)
        if all(total(samples, "batchserve_rejections_total", reason=reason) > 0
               for reason in ("queue", "expired")):
            break
        seen.update(traffic(server.url, rounds=1))
    assert seen[200] and seen[503] and not seen[NO_ANSWER], seen
    settle(check)
    samples = scrape(server)
    assert total(samples, "batchserve_rejections_total", reason="queue") > 0
    assert total(samples, "batchserve_rejections_total", reason="expired") > 0

    killed = server.runners()[0]
    os.kill(killed, signal.SIGKILL)

    def replaced() -> bool:
        runners = server.runners()
        samples = scrape(server)
        gone = not any(("pid", str(killed)) in labels for _, labels in samples)
        connected = total(samples, "batchserve_runner_processes_connected")
        return len(runners) == 2 and killed not in runners and gone and connected == 4

    wait_for(replaced, 60, "a replacement runner, connected to both workers, the dead one's "
             "gauges gone")
    seen += traffic(server.url) + traffic(server.url, rounds=2, stalls=False)
    assert not seen[NO_ANSWER], seen
    settle(lambda: mismatches(server, seen, logs))
    assert total(scrape(server), "batchserve_runner_starts_total") == 3


def test_gauges_are_true_at_scrape_time_and_the_page_passes_promtool(
    serve: Callable[..., Server],
) -> None:
    server = serve(ECHO, "--api-workers", "2")
    busy = threading.Event()

    def load() -> None:
        while not busy.is_set():
            traffic(server.url, rounds=1, stalls=False)

    loader = threading.Thread(target=load)
    loader.start()
    try:
        wait_for(lambda: total(scrape(server), "batchserve_arrival_rate") > 10, 15,
                 "the arrival rate to show traffic")
        # Each runner process reads its capacity once a second of traffic has been costed.
        wait_for(lambda: all(v > 0 for v in values(scrape(server), "batchserve_utilization")),
                 15, "each runner process's utilization to show its capacity")
        loaded = scrape(server)
        capacities = values(loaded, "batchserve_capacity_requests_per_second")
        assert len(capacities) == 2 and all(c > 0 for c in capacities), capacities
    finally:
        busy.set()
        loader.join(30)

    def idle() -> bool:
        samples = scrape(server)
        return (total(samples, "batchserve_arrival_rate") < 1e-3
                and total(samples, "batchserve_queue_depth") == 0
                and total(samples, "batchserve_inflight_requests") == 0)

    wait_for(idle, 10, "arrival rate, queue depth and in-flight requests to read idle")
    samples = scrape(server)
    limits = {v for (n, _), v in samples.items()
              if n == "batchserve_runner_latency_limit_seconds"}
    assert limits == {0.1}

    promtool = shutil.which("promtool")
    assert promtool, "promtool is not installed; the README's test command installs it"
    page = httpx.get(f"{server.url}/metrics", timeout=10).text
    lint = subprocess.run([promtool, "check", "metrics"], input=page, capture_output=True,
                          text=True, timeout=60, check=False)
    assert lint.returncode == 0 and not lint.stdout.strip(), lint.stdout + lint.stderr


# --- Prometheus with the shipped configuration -------------------------------------------------

SHORT_WINDOWS = {"1m": "5s", "5m": "10s", "15m": "1m"}


def test_an_api_worker_keeps_back_the_way_home_even_when_no_answer_was_late(
    serve: Callable[..., Server],
) -> None:
    # Answers one at a time to an idle model leave long before their deadlines; still, each
    # took some time from its batch's end to leaving the worker, and a request served at
    # the edge of its deadline would be late by that much: the worker keeps it back.
    server = serve(ECHO, "--api-workers", "1")
    with httpx.Client(base_url=server.url, timeout=10) as client:
        for _ in range(EVERY):  # enough answers for the estimate to move
            assert client.post(INFER, json=body(1)).status_code == 200

    def kept_back() -> float:
        return total(scrape(server), "batchserve_api_reserve_seconds", runner="echo")

    wait_for(lambda: kept_back() > 0.0, 15, "the way home to be kept back")
    assert kept_back() <= 0.25 * 0.1  # at most a quarter of the limit


def quick_rules(text: str) -> str:
    """The shipped rules with windows, `for:` and evaluation short enough for a test."""
    text = re.sub(r"for: \d+m", "for: 2s", text)
    text = text.replace("interval: 15s", "interval: 1s").replace("[5m:15s]", "[10s:1s]")
    return re.sub(r"\[(\d+m)\]", lambda m: f"[{SHORT_WINDOWS[m[1]]}]", text)


@pytest.fixture
def prometheus(serve: Callable[..., Server], tmp_path: Path) -> Iterator[tuple[Server, str]]:
    binary = shutil.which("prometheus")
    assert binary, "the prometheus server is not installed; the README's test command installs it"
    server = serve(ECHO + PIPELINE, "--api-workers", "2")
    (tmp_path / "alerts.yml").write_text(quick_rules((DASHBOARDS / "alerts.yml").read_text()))
    config = yaml.safe_load((DASHBOARDS / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "scrape_timeout": "1s",
                        "evaluation_interval": "1s"}
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [
        server.url.removeprefix("http://")
    ]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    address = f"127.0.0.1:{free_port()}"
    process = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address={address}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
    )
    url = f"http://{address}"
    try:
        wait_for(lambda: _ready(url), 60, "prometheus to be ready")
        yield server, url
    finally:
        process.terminate()
        process.wait(30)


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/-/ready", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def panel_queries() -> list[str]:
    dashboard = json.loads((DASHBOARDS / "batchserve.json").read_text())
    panels = [p for row in dashboard["panels"] for p in (row, *row.get("panels", []))]
    return [target["expr"].replace("$runner", ".*").replace("$__rate_interval", "5s")
            for panel in panels for target in panel.get("targets", [])]


def alert_signals(rules: Path) -> dict[str, str]:
    """Each alert's expression with its comparison made `bool`: data whenever its inputs
    have data, firing or not."""
    signals = {}
    for group in yaml.safe_load(rules.read_text())["groups"]:
        for rule in group["rules"]:
            expr, comparisons = re.subn(r"\s([<>]=?|==)\s", r" \1 bool ", rule["expr"])
            assert comparisons == 1, rule["expr"]
            signals[rule["alert"]] = expr
    return signals


def state(prometheus: str, alert: str) -> str:
    answer = httpx.get(f"{prometheus}/api/v1/alerts", timeout=5).json()["data"]["alerts"]
    states = {a["state"] for a in answer if a["labels"]["alertname"] == alert}
    return "firing" if "firing" in states else states.pop() if states else "inactive"


def test_prometheus_with_the_shipped_config_evaluates_every_panel_and_alert(
    prometheus: tuple[Server, str], tmp_path: Path
) -> None:
    server, url = prometheus
    wait_for(lambda: bool(query(url, 'up{job="batchserve"} == 1')), 30, "a first scrape")
    traffic(server.url, rounds=1, stalls=True)  # expiries (and refusals) behind a stall
    forcing = threading.Event()
    forcing.set()

    def force() -> None:  # refusals at arrival: budgets no batch can meet
        while forcing.is_set():
            traffic(server.url, rounds=1, stalls=False, timeouts=(None, 300))

    loader = threading.Thread(target=force)
    loader.start()
    try:
        wait_for(lambda: state(url, "BatchserveHigh503Ratio") == "firing", 45,
                 "the 503-ratio alert to fire while refusals are forced")
        empty = [expr for expr in panel_queries() if not query(url, expr)]
        signals = alert_signals(tmp_path / "alerts.yml")
        empty += [f"{name}: {expr}" for name, expr in signals.items() if not query(url, expr)]
        assert not empty, empty
        reasons = {series["metric"]["reason"] for series in query(  # type: ignore[index]
            url, "sum by (reason) (batchserve_unavailable_total) > 0")}
        # Refused at arrival, by the runner and by what it published, or expired behind the
        # stall: the panels by reason show more than one.
        assert "queue" in reasons and reasons & {"backlog", "expired"}, reasons
    finally:
        forcing.clear()
        loader.join(30)

    def calm() -> bool:  # one request at a time: nothing to refuse, even on a busy machine
        with server.client() as client:
            for _ in range(10):
                client.post(INFER, json=body(1))
        return state(url, "BatchserveHigh503Ratio") == "inactive"

    wait_for(calm, 45, "the 503-ratio alert to resolve once refusals stop")
