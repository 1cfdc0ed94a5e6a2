"""Benchmarks on the local stack: open-loop load, percentiles and CPU per process, judged by the
SLA (``harness``). One module per benchmark; ``kinfer bench <name>`` runs it, ``kinfer bench plot``
draws its report; the current reports are in ``reports/``."""
