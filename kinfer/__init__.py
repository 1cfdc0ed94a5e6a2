"""kinfer: a Kafka-driven, asynchronous inference pipeline.

One namespace for the installed distribution. The repository keeps its five folders at its root;
``kinfer/`` links to them, so every module has exactly one name, ``kinfer.<package>.<module>``:

- ``kinfer.topics``: the contract (topic names, the envelope, errors, topic admin)
- ``kinfer.batcher``: pure scheduling (no I/O, no clock)
- ``kinfer.producers``: the client library and the HTTP gateway
- ``kinfer.consumers``: the worker and its model runners
- ``kinfer.ops``: running it: the command line, the control plane, capacity, deployment, the local stack, benchmarks

State and caches live in per-user folders (``kinfer.topics.paths``), never beside the code.
"""

__version__ = "0.1.0"
