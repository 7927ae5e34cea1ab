"""The manual against the code: every configuration key documented, the metrics table made
from the code, every panel and alert explained, the README's own-model example runs, the README
stays a front door, and no page speaks of issue numbers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from batchserve.api import metric_table
from batchserve.runner import models
from batchserve.runner.core.config import ConfigError, load, parse
from batchserve.runner.core.timeouts import Timeouts

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
UNKNOWN = "no_such_key"


def runner(**extra: Any) -> dict[str, Any]:
    """The least runner the parser takes, with `extra` keys on top."""
    return {
        "model": "module:attribute",
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
        **extra,
    }


def ragged(**batch_input: Any) -> dict[str, Any]:
    return runner(
        inputs=[{"name": "t", "datatype": "INT64", "shape": [-1], "ragged": True}],
        batching={"max_batch_elements": 10},
        batch_inputs=[{"kind": "element_count", "name": "n", "source": "t", **batch_input}],
    )


def with_runner(value: dict[str, Any]) -> dict[str, Any]:
    return {"runners": {"name": value}}


def unknown_in_input(**extra: Any) -> dict[str, Any]:
    spec = {"name": "x", "datatype": "INT64", "shape": [-1], **extra}
    return with_runner(runner(inputs=[spec]))


# Each place the parser reads a mapping: the dotted prefix its keys are documented under, and
# a document with an unknown key just there.
MAPPINGS: dict[str, Callable[[], dict[str, Any]]] = {
    "": lambda: {**with_runner(runner()), UNKNOWN: 1},
    "api.": lambda: {**with_runner(runner()), "api": {UNKNOWN: 1}},
    "timeouts.": lambda: {**with_runner(runner()), "timeouts": {UNKNOWN: 1}},
    "transport.": lambda: {**with_runner(runner()), "transport": {UNKNOWN: 1}},
    "transport.tls.": lambda: {**with_runner(runner()), "transport": {"tls": {UNKNOWN: 1}}},
    "runners.<name>.": lambda: with_runner(runner(**{UNKNOWN: 1})),
    "runners.<name>.batching.": lambda: with_runner(runner(batching={UNKNOWN: 1})),
    "runners.<name>.inputs[].": lambda: unknown_in_input(**{UNKNOWN: 1}),
    "runners.<name>.inputs[].pad.": lambda: unknown_in_input(pad={UNKNOWN: 1}),
    "runners.<name>.outputs[].": lambda: with_runner(runner(
        outputs=[{"name": "y", "datatype": "FP32", "shape": [-1, 2], UNKNOWN: 1}])),
    "runners.<name>.batch_inputs[].": lambda: with_runner(ragged(**{UNKNOWN: 1})),
    "pipelines.<name>.": lambda: {**with_runner(runner()), "pipelines": {"name": {UNKNOWN: 1}}},
    "pipelines.<name>.steps[].": lambda: {**with_runner(runner()), "pipelines": {"name": {
        "max_latency_ms": 10, "steps": [{UNKNOWN: 1}]}}},
}


def known_keys(prefix: str, document: dict[str, Any]) -> set[str]:
    """The keys the parser accepts at one place, read from its refusal of an unknown one."""
    with pytest.raises(ConfigError, match="is not a known key") as info:
        parse(document)
    listed = str(info.value).split("known keys are: ", 1)[1]
    assert str(info.value).startswith(f"{parser_path(prefix) or 'configuration.'}{UNKNOWN} ")
    return {prefix + key for key in listed.split(", ")}


def parser_path(prefix: str) -> str:
    """The path the parser names for a prefix: a runner's name, the first list item."""
    return prefix.replace("<name>", "name").replace("[]", "[0]")


def parser_keys() -> set[str]:
    return set().union(*(known_keys(prefix, make()) for prefix, make in MAPPINGS.items()))


def documented_keys() -> set[str]:
    """The first cell of every table row in docs/configuration.md that names a key."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    cells = re.findall(r"^\| `([a-z_<>.\[\]]+)` \|", text, flags=re.MULTILINE)
    return {cell for cell in cells if cell.split(".")[0] in {"api", "timeouts", "transport",
                                                              "runners", "pipelines"}}


def test_the_parser_is_probed_at_every_mapping() -> None:
    keys = parser_keys()
    assert {"runners", "api.max_inflight", "timeouts.drain_s", "transport.tls.server_name",
            "runners.<name>.inputs[].pad.value", "runners.<name>.batch_inputs[].source"} <= keys


def test_every_configuration_key_is_documented_and_no_other() -> None:
    keys = parser_keys()
    documented = documented_keys()
    assert sorted(keys - documented) == []
    assert sorted(documented - keys) == []



def test_every_fixed_period_is_listed_with_its_value() -> None:
    text = (ROOT / "docs" / "configuration.md").read_text()
    fixed = [name for name in vars(Timeouts) if name.isupper() and name.endswith("_S")]
    assert len(fixed) >= 10
    for name in fixed:
        assert f"| `Timeouts.{name}` | {getattr(Timeouts, name):g} |" in text, name


def first_cells(text: str, header: str) -> set[str]:
    """The first column of the table under `header` (its header row), backticks removed."""
    rows = text.split(header + "\n", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    return {row.split(" | ", 1)[0].lstrip("| ").strip("`") for row in rows}


def test_every_dashboard_panel_and_alert_is_explained() -> None:
    text = (ROOT / "docs" / "monitoring.md").read_text()
    dashboard = json.loads((ROOT / "dashboards" / "batchserve.json").read_text())
    panels = {panel["title"] for panel in dashboard["panels"] if panel["type"] != "row"}
    assert first_cells(text, "| panel | question |") == panels
    rules = yaml.safe_load((ROOT / "dashboards" / "alerts.yml").read_text())
    alerts = {rule["alert"] for group in rules["groups"] for rule in group["rules"]}
    assert first_cells(text, "| alert | fires when | why |") == alerts

def section(text: str, heading: str) -> str:
    return text.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def block(text: str, language: str) -> str:
    return text.split(f"```{language}\n", 1)[1].split("```", 1)[0]


def test_the_readme_own_model_example_loads_and_answers(tmp_path: Path) -> None:
    own = section(README.read_text(), "## Your own model")
    (tmp_path / "my_model.py").write_text(block(own, "python"))
    (tmp_path / "my_configuration.yml").write_text(block(own, "yaml"))
    config = load(tmp_path / "my_configuration.yml")
    model = models.load(config, config.runners["my_model"])
    outputs = model({"x": np.ones((3, 8), np.float32)})
    assert outputs["y"].shape == (3, 2)
    assert outputs["y"].dtype == np.float32


def test_the_readme_prints_the_scores_a_fresh_install_gives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The curl example's answer is what `iris_clf` trains to here, not a stale cache's."""
    from batchserve.runner.bundled import iris_classifier

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    request = json.loads(block(section(README.read_text(), "## One request"), "sh")
                         .split("-d '", 1)[1].rsplit("'", 1)[0])
    printed = json.loads(block(section(README.read_text(), "## One request"), "json"))
    rows = np.array(request["inputs"][0]["data"], np.float32)
    scores = iris_classifier()(rows)
    assert np.allclose(printed["outputs"][0]["data"], scores.ravel(), rtol=1e-4, atol=1e-9)


def test_the_readme_is_a_front_door() -> None:
    assert len(README.read_bytes()) <= 20 * 1024


def test_the_readme_gives_the_commands_ci_runs() -> None:
    readme = README.read_text()
    assert "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/batchserve serve" \
        in readme
    assert "\nbash tests/run\n" in readme
    assert "exec bash tests/run" in (ROOT / ".ci" / "run").read_text()


def test_the_metrics_table_is_the_one_the_code_renders() -> None:
    page = ROOT / "docs" / "monitoring.md"
    assert metric_table.block(page) == metric_table.render()


def test_the_metrics_table_lists_the_metrics_alerts_and_dashboards_use() -> None:
    table = metric_table.render()
    for name in ("batchserve_requests_total", "batchserve_queue_depth",
                 "batchserve_api_loop_lag_seconds", "batchserve_batch_time_ratio"):
        assert f"| `{name}` |" in table


ISSUE_NUMBER = re.compile(r"(?i)\b(?:issues?|pr|pull request)s?\s*#?\d+|(?<![\w&/])#\d+\b")


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_no_page_refers_to_issue_numbers(page: Path) -> None:
    assert ISSUE_NUMBER.findall(page.read_text()) == []


@pytest.mark.parametrize("text", ["see issue #7", "issue 3", "(#12)", "PR #40"])
def test_the_issue_pattern_catches_what_it_is_for(text: str) -> None:
    assert ISSUE_NUMBER.search(text)


@pytest.mark.parametrize("text", ["[Stopping](deployment.md#stopping)", "color: #fff"])
def test_the_issue_pattern_passes_links(text: str) -> None:
    assert ISSUE_NUMBER.search(text) is None


def heading_anchors(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings (code blocks' `#` lines are not headings)."""
    anchors: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        fenced = fenced != line.startswith("```")
        if fenced or not line.startswith("#"):
            continue
        anchor = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen[anchor] = seen.get(anchor, -1) + 1
        anchors.add(f"{anchor}-{count}" if count else anchor)
    return anchors


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_link_between_pages_resolves(page: Path) -> None:
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
        if link.startswith(("http://", "https://")):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path) if path else page
        if not target.exists() or (anchor and target.suffix == ".md"
                                   and anchor not in heading_anchors(target)):
            broken.append(link)
    assert broken == []
