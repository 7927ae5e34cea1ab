"""One API worker process: uvicorn serving the app on a socket the supervisor bound.

The supervisor binds the listening socket once and hands its file descriptor to every
worker, so all of them accept on the same port and a worker can be replaced alone.
"""

from __future__ import annotations

import argparse
import logging
import socket
from collections.abc import Sequence

import orjson
import uvicorn

from batchserve.api.app import create_app
from batchserve.runner.config import load
from batchserve.runner.wire import Address


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m batchserve.api.worker")
    parser.add_argument("--config", required=True)
    parser.add_argument("--runners", required=True, help='JSON {"runner": ["unix:/a.sock"]}')
    parser.add_argument("--fd", type=int, required=True, help="the bound listening socket")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config = load(args.config)
    addresses = {
        name: [Address.parse(text) for text in texts]
        for name, texts in orjson.loads(args.runners).items()
    }
    app = create_app(config, addresses)
    listener = socket.socket(fileno=args.fd)
    server = uvicorn.Server(uvicorn.Config(
        app,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        access_log=False,
        log_level="warning",
        timeout_graceful_shutdown=5,
        proxy_headers=False,
    ))
    server.run(sockets=[listener])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
