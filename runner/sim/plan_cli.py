"""`batchserve plan`: read a model's cost, the traffic and the machine; print the plan.

    batchserve plan (--batch-log PATH | --fit INTERCEPT_MS,SLOPE_MS | --metrics URL)
        [--config FILE] [--runner NAME | --pipeline NAME] [--rate R | --phases S:R,... |
        --arrivals FILE] [--target R] [--processes 1,2,4] [--max-batch-sizes 16,64] [--json]
        [--png FILE]

For a pipeline each step's runner has its own cost: its batch logs in the folder, its line in
`/metrics`, or `--fit RUNNER=INTERCEPT_MS,SLOPE_MS` once per runner. The planning itself is
`batchserve.runner.sim.plan` (`plan_pipeline` for a pipeline); this module only reads files, a
runner's `/metrics` when asked, and writes the table, the JSON and the PNG (`plan_plot`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from ..core.config import Config, ConfigError, RunnerConfig, load
from ..core.cores import usable_cores
from ..core.pyplot import PlotUnavailable
from . import plan_plot
from .plan import Inputs, Machine, Setting, SettingPlan, Traffic, cpu_only, plan, recommend
from .plan_pipeline import describe as describe_pipeline
from .plan_pipeline import plan_pipeline
from .recording import RecordingError, load_recording, merge
from .scenario import Cost

# The server's CPU outside the model's batches, on the 2-core machine of docs/performance.md's
# live table. Per batch: the runner's dispatcher, the handoff to the model thread and back and
# the model call's glue, 0.37 ms in batches of 1 at 100 req/s and 0.38 ms in batches of 8 at
# 1,600 ("Where batchserve's CPU goes", docs/benchmarks.md). Per request: the rest of the
# server's CPU near its capacity, 0.41 to 0.51 ms a request at 2,400 and 2,800 req/s with one
# or two runner processes, less the model's CPU (from the batch log) and that per-batch part.
FRONT_MS = 0.44
BATCH_MS = 0.38
NOISE = 0.1
"""Spread (lognormal sigma) of batch times drawn from a fitted line, where no log gives it."""

INTERCEPT = "batchserve_latency_model_intercept_seconds"
SLOPE = "batchserve_latency_model_slope_seconds"


class PlanError(ValueError):
    """An input of the plan cannot be read or makes no sense."""


# --- inputs ---------------------------------------------------------------------------------


def _numbers(text: str, what: str, count: int | None = None) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        message = f"{what} has value {text!r}; it must be numbers separated by commas"
        raise PlanError(message) from None
    if not values or (count is not None and len(values) != count) or min(values) < 0:
        many = f"{count} " if count else ""
        raise PlanError(f"{what} has value {text!r}; it must be {many}numbers at least 0")
    return values


def _positive_ints(text: str, what: str) -> list[int]:
    values = _numbers(text, what)
    if any(v < 1 or v != int(v) for v in values):
        raise PlanError(f"{what} has value {text!r}; it must be whole numbers at least 1")
    return sorted({int(v) for v in values})


def batch_log(path: Path, runner: str) -> Cost:
    """A log file, or a folder's `<runner>-*.csv` (one per process), replayed on CPU time."""
    files = sorted(path.glob(f"{runner}-*.csv")) if path.is_dir() else [path]
    if not files:
        raise PlanError(f"{str(path)!r} holds no batch log of runner {runner!r} "
                        f"({runner}-<pid>.csv)")
    try:
        recording = merge([load_recording(file) for file in files])
    except RecordingError as exc:
        raise PlanError(str(exc)) from None
    return Cost(0.0, 0.0, replay=cpu_only(recording))


def metrics_fit(url: str, runner: str) -> tuple[float, float]:
    """The runner's live CPU line (intercept and slope, ms) from a server's `/metrics`, the
    mean over its processes."""
    if not url.rstrip("/").endswith("/metrics"):
        url = url.rstrip("/") + "/metrics"
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            text = answer.read().decode()
    except OSError as exc:
        raise PlanError(f"cannot read {url}: {exc}") from None
    return _gauge(text, INTERCEPT, runner, url), _gauge(text, SLOPE, runner, url)


def _gauge(text: str, name: str, runner: str, url: str) -> float:
    values = [sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples
              if sample.name == name and sample.labels.get("runner") == runner]
    if not values:
        raise PlanError(f"{url} has no {name} for runner {runner!r}: is it served there, and "
                        "has it run a batch?")
    return sum(values) / len(values) * 1000.0


def phases(text: str) -> tuple[tuple[float, float], ...]:
    """`S:R,S:R,...` or a YAML file with a scenario's `phases` list (seconds and rate)."""
    if text.endswith((".yml", ".yaml")):
        try:
            document = yaml.safe_load(Path(text).read_text())
        except (OSError, yaml.YAMLError) as exc:
            raise PlanError(f"cannot read phases from {text!r}: {exc}") from None
        raw = document.get("phases") if isinstance(document, dict) else None
        try:
            pairs = [(float(p["seconds"]), float(p["rate"])) for p in raw or []]
        except (TypeError, KeyError, ValueError):
            pairs = []
    else:
        try:
            pairs = [(float(s), float(r)) for s, r in
                     (part.split(":") for part in text.split(",") if part.strip())]
        except ValueError:
            pairs = []
    if not pairs or any(s <= 0 or r < 0 for s, r in pairs) or not any(r for _, r in pairs):
        raise PlanError(f"--phases has value {text!r}; it must be SECONDS:RATE,... or a "
                        "scenario file whose phases have seconds > 0, rates >= 0, one above 0")
    return tuple(pairs)


def arrivals(path: Path) -> list[float]:
    """Arrival times in seconds, one a line (the first column of a CSV line); `#` comments."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise PlanError(f"cannot read {str(path)!r}: {exc.strerror}") from None
    times = []
    for number, line in enumerate(lines, start=1):
        field = line.split("#")[0].split(",")[0].strip()
        if not field:
            continue
        try:
            times.append(float(field))
        except ValueError:
            if times:  # a header line is allowed first
                message = f"{path}:{number} has {line!r}; it must be a time in seconds"
                raise PlanError(message) from None
    return times


# --- the command ----------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchserve plan",
        description="Simulate a runner at many rates, per number of processes and "
                    "max_batch_size, and recommend the smallest setting that carries a target "
                    "rate within the latency limit.",
    )
    cost = parser.add_argument_group("the model's cost (one of)").add_mutually_exclusive_group(
        required=True)
    cost.add_argument("--batch-log", type=Path, metavar="PATH",
                      help="a runner's batch log (BATCHSERVE_BATCH_LOG), or its folder")
    cost.add_argument("--fit", metavar="[RUNNER=]INTERCEPT_MS,SLOPE_MS", action="append",
                      help="CPU time of a batch: intercept + slope * rows (for --pipeline, "
                           "RUNNER=... once per runner)")
    cost.add_argument("--metrics", metavar="URL",
                      help="a server whose /metrics holds the runner's live latency model")
    parser.add_argument("--noise", type=float, default=NOISE,
                        help="lognormal spread of batch times for --fit and --metrics "
                             "(default: %(default)s)")
    parser.add_argument("--config", type=Path, default=Path("configuration.yml"),
                        help="the configuration that holds the runner (default: %(default)s)")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--runner", help="runner name (default: the configuration's only one)")
    which.add_argument("--pipeline", help="plan each step of this pipeline of the "
                       "configuration, for a target rate of the pipeline")
    parser.add_argument("--limit-ms", type=float,
                        help="default: the runner's (or the pipeline's) max_latency_ms")
    traffic = parser.add_argument_group("traffic (one of)").add_mutually_exclusive_group()
    traffic.add_argument("--rate", type=float, help="Poisson arrivals (default: --target)")
    traffic.add_argument("--phases", metavar="S:R,...|FILE.yml",
                         help="Poisson phases, scaled to each rate tried")
    traffic.add_argument("--arrivals", type=Path, metavar="FILE",
                         help="recorded arrival times (s), compressed or stretched in time")
    parser.add_argument("--seconds", type=float, default=2.0,
                        help="simulated seconds of each point for --rate (default: %(default)s)")
    parser.add_argument("--rows", type=int, default=1,
                        help="rows per request, or elements for a runner of ragged or pad "
                             "inputs (default: %(default)s)")
    parser.add_argument("--target", type=float,
                        help="the rate to carry (default: the traffic's mean rate)")
    parser.add_argument("--processes", default="1,2,4", metavar="K1,K2,...",
                        help="numbers of runner processes to try (default: %(default)s)")
    parser.add_argument("--max-batch-sizes", metavar="M1,M2,...",
                        help="batch caps, in elements for a runner of ragged or pad inputs "
                             "(default: the runner's max_batch_size, or max_batch_elements)")
    machine = parser.add_argument_group("the machine")
    machine.add_argument("--cores", type=int, default=max(1, int(usable_cores())),
                         help="cores the server runs on (default: this process's, within its "
                              "CPU quota: %(default)s)")
    machine.add_argument("--front-ms", type=float, default=FRONT_MS,
                         help="server CPU per request outside the model's batches "
                              "(default: %(default)s)")
    machine.add_argument("--batch-overhead-ms", type=float, default=BATCH_MS,
                         help="server CPU per batch outside the model thread "
                              "(default: %(default)s)")
    machine.add_argument("--client-ms", type=float, default=0.0,
                         help="a load generator's CPU per request on this machine (batchserve "
                              "bench: about 0.1) (default: %(default)s)")
    machine.add_argument("--busy-cores", type=float, default=0.0,
                         help="cores other work keeps busy (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--png", type=Path, help="write goodput against offered rate (PNG)")
    return parser


def _runner(config: Config, name: str | None) -> RunnerConfig:
    if name is None:
        if len(config.runners) != 1:
            raise PlanError(f"--runner is needed: the configuration has {len(config.runners)} "
                            f"runners ({', '.join(config.runners)})")
        return next(iter(config.runners.values()))
    if name not in config.runners:
        raise PlanError(f"--runner has value {name!r}; the configuration has "
                        f"{', '.join(config.runners)}")
    return config.runners[name]


def _traffic(args: argparse.Namespace) -> Traffic:
    if args.arrivals is not None:
        try:
            return Traffic.from_arrivals(arrivals(args.arrivals), args.rows)
        except ValueError as exc:
            raise PlanError(f"--arrivals {str(args.arrivals)!r}: {exc}") from None
    if args.phases is not None:
        return Traffic(phases(args.phases), rows=args.rows)
    rate = args.rate if args.rate is not None else args.target
    if rate is None or rate <= 0:
        raise PlanError("give the traffic (--rate, --phases or --arrivals) or --target")
    return Traffic(((args.seconds, rate),), rows=args.rows)


def _cost(args: argparse.Namespace, runner: str) -> Cost:
    if args.batch_log is not None:
        return batch_log(args.batch_log, runner)
    if args.fit is not None:
        if len(args.fit) != 1 or "=" in args.fit[0]:
            raise PlanError(f"--fit has value {' '.join(args.fit)!r}; for one runner it must "
                            "be given once, as INTERCEPT_MS,SLOPE_MS")
        intercept, slope = _numbers(args.fit[0], "--fit", 2)
    else:
        intercept, slope = metrics_fit(args.metrics, runner)
    return Cost(intercept, slope, noise=args.noise)


def _fits(given: list[str], runners: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    """`--fit RUNNER=INTERCEPT_MS,SLOPE_MS`, once for each of a pipeline's runners."""
    fits = {}
    for text in given:
        name, _, line = text.partition("=")
        if not line or name not in runners or name in fits:
            raise PlanError(f"--fit has value {text!r}; for a pipeline it must be "
                            "RUNNER=INTERCEPT_MS,SLOPE_MS, once for each of its runners: "
                            + ", ".join(runners))
        intercept, slope = _numbers(line, f"--fit {name}", 2)
        fits[name] = (intercept, slope)
    missing = [name for name in runners if name not in fits]
    if missing:
        raise PlanError(f"--fit gives no line for runner {missing[0]!r} of the pipeline; give "
                        f"--fit {missing[0]}=INTERCEPT_MS,SLOPE_MS")
    return fits


def _machine(args: argparse.Namespace, limit: float) -> Machine:
    if args.cores < 1 or min(args.front_ms, args.batch_overhead_ms, args.client_ms,
                             args.busy_cores, args.noise) < 0 or limit <= 0 or args.rows < 1:
        raise PlanError("--cores and --rows must be at least 1, --limit-ms above 0, and the "
                        "machine's costs, --busy-cores and --noise at least 0")
    return Machine(args.cores, args.front_ms / 1000.0, args.batch_overhead_ms / 1000.0,
                   args.client_ms / 1000.0, args.busy_cores)


def inputs(args: argparse.Namespace) -> tuple[Inputs, list[Setting], float, RunnerConfig]:
    """Everything the plan needs, from the command line."""
    runner = _runner(load(args.config), args.runner)
    limit = runner.batching.max_latency_ms if args.limit_ms is None else args.limit_ms
    machine = _machine(args, limit)
    traffic = _traffic(args)
    target = traffic.mean_rate if args.target is None else args.target
    sizes = (_positive_ints(args.max_batch_sizes, "--max-batch-sizes")
             if args.max_batch_sizes else [runner.max_cost])
    settings = [Setting(k, m) for k in _positive_ints(args.processes, "--processes")
                for m in sizes]
    made = Inputs(_cost(args, runner.name), machine, traffic, limit, args.seed)
    return made, settings, target, runner


def main(argv: list[str]) -> int:
    """`batchserve plan ...`; returns the exit status."""
    args = _parser().parse_args(argv)
    if args.pipeline is not None:
        return _main_pipeline(args)
    began = time.perf_counter()
    try:
        if args.png is not None:
            plan_plot.require()
        made, settings, target, runner = inputs(args)
        plans = plan(made, settings, target)
        if args.png is not None:
            plan_plot.plot(plans, made, target, runner.name, args.png)
    except (PlanError, ConfigError, PlotUnavailable) as exc:
        print(f"batchserve plan: error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - began
    if args.json:
        print(json.dumps(_json(plans, made, target, runner.name, seconds)))
    else:
        print(describe(plans, made, target, runner.name, seconds))
    return 0


# --- a pipeline -----------------------------------------------------------------------------


def _pipeline_costs(args: argparse.Namespace, runners: tuple[str, ...]) -> dict[str, Cost]:
    """Each runner's cost: its batch logs in the folder, its line in /metrics, or --fit."""
    if args.batch_log is not None and not args.batch_log.is_dir():
        raise PlanError(f"--batch-log has value {str(args.batch_log)!r}; for a pipeline it "
                        "must be the folder of its runners' logs (<runner>-<pid>.csv)")
    if args.fit is None:
        return {name: _cost(args, name) for name in runners}
    return {name: Cost(intercept, slope, noise=args.noise)
            for name, (intercept, slope) in _fits(args.fit, runners).items()}


def pipeline_inputs(args: argparse.Namespace) -> dict[str, Any]:
    """Everything a pipeline's plan needs, from the command line, as `plan_pipeline` takes it."""
    config = load(args.config)
    if args.pipeline not in config.pipelines:
        known = ", ".join(config.pipelines) or "it has none"
        raise PlanError(f"--pipeline has value {args.pipeline!r}; it must be a pipeline of "
                        f"{args.config} ({known})")
    if args.png is not None:
        raise PlanError("--png draws one runner's plan; leave it out with --pipeline")
    pipeline = config.pipelines[args.pipeline]
    runners = tuple(dict.fromkeys(pipeline.runners))
    limit = pipeline.max_latency_ms if args.limit_ms is None else args.limit_ms
    machine = _machine(args, limit)
    traffic = _traffic(args)
    sizes = _positive_ints(args.max_batch_sizes, "--max-batch-sizes") \
        if args.max_batch_sizes else None
    processes = _positive_ints(args.processes, "--processes")
    settings = [[Setting(k, m) for k in processes
                 for m in (sizes or [config.runners[step.runner].batching.max_batch_size])]
                for step in pipeline.steps]
    return {"pipeline": pipeline, "runners": config.runners,
            "costs": _pipeline_costs(args, runners), "machine": machine, "traffic": traffic,
            "target": traffic.mean_rate if args.target is None else args.target,
            "settings": settings, "limit_ms": limit, "seed": args.seed}


def _main_pipeline(args: argparse.Namespace) -> int:
    try:
        given = pipeline_inputs(args)
        result = plan_pipeline(**given)
    except (PlanError, ConfigError) as exc:
        print(f"batchserve plan: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_json()))
    else:
        print(describe_pipeline(result, [_cost_text(step.inputs) for step in result.steps]))
    return 0


# --- output ---------------------------------------------------------------------------------


def _json(plans: list[SettingPlan], made: Inputs, target: float, runner: str,
          seconds: float) -> dict[str, Any]:
    best = recommend(plans)

    def finite(point: Any) -> dict[str, Any]:
        return {key: (None if isinstance(v, float) and v == float("inf") else v)
                for key, v in asdict(point).items()}

    return {
        "runner": runner, "limit_ms": made.limit_ms, "target_rps": target,
        "machine": asdict(made.machine), "cost": _cost_text(made), "seconds": seconds,
        "settings": [{**asdict(p.setting), "passing_rps": p.passing_rps,
                      "target": finite(p.target), "curve": [finite(c) for c in p.curve]}
                     for p in plans],
        "recommended": None if best is None else asdict(best.setting),
    }


def _cost_text(made: Inputs) -> str:
    intercept, slope = made.cpu_line()
    line = f"CPU {intercept * 1000:.3g} ms + {slope * 1000:.3g} ms/row"
    replay = made.cost.replay
    if replay is None:
        return f"{line}, noise {made.cost.noise:g}"
    return f"{replay.batches} recorded batches ({line})"


def describe(plans: list[SettingPlan], made: Inputs, target: float, runner: str,
             seconds: float) -> str:
    machine = made.machine
    lines = [
        f"plan for {runner!r}: limit {made.limit_ms:g} ms, target {target:.0f} req/s; "
        f"cost: {_cost_text(made)}",
        f"machine: {machine.cores} cores, front {machine.front_s * 1000:g} ms/request, "
        f"{machine.batch_s * 1000:g} ms/batch, client {machine.client_s * 1000:g} ms/request, "
        f"busy {machine.busy_cores:g} cores",
        "",
        "| processes | max_batch_size | passing req/s | goodput at target | p99 ms at target "
        "| refused % at target | cores busy | mean batch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for p in plans:
        t = p.target
        p99 = "saturated" if t.saturated else f"{t.p99_ms:.1f}"
        lines.append(f"| {p.setting.processes} | {p.setting.max_batch_size} | "
                     f"{p.passing_rps:.0f} | {t.goodput_rps:.0f} | {p99} | "
                     f"{t.refused * 100:.2f} | {min(t.busy, 1.0) * 100:.0f}% | "
                     f"{t.mean_batch:.1f} |")
    best = recommend(plans)
    lines.append("")
    if best is None:
        top = max(plans, key=lambda p: p.passing_rps)
        lines.append(f"no setting tried carries {target:.0f} req/s within {made.limit_ms:g} ms; "
                     f"the most: {top.passing_rps:.0f} req/s with {top.setting.processes} "
                     f"process(es), max_batch_size {top.setting.max_batch_size}")
    else:
        lines.append(f"smallest setting that carries {target:.0f} req/s within "
                     f"{made.limit_ms:g} ms: {best.setting.processes} process(es), "
                     f"max_batch_size {best.setting.max_batch_size}")
    lines.append(f"({seconds:.1f} s)")
    return "\n".join(lines)
