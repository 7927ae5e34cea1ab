"""Clients that retry refused requests: honouring Retry-After against retrying after 1 s.

    python -m benchmarks.retrying [--times 2] [--seconds 20] [--give-up 5] [--json FILE]

Serves a model that takes 40 ms a batch (spent waiting, not computing), one row a batch,
with a 200 ms limit: about 25 requests a second, so overload costs the cores little more
than the refusals and the retries themselves. Fresh single-row requests arrive
at `--times` that rate for `--seconds` (Poisson, the same schedule for every variant); each is
a client that sends it, and while it is refused (503) tries again: after the Retry-After the
server names (`honour`), or after 1 s whatever it names (`fixed-1s`). A client gives up when
its next try would start more than `--give-up` seconds after its first, as the Python client
does (`batchserve.api.client.codec.check_answer` decides both), or when the bound passes while
it waits for an answer; any other answer ends it as failed.
Both variants run against the same server, one after the other, `--pause` seconds apart.

Per variant it reports the requests sent (first tries and retries), the requests that got a
200 (within the give-up bound, by construction), the 200s a second while the fresh requests
arrive (goodput: the overload is sustained only that long; after it the clients still
retrying meet a server that empties), those given up, the time from a request's first try to
its 200, the client's own CPU, and the 503s it met by reason and Retry-After. What is asked
of the server: that the clients honouring its Retry-After send fewer requests than the
fixed-1s ones, at no lower goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import httpx
import orjson

from batchserve.api.bench.load_result import percentile
from batchserve.api.bench.loadgen import loop_factory
from batchserve.api.bench.traffic import schedule
from batchserve.api.client.codec import ServerError, ServerUnavailable, check_answer
from benchmarks.overload import fixture_server

CAPACITY_RPS = 25.0  # one row per 40 ms batch
LIMIT_MS = 200.0
MODEL = "napping"
CONFIG = f"""
api: {{workers: 1}}
runners:
  {MODEL}:
    model: fixture_models:napping_echo
    batching: {{max_batch_size: 1, max_latency_ms: {LIMIT_MS:g}}}
    inputs: [{{name: x, datatype: FP32, shape: [-1, 4]}}]
    outputs: [{{name: y, datatype: FP32, shape: [-1, 4]}}]
"""
BODY = orjson.dumps({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 4],
                                 "data": [1, 2, 3, 4]}]})
HEADERS = {"Content-Type": "application/json"}
Variant = Literal["honour", "fixed-1s"]
VARIANTS: tuple[Variant, ...] = ("fixed-1s", "honour")
FIXED = {"Retry-After": "1"}
"""What a fixed-1s client reads in every 503, whatever the server said."""


@dataclass
class Outcome:
    """What one variant's clients did with the same schedule of fresh requests."""

    variant: Variant
    seconds: float  # of fresh requests
    fresh: int = 0
    sent: int = 0
    succeeded: int = 0
    gave_up: int = 0
    failed: int = 0  # another status, or a failed connection: not a refusal to retry
    first_try: int = 0  # of the succeeded, those answered 200 at once
    to_success_s: list[float] = field(default_factory=list)
    answered_at_s: list[float] = field(default_factory=list)  # each 200, from the start
    retry_after: dict[str, dict[str, int]] = field(default_factory=dict)
    client_cpu_s: float = 0.0

    @property
    def goodput(self) -> float:
        """200s a second while the fresh requests arrive (all within the give-up bound)."""
        return sum(at <= self.seconds for at in self.answered_at_s) / self.seconds

    def row(self) -> str:
        waits = sorted(self.to_success_s)
        p50, p99 = percentile(waits, 0.5), percentile(waits, 0.99)
        seen = "; ".join(
            f"{reason} " + ", ".join(f"{n}×{value} s" for value, n in sorted(
                values.items(), key=lambda item: (len(item[0]), item[0])))
            for reason, values in sorted(self.retry_after.items())) or "none"
        return (f"| {self.variant} | {self.fresh} | {self.sent} | {self.sent - self.fresh} | "
                f"{self.sent / self.fresh:.2f} | {self.succeeded} | {self.first_try} | "
                f"{self.gave_up} | {self.failed} | {self.goodput:.1f} | {_s(p50)} | {_s(p99)} | "
                f"{self.client_cpu_s:.1f} | {seen} |")

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "goodput": self.goodput, "to_success_s": None,
                "answered_at_s": None,
                "to_success_p50_s": percentile(sorted(self.to_success_s), 0.5),
                "to_success_p99_s": percentile(sorted(self.to_success_s), 0.99)}


HEAD = ("| client | fresh | sent | retries | sent per fresh | succeeded | at first try | "
        "gave up | failed | goodput req/s | to 200 p50 s | to 200 p99 s | client CPU s | "
        "503s met, by reason and Retry-After |\n" + "|---" * 14 + "|")


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def table(outcomes: Sequence[Outcome]) -> str:
    return "\n".join([HEAD, *(outcome.row() for outcome in outcomes)])


def wait_s(variant: Variant, answer: httpx.Response, remaining_s: float) -> float | None:
    """How long a client of `variant` waits before its next try: None for a 200; raises as
    the Python client does (`ServerUnavailable` when the wait would pass the bound)."""
    headers: Mapping[str, str] = answer.headers if variant == "honour" else FIXED
    return check_answer(answer.status_code, headers, answer.content, remaining_s)


async def _client(http: httpx.AsyncClient, path: str, variant: Variant, give_up_s: float,
                  outcome: Outcome) -> None:
    """One fresh request, tried until it is answered 200, refused past the bound, or fails."""
    started = time.monotonic()
    deadline = started + give_up_s
    tries = 0
    while True:
        tries += 1
        outcome.sent += 1
        try:
            # httpx bounds each phase of a request alone; the bound is on the whole.
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                answer = await http.post(path, content=BODY, headers=HEADERS)
            if answer.status_code == 503:
                _count_refusal(answer, outcome.retry_after)
            delay = wait_s(variant, answer, deadline - time.monotonic())
        except (ServerUnavailable, TimeoutError):
            outcome.gave_up += 1
            return
        except (ServerError, httpx.HTTPError):
            outcome.failed += 1
            return
        if delay is None:
            outcome.succeeded += 1
            outcome.first_try += tries == 1
            outcome.to_success_s.append(time.monotonic() - started)
            outcome.answered_at_s.append(time.monotonic())
            return
        await asyncio.sleep(delay)


def _count_refusal(answer: httpx.Response, seen: dict[str, dict[str, int]]) -> None:
    try:
        reason = str(orjson.loads(answer.content).get("reason", "none"))
    except (orjson.JSONDecodeError, AttributeError):
        reason = "none"
    value = answer.headers.get("Retry-After", "none")
    counts = seen.setdefault(reason, {})
    counts[value] = counts.get(value, 0) + 1


async def run_variant(url: str, variant: Variant, offsets: Sequence[float], seconds: float,
                      give_up_s: float) -> Outcome:
    """Start one client at each offset, and wait until every one has ended."""
    outcome = Outcome(variant, seconds, fresh=len(offsets))
    # httpx's pool goes through all its connections on every request: a few dozen keep the
    # client's CPU per request low, and are more than the requests in flight at once.
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    path = f"/v2/models/{MODEL}/infer"
    cpu = time.process_time()
    async with httpx.AsyncClient(base_url=url, limits=limits) as http:
        tasks: list[asyncio.Task[None]] = []
        start = time.monotonic()
        for offset in offsets:
            await asyncio.sleep(max(0.0, start + offset - time.monotonic()))
            tasks.append(asyncio.create_task(_client(http, path, variant, give_up_s, outcome)))
        await asyncio.gather(*tasks)
    outcome.answered_at_s = [at - start for at in outcome.answered_at_s]
    outcome.client_cpu_s = time.process_time() - cpu
    return outcome


async def compare(url: str, rate: float, seconds: float, give_up_s: float,
                  variants: Sequence[Variant] = VARIANTS, pause_s: float = 3.0,
                  seed: int = 0) -> list[Outcome]:
    """Each variant in turn over the same schedule, `pause_s` apart so the server forgets
    the last one's refusals."""
    offsets = schedule(rate, seconds, seed)
    outcomes = []
    for i, variant in enumerate(variants):
        if i:
            await asyncio.sleep(pause_s)
        outcomes.append(await run_variant(url, variant, offsets, seconds, give_up_s))
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--times", type=float, default=2.0, help="fresh load over capacity")
    p.add_argument("--seconds", type=float, default=20.0, help="of fresh requests, per variant")
    p.add_argument("--give-up", type=float, default=5.0,
                   help="seconds from a request's first try past which it is not tried again")
    p.add_argument("--pause", type=float, default=3.0, help="seconds between the variants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ready-timeout", type=float, default=180.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rate = args.times * CAPACITY_RPS
    with fixture_server(args, CONFIG, 1, "batchserve-retrying-") as (url, _), \
            asyncio.Runner(loop_factory=loop_factory()) as runner:
        outcomes = runner.run(compare(url, rate, args.seconds, args.give_up,
                                      pause_s=args.pause, seed=args.seed))
    print(f"{rate:g} fresh req/s for {args.seconds:g} s against about {CAPACITY_RPS:g} req/s "
          f"of capacity; a request is given up {args.give_up:g} s after its first try.\n")
    print(table(outcomes))
    if args.json:
        args.json.write_bytes(orjson.dumps([outcome.as_dict() for outcome in outcomes],
                                           option=orjson.OPT_INDENT_2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
