"""How soon a server answers normally again once a load stops: one lone request at a time.

A server that sheds well is back at once; one that queued the overload serves its backlog
first, and a lone request waits behind it.
"""

from __future__ import annotations

import http.client
import threading
import time
from urllib.parse import urlsplit

PROBE_EVERY_S = 0.02
GIVE_UP_S = 10.0


def answered_ok(url: str, body: bytes, timeout_s: float) -> bool:
    """One POST of ``body`` on a fresh connection: whether it got a 200 in time."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port,
                                            timeout=timeout_s)
    try:
        connection.request("POST", parts.path, body, {"Content-Type": "application/json"})
        return connection.getresponse().status == 200
    except OSError:
        return False
    finally:
        connection.close()


def recovery_s(url: str, body: bytes, give_up_s: float = GIVE_UP_S) -> float | None:
    """Seconds from now until a lone request is answered 200; None past ``give_up_s``."""
    began = time.monotonic()
    while (waited := time.monotonic() - began) < give_up_s:
        if answered_ok(url, body, give_up_s - waited):
            return time.monotonic() - began
        time.sleep(PROBE_EVERY_S)
    return None


class AfterLoad:
    """Probes from ``seconds`` after it starts, the end of a load started with it, in a
    thread of its own so the load's client keeps its schedule and its drain."""

    def __init__(self, url: str, body: bytes, seconds: float) -> None:
        self.result: float | None = None
        self._thread = threading.Thread(target=self._run, args=(url, body, seconds),
                                        daemon=True)
        self._thread.start()

    def _run(self, url: str, body: bytes, seconds: float) -> None:
        time.sleep(seconds)
        self.result = recovery_s(url, body)

    def join(self) -> float | None:
        self._thread.join()
        return self.result
