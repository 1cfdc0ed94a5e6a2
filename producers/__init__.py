"""The client side: publish requests, correlate replies, raise typed errors; the HTTP gateway."""

from producers.blocking import BlockingClient
from producers.client import Client, ClientSettings

__all__ = ["BlockingClient", "Client", "ClientSettings"]
