"""Who may talk to a runner: the shared token, and TLS on links between hosts.

- The token is read from the file `transport.token_file` names, else from the environment
  variable `BATCHSERVE_TOKEN`; surrounding whitespace is dropped and at least 16 characters
  must remain. When a runner has one, every connection (unix or TCP) must prove it holds it
  in the handshake (`batchserve.runner.core.handshake`), and the runner proves it back.
- A TCP link requires a token unless `transport.insecure: true` says the network itself is
  trusted; a unix socket may go without, since its folder's permissions guard it.
- TLS (`transport.tls`) encrypts TCP links and, with `api_ca`, makes a runner require a
  client certificate; the token is still checked inside it.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path

from .config import Config, ConfigError, TlsConfig
from .wire import Address

TOKEN_ENV = "BATCHSERVE_TOKEN"
MIN_TOKEN_CHARS = 16


@dataclass(frozen=True, slots=True)
class Credentials:
    """What one process uses to open or accept runner connections."""

    token: bytes | None = None
    insecure: bool = False
    tls: TlsConfig | None = None

    def check(self, address: Address) -> None:
        """Refuse a TCP link that nothing guards."""
        if address.tcp and self.token is None and not self.insecure:
            raise ConfigError(
                f"{address} is a TCP address but no token is set: write one to the file "
                f"transport.token_file names or to ${TOKEN_ENV}, or set transport.insecure: "
                "true if nobody else can reach that network"
            )

    def server_context(self, address: Address) -> ssl.SSLContext | None:
        """The runner's TLS context for `address`; None for unix sockets or without TLS."""
        tls = self.tls
        if tls is None or not address.tcp:
            return None
        if tls.runner_cert is None or tls.runner_key is None:
            raise ConfigError("transport.tls.runner_cert is missing: a runner listening on "
                              "TCP with TLS needs its certificate and key")
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        _load_chain(context, tls.runner_cert, tls.runner_key, "runner_cert")
        if tls.api_ca is not None:
            _load_ca(context, tls.api_ca, "api_ca")
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def client_context(self, address: Address) -> ssl.SSLContext | None:
        """An API worker's TLS context for `address`; None for unix sockets or without TLS."""
        tls = self.tls
        if tls is None or not address.tcp:
            return None
        if tls.runner_ca is None:
            raise ConfigError("transport.tls.runner_ca is missing: an API worker needs it to "
                              "check the runners' certificates")
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        _load_ca(context, tls.runner_ca, "runner_ca")
        if tls.api_cert is not None and tls.api_key is not None:
            _load_chain(context, tls.api_cert, tls.api_key, "api_cert")
        return context

    def server_name(self, address: Address) -> str | None:
        """The name a runner's certificate must carry."""
        if self.tls is None or not address.tcp:
            return None
        return self.tls.server_name or address.host


def _load_chain(context: ssl.SSLContext, cert: Path, key: Path, name: str) -> None:
    try:
        context.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"transport.tls.{name} ({cert}, key {key}) cannot be loaded: "
                          f"{exc}") from None


def _load_ca(context: ssl.SSLContext, ca: Path, name: str) -> None:
    try:
        context.load_verify_locations(ca)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"transport.tls.{name} ({ca}) cannot be loaded: {exc}") from None


def read_token(config: Config) -> bytes | None:
    """The shared token, or None when neither the file nor the environment gives one."""
    path = config.transport.token_file
    if path is not None:
        try:
            text = path.read_text()
        except OSError as exc:
            raise ConfigError(f"transport.token_file ({path}) cannot be read: "
                              f"{exc.strerror}") from None
        where = f"transport.token_file ({path})"
    else:
        text = os.environ.get(TOKEN_ENV, "")
        if not text:
            return None
        where = f"${TOKEN_ENV}"
    token = text.strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(f"the token in {where} has {len(token)} characters; it must have at "
                          f"least {MIN_TOKEN_CHARS} (for example: openssl rand -hex 32)")
    return token.encode()


def credentials(config: Config) -> Credentials:
    return Credentials(read_token(config), config.transport.insecure, config.transport.tls)
