"""The alert rules and the monitoring stack's files: promtool checks them, paths line up."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

DASHBOARDS = Path(__file__).resolve().parent.parent / "dashboards"
ALERTS = {
    "BatchserveHigh503Ratio", "BatchserveLatencyAboveLimit", "BatchserveDown",
    "BatchserveRunnerDown",
    "BatchserveRunnerRestartLoop", "BatchserveLatencyModelOff", "BatchserveQueueGrowing",
}


def promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed; the README's test command installs it"
    done = subprocess.run([binary, *args], cwd=DASHBOARDS, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def load(name: str) -> Any:
    return yaml.safe_load((DASHBOARDS / name).read_text())


def test_promtool_checks_the_scrape_config_and_its_rules() -> None:
    assert "SUCCESS: 7 rules found" in promtool("check", "config", "prometheus.yml")


def test_every_alert_fires_on_its_synthetic_series() -> None:
    promtool("test", "rules", "alerts.test.yml")
    tested = {case["alertname"] for test in load("alerts.test.yml")["tests"]
              for case in test["alert_rule_test"]}
    rules = {rule["alert"] for group in load("alerts.yml")["groups"] for rule in group["rules"]}
    assert rules == ALERTS == tested


@pytest.fixture(scope="module")
def compose() -> Any:
    return load("compose.yml")


def test_compose_mounts_files_that_exist(compose: Any) -> None:
    for service in compose["services"].values():
        for volume in service["volumes"]:
            source = volume.split(":")[0]
            assert (DASHBOARDS / source).exists(), volume


def test_grafana_provisions_the_dashboard_and_prometheus(compose: Any) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"])
    provisioning = DASHBOARDS / "grafana" / "provisioning"
    assert mounts["./grafana/provisioning"] == "/etc/grafana/provisioning"
    provider = yaml.safe_load((provisioning / "dashboards" / "batchserve.yml").read_text())
    folder = provider["providers"][0]["options"]["path"]
    assert mounts["./batchserve.json"] == f"{folder}/batchserve.json"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    prometheus = compose["services"]["prometheus"]
    assert "--web.listen-address=:9090" in prometheus["command"]
    assert source["datasources"][0]["url"] == "http://localhost:9090"
    # Grafana must not take batchserve's port (3000, prometheus.yml's target).
    assert grafana["environment"]["GF_SERVER_HTTP_PORT"] != "3000"
    target = load("prometheus.yml")["scrape_configs"][0]["static_configs"][0]["targets"][0]
    assert target == "localhost:3000"


def test_prometheus_reads_the_rules_compose_mounts(compose: Any) -> None:
    mounts = dict(v.split(":")[:2] for v in compose["services"]["prometheus"]["volumes"])
    config = Path(mounts["./prometheus.yml"])
    for rules in load("prometheus.yml")["rule_files"]:
        assert str(config.parent / rules) in mounts.values()
