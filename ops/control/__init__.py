"""The runtime control plane: lag to health (``lagmon``), lag to replicas (``autoscaler``), the
telemetry stream processor (``telemetry``) and what they keep, read back (``status``). The decisions
are pure (``estimator``, ``scaling``: ``now`` passed in); the rest are their async shells."""
