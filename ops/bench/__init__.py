"""Benchmarks on the local stack: open-loop load, percentiles and CPU per process, judged by the
SLA. One module per benchmark, its picture beside it (``plot_<name>``, drawn with ``drawing``);
``harness`` is what they share (the stack they run on, waiting for what they started, the SLA, CPU
time), ``load`` and ``loadgen`` the open-loop load (in process, and in a process of its own).
``kinfer bench <name>`` runs one, ``kinfer bench plot`` draws its report (``plots`` picks the
picture); the current reports are in ``reports/``."""
