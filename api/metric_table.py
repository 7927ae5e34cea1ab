"""The metrics reference of docs/monitoring.md, rendered from the metrics the server registers.

The table is made from the code, not written beside it, so a metric cannot be added, renamed
or relabelled without the page saying so (a test compares the page with `render()`):

    python -m batchserve.api.metric_table --write docs/monitoring.md
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY

from .http import app  # noqa: F401  (registers the API workers' metrics, and the runner's)

PREFIX = "batchserve_"
START = "<!-- metrics: start -->"
END = "<!-- metrics: end -->"
PER_PROCESS = {"liveall", "all"}
"""Multiprocess gauge modes that keep one series per process, labelled by its pid."""


def _metrics() -> Iterator[Any]:
    found = [c for c in REGISTRY._collector_to_names if getattr(c, "_name", "").startswith(PREFIX)]
    yield from sorted(found, key=_name)


def _name(metric: Any) -> str:
    """The exposed name: prometheus_client keeps a counter's name without its `_total`."""
    suffix = "_total" if metric._type == "counter" else ""
    return f"{metric._name}{suffix}"


def _labels(metric: Any) -> str:
    labels = list(metric._labelnames)
    if getattr(metric, "_multiprocess_mode", None) in PER_PROCESS:
        labels.append("pid")
    return ", ".join(labels) or "-"


def render() -> str:
    """One markdown row per metric: its name, type, labels and help text."""
    rows = ["| metric | type | labels | what it says |", "|---|---|---|---|"]
    rows += [f"| `{_name(m)}` | {m._type} | {_labels(m)} | {m._documentation} |"
             for m in _metrics()]
    return "\n".join(rows)


def replace_block(path: Path, text: str) -> None:
    """Put `text` between the START and END lines of `path`."""
    content = path.read_text()
    start, end = content.find(START), content.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"metric_table: {path} has no {START!r} ... {END!r} block")
    path.write_text(f"{content[:start + len(START)]}\n{text}\n{content[end:]}")


def block(path: Path) -> str:
    """What stands between the START and END lines of `path` now."""
    content = path.read_text()
    return content.split(START, 1)[1].split(END, 1)[0].strip("\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchserve.api.metric_table")
    parser.add_argument("--write", type=Path, help="put the table into this file, between "
                        f"the lines {START!r} and {END!r}; else print it")
    args = parser.parse_args(argv)
    if args.write is None:
        print(render())
    else:
        replace_block(args.write, render())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
