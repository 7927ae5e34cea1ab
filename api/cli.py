"""The `batchserve` command: serve, runner, validate, simulate, plan, bench.

Library code raises; only this module turns an error into one line on stderr and a
non-zero exit status (3 for a bad configuration, as uvicorn does for a failed start).
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from ..runner.core.config import Config, ConfigError, load, resolve
from ..runner.core.security import Credentials, credentials

CONFIG_ERROR = 3


def _check(path: Path) -> Config:
    """Load the file and import every runner's model, without building or starting any."""
    config = load(path)
    for runner in config.runners.values():
        resolve(config, runner)
    return config


def _links(config: Config, api_only: bool) -> Credentials:
    """The credentials to reach every runner, checked before any process starts."""
    keys = credentials(config)
    for runner in config.runners.values():
        if api_only and not runner.addresses:
            raise ConfigError(
                f"runners.{runner.name}.addresses is missing: with --api-only, every runner "
                "must list where it listens (for example [tcp:10.0.0.5:7000])"
            )
        for address in runner.addresses:
            keys.check(address)
            keys.client_context(address)
    return keys


def _serve(args: argparse.Namespace) -> int:
    from .http.connection import UnsupportedUvicorn, check_uvicorn
    from .supervisor import Supervisor

    try:
        check_uvicorn()
    except UnsupportedUvicorn as exc:
        print(f"error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
    config = load(args.config) if args.api_only else _check(args.config)
    keys = _links(config, args.api_only)
    api = config.api
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    return Supervisor(
        config,
        args.config,
        host=args.host or api.host,
        port=api.port if args.port is None else args.port,
        grpc_port=api.grpc_port if args.grpc_port is None else args.grpc_port,
        api_workers=args.api_workers or api.workers,
        keys=keys,
    ).run()


def _validate(args: argparse.Namespace) -> int:
    path = args.config or args.path or Path("configuration.yml")
    config = _check(path)
    summary = f"{len(config.runners)} runner(s): {', '.join(config.runners)}"
    if config.pipelines:
        summary += f"; {len(config.pipelines)} pipeline(s): {', '.join(config.pipelines)}"
    print(f"{path}: valid ({summary})")
    return 0


def _forward(module: str) -> Callable[[list[str]], int]:
    def run(rest: list[str]) -> int:
        main: Callable[[list[str]], int] = importlib.import_module(module).main
        return main(rest)

    return run


FORWARDED = {
    "runner": _forward("batchserve.runner.server"),
    "simulate": _forward("batchserve.runner.sim.simulate"),
    "plan": _forward("batchserve.runner.sim.plan_cli"),
    "bench": _forward("batchserve.api.bench.bench"),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchserve", description="Adaptive-batching server")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start runners and API workers")
    serve.add_argument("--config", type=Path, default=Path("configuration.yml"))
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--grpc-port", type=int,
                       help="the v2 protocol over gRPC on this port (default api.grpc_port, "
                            "8001); 0 turns it off")
    serve.add_argument("--api-workers", type=int)
    serve.add_argument("--api-only", action="store_true",
                       help="start only API workers, connecting to each runner's configured "
                            "addresses")
    serve.set_defaults(handler=_serve)
    validate = commands.add_parser("validate", help="check a configuration file")
    where = validate.add_mutually_exclusive_group()
    where.add_argument("path", type=Path, nargs="?", help="the file (default configuration.yml)")
    where.add_argument("--config", type=Path, help="the file, as `serve` takes it")
    validate.set_defaults(handler=_validate)
    for name in FORWARDED:
        commands.add_parser(name, help=f"see 'batchserve {name} --help'", add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in FORWARDED:
        return FORWARDED[argv[0]](argv[1:])
    args = _parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return CONFIG_ERROR
