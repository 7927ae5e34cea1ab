"""Finding a runner's processes by DNS: the addresses behind a `dns+tcp:name:port`.

A headless Kubernetes Service answers its name with one A record per ready pod. An API worker
resolves the name every `timeouts.resolve_s`, and at once when a connection to one of the
addresses fails (its pod may be gone), and hands each answer to its pool (`Pool` in
`batchserve.api.dispatch`), which connects to new addresses and lets go of those that left.

A failed resolution changes nothing: the last answer stands, since a DNS hiccup must not drop
runners that still serve. It is logged once, until the name resolves again. The resolver is
the system's (`loop.getaddrinfo`: /etc/hosts, then DNS), or any coroutine function with the
same answer, which is how tests drive a name without a DNS server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Sequence

from ..runner.core.wire import Address

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""`(host, port)` to the IP addresses the host has now; raises OSError when it cannot tell."""


async def resolve(host: str, port: int) -> list[str]:
    """The IP addresses `host` has, by the system resolver."""
    loop = asyncio.get_running_loop()
    answers = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(sockaddr[0]) for *_, sockaddr in answers})


class Discovery:
    """One `dns+tcp:` address, resolved again and again while `watch` runs."""

    def __init__(self, runner: str, address: Address, every_s: float,
                 resolver: Resolver = resolve) -> None:
        self.runner = runner
        self.address = address
        self.every_s = every_s
        self.resolver = resolver
        self.wake = asyncio.Event()
        self.failing = False  # the last resolution failed (and that was logged)

    def again(self) -> None:
        """Resolve at once: a connection to one of the addresses failed."""
        self.wake.set()

    async def lookup(self) -> frozenset[Address] | None:
        """The processes the name has now, or None when resolution failed."""
        name = self.address
        try:  # bounded: a resolver that hangs must not stop the updates for good
            async with asyncio.timeout(self.every_s):
                ips = await self.resolver(name.host, name.port)
        except (OSError, UnicodeError) as exc:  # gaierror and TimeoutError are OSErrors
            if not self.failing:
                log.warning("runner %s: %s does not resolve (%s); keeping the processes it "
                            "had", self.runner, name, exc or "timed out")
            self.failing = True
            return None
        if self.failing:
            log.info("runner %s: %s resolves again", self.runner, name)
        self.failing = False
        return frozenset(name.at(ip) for ip in ips)

    async def watch(self, found: Callable[[frozenset[Address]], None]) -> None:
        """Call `found` with each successful answer, every `every_s` or when woken."""
        while True:
            self.wake.clear()  # a wake during the lookup asks for one more
            answer = await self.lookup()
            if answer is not None:
                found(answer)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.every_s):
                    await self.wake.wait()
