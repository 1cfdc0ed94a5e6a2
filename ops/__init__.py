"""Running kinfer, by role.

- ``ops.cli``: the ``kinfer`` command line, one module per command.
- ``ops.control``: the runtime control plane. Its services run in production beside the workers
  and gateways: the lag monitor (``kinfer lagmon``: lag to the health signal), the autoscaler
  (``kinfer autoscale``) and the telemetry stream processor (``kinfer telemetry``); ``kinfer status``
  reads what they keep. Its pure policies (``estimator``, ``scaling``) take ``now`` as an argument.
- ``ops.capacity``: capacity planning, no I/O: the roofline planner (``kinfer plan``), placement of
  models on a fleet (``kinfer place``) and the fleet simulator (``kinfer simulate``).
- ``ops.deploy``: what a deployment runs and mounts: the secure init container, the image's
  health check and entrypoint, the compose, Kubernetes, Prometheus and Grafana files.
- ``ops.localstack``: development on one machine: a real Kafka and Redis started here, their
  credentials, worker processes and the local worker pool.
- ``ops.bench``: benchmarks on the local stack, their plots and reports.
- ``ops.demo``: ``make demo``, the whole pipeline end to end.

Runtime code (``control``, ``deploy``) imports nothing from ``localstack``, ``bench`` or ``cli``.
"""
