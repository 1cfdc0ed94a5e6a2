"""The client side: publish requests, correlate replies, raise typed errors."""

from producers.client import Client, ClientSettings

__all__ = ["Client", "ClientSettings"]
