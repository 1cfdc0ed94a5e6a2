"""The client side: publish requests, correlate replies, raise typed errors; the HTTP gateway."""

from kinfer.producers.blocking import BlockingClient
from kinfer.producers.client import Client, ClientSettings

__all__ = ["BlockingClient", "Client", "ClientSettings"]
