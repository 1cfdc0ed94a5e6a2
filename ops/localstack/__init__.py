"""Development on one machine: ``stack`` (a real Kafka and Redis started here, recorded in
``KINFER_HOME``), ``procs`` (worker and component processes) and ``pool`` (the local worker pool
the autoscaler drives)."""
