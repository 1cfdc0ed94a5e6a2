"""How every kinfer process connects to Kafka and Redis: one place reads the credentials.

Kafka's security settings come from the environment (so a worker, a gateway and a lag monitor
started by an orchestrator, a compose file or ``kinfer stack env`` all read them the same way):

    KINFER_KAFKA_SECURITY_PROTOCOL   PLAINTEXT (default), SSL, SASL_PLAINTEXT or SASL_SSL
    KINFER_KAFKA_SASL_MECHANISM      SCRAM-SHA-512 (default), SCRAM-SHA-256 or PLAIN
    KINFER_KAFKA_USER / KINFER_KAFKA_PASSWORD   the SASL principal
    KINFER_KAFKA_CA_FILE             PEM file of the CA that signed the brokers' certificates

Redis takes everything from its URL (``KINFER_REDIS_URL``): ``redis://user:password@host:port/0``,
or ``rediss://...?ssl_ca_certs=/path/ca.pem`` for TLS. Every aiokafka client in kinfer is built with
``kafka_options()``, so no component can be left talking plaintext by accident.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cache
from typing import Any

PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")


@dataclass(frozen=True, slots=True)
class KafkaAuth:
    """The transport security of one Kafka principal."""

    protocol: str = "PLAINTEXT"
    mechanism: str = "SCRAM-SHA-512"
    user: str | None = None
    password: str | None = None
    ca_file: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"KINFER_KAFKA_SECURITY_PROTOCOL must be one of {', '.join(PROTOCOLS)}, "
                             f"got {self.protocol!r}")
        if self.sasl:
            if self.mechanism not in MECHANISMS:
                raise ValueError(f"KINFER_KAFKA_SASL_MECHANISM must be one of {', '.join(MECHANISMS)}, "
                                 f"got {self.mechanism!r}")
            if not self.user or not self.password:
                raise ValueError(f"{self.protocol} needs KINFER_KAFKA_USER and KINFER_KAFKA_PASSWORD")

    @property
    def sasl(self) -> bool:
        return self.protocol.startswith("SASL_")

    @property
    def tls(self) -> bool:
        return self.protocol in ("SSL", "SASL_SSL")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> KafkaAuth:
        env = os.environ if env is None else env
        return cls(
            protocol=env.get("KINFER_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper(),
            mechanism=env.get("KINFER_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512").upper(),
            user=env.get("KINFER_KAFKA_USER") or None,
            password=env.get("KINFER_KAFKA_PASSWORD") or None,
            ca_file=env.get("KINFER_KAFKA_CA_FILE") or None,
        )

    def env(self) -> dict[str, str]:
        """The environment that gives a child process these settings."""
        out = {"KINFER_KAFKA_SECURITY_PROTOCOL": self.protocol}
        if self.sasl:
            out |= {"KINFER_KAFKA_SASL_MECHANISM": self.mechanism, "KINFER_KAFKA_USER": self.user or "",
                    "KINFER_KAFKA_PASSWORD": self.password or ""}
        if self.ca_file:
            out["KINFER_KAFKA_CA_FILE"] = self.ca_file
        return out

    def options(self) -> dict[str, Any]:
        """Keyword arguments for any aiokafka client (producer, consumer, admin, bare client)."""
        if self.protocol == "PLAINTEXT":
            return {}
        opts: dict[str, Any] = {"security_protocol": self.protocol}
        if self.tls:
            opts["ssl_context"] = _ssl_context(self.ca_file)
        if self.sasl:
            opts |= {"sasl_mechanism": self.mechanism, "sasl_plain_username": self.user,
                     "sasl_plain_password": self.password}
        return opts


@cache
def _ssl_context(ca_file: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca_file)  # verifies the broker's name and chain
    return context


def kafka_options(bootstrap: str, **extra: Any) -> dict[str, Any]:
    """``bootstrap_servers`` plus this process's Kafka security settings, plus ``extra``."""
    return {"bootstrap_servers": bootstrap, **KafkaAuth.from_env().options(), **extra}


async def tls_closes_settled(timeout_s: float = 1.0) -> None:
    """Wait (at most ``timeout_s``) until this event loop has no connection left open.

    aiokafka closes a TLS connection (its bootstrap connection, for one) without waiting for the TLS
    shutdown to finish; an ``asyncio.run`` that ends at once leaves the socket to the garbage
    collector (a ResourceWarning, an error in the tests). Await this last in such a coroutine.
    """
    loop = asyncio.get_running_loop()
    transports = getattr(loop, "_transports", None)  # the selector loop's open transports, by fd
    if transports is None:
        await asyncio.sleep(0.1)
        return
    for _ in range(max(1, int(timeout_s / 0.01))):  # polled: closing transports signal nothing to wait on
        if not len(transports):
            return
        await asyncio.sleep(0.01)
