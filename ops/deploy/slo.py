"""The Prometheus rules for kinfer's service level, written from the SLA itself (``ops.capacity.sla``).

``python -m kinfer.ops.deploy.slo > ops/deploy/prometheus/rules/kinfer.yml`` writes them; a test holds
the file to this module. Three objectives, per model, on the client library's series (every request
made through it, the gateway's included: ``producers.metrics``):

- availability: ``SLA_AVAILABILITY`` of requests end ok (refused, shed, expired, failed and unanswered
  ones all count against it; a caller's invalid request does not);
- latency: 95 % of answered requests within ``SLA_P95_MS``, and 99 % within ``SLA_P99_MS``.

Each has an error budget (1 - objective) and is watched the way the Google SRE workbook recommends
(chapter 5, "Alerting on SLOs"): multiwindow, multi-burn-rate alerts. A page when the budget burns
14.4 times too fast over an hour (2 % of a 30-day budget) and still over the last 5 minutes, or 6 times
over 6 hours and the last 30 minutes; a ticket at 3 times over a day (and 2 hours) or once over 3 days
(and 6 hours). The short window makes an alert stop soon after the burn does.

Beside them, alerts on what comes before a breach or is wrong in itself: a model refusing, a queue
whose predicted wait is past the P95 budget, a model with traffic and no warm worker, dead letters,
malformed or forged messages, and a worker, lag monitor or gateway that stopped answering scrapes.
Annotations name labels, never ``$value``: the value is on the alert, and the tests
(``tests/prometheus/``, ``promtool test rules``) compare annotations exactly.
"""

from __future__ import annotations

import sys
from typing import Any

import yaml

from kinfer.ops.capacity.sla import SLA_AVAILABILITY, SLA_P95_MS, SLA_P99_MS

REQUESTS = "kinfer_client_requests_total"
LATENCY = "kinfer_client_request_seconds"
WINDOWS = ("5m", "30m", "1h", "2h", "6h", "1d", "3d")
# (long window, short window, burn rate, severity): the workbook's table 5-8.
BURNS = (("1h", "5m", 14.4, "page"), ("6h", "30m", 6.0, "page"), ("1d", "2h", 3.0, "ticket"),
         ("3d", "6h", 1.0, "ticket"))
# name -> (alert name part, the objective in words, what counts against it, error budget)
OBJECTIVES: dict[str, tuple[str, str, str, float]] = {
    "errors": ("Availability", f"availability ({SLA_AVAILABILITY:.2%} answered ok)", "requests not answered ok",
               1.0 - SLA_AVAILABILITY),
    "slow_p95": ("LatencyP95", f"P95 latency ({SLA_P95_MS:.0f} ms)",
                 f"answered requests slower than {SLA_P95_MS:.0f} ms", 0.05),
    "slow_p99": ("LatencyP99", f"P99 latency ({SLA_P99_MS:.0f} ms)",
                 f"answered requests slower than {SLA_P99_MS:.0f} ms", 0.01),
}



def born_or_grew(series: str, by: str, window: str = "10m") -> str:
    """Counted events in the last ``window``, per ``by``. A labelled counter's series is born at its first
    event (a reason never seen before), at 1, and ``increase()`` over a series that starts at 1 is 0:
    so a series that is above 0 now and did not exist ``window`` ago counts too."""
    return (f"sum by ({by}) (increase({series}[{window}])) > 0\n"
            f"or (sum by ({by}) ({series}) > 0 unless sum by ({by}) ({series} offset {window}))")

def _ratio(objective: str, window: str) -> str:
    if objective == "errors":  # 0, not nothing, for a model that never failed (its bad series do not exist)
        return (f'(sum by (model) (rate({REQUESTS}{{outcome!="ok"}}[{window}]))\n'
                f"or 0 * sum by (model) (rate({REQUESTS}[{window}])))\n"
                f"/ sum by (model) (rate({REQUESTS}[{window}]))")
    le = (SLA_P95_MS if objective == "slow_p95" else SLA_P99_MS) / 1000.0
    return (f'1 - sum by (model) (rate({LATENCY}_bucket{{le="{le:g}"}}[{window}]))\n'
            f"/ sum by (model) (rate({LATENCY}_count[{window}]))")


def record(objective: str, window: str) -> str:
    return f"model:kinfer_{objective}:ratio_rate{window}"


def recording_rules() -> list[dict[str, Any]]:
    rules: list[dict[str, Any]] = []
    for objective in OBJECTIVES:
        rules += [{"record": record(objective, w), "expr": _ratio(objective, w)} for w in WINDOWS]
    for q in ("0.5", "0.95", "0.99"):
        rules.append({"record": f"model:kinfer_request_seconds:p{q[2:].ljust(2, '0')}_rate5m",
                      "expr": f"histogram_quantile({q}, sum by (model, le) (rate({LATENCY}_bucket[5m])))"})
    rules.append({"record": "model:kinfer_requests:rate5m", "expr": f"sum by (model) (rate({REQUESTS}[5m]))"})
    return rules


def burn_alerts() -> list[dict[str, Any]]:
    alerts = []
    for objective, (name, title, bad, budget) in OBJECTIVES.items():
        for speed, severity in (("Fast", "page"), ("Slow", "ticket")):
            burns = [(long, short, rate) for long, short, rate, sev in BURNS if sev == severity]
            expr = "\nor\n".join(
                f"({record(objective, long)} > {rate:g} * {budget:g}\n"
                f"and {record(objective, short)} > {rate:g} * {budget:g})" for long, short, rate in burns)
            windows = ", or ".join(f"{rate:g}-fold over {long} and {short}" for long, short, rate in burns)
            alerts.append({
                "alert": f"Kinfer{name}Budget{speed}Burn",
                "expr": expr,
                "labels": {"severity": severity, "slo": objective},
                "annotations": {
                    "summary": f"{{{{ $labels.model }}}}: the {title} error budget burns too fast",
                    "description": f"The share of {bad} is over the budget ({budget:g}) {windows}.",
                },
            })
    return alerts


def signal_alerts() -> list[dict[str, Any]]:
    p95_s = SLA_P95_MS / 1000.0
    return [
        {"alert": "KinferModelRejecting", "expr": "max by (model) (kinfer_health_level) >= 3", "for": "2m",
         "labels": {"severity": "page"},
         "annotations": {"summary": "{{ $labels.model }} refuses every request but p0: its queue is past 500 ms",
                         "description": "The lag monitor's level has been REJECTING for 2 minutes. Add workers "
                                        "(kinfer autoscale), or find what stopped them (kinfer status)."}},
        {"alert": "KinferQueueOverBudget", "expr": f"max by (model) (kinfer_predicted_wait_seconds) > {p95_s:g}",
         "for": "5m", "labels": {"severity": "ticket"},
         "annotations": {"summary": "{{ $labels.model }}: new requests wait longer in the queue than the P95 allows",
                         "description": f"The predicted wait has been over the P95 budget ({SLA_P95_MS:.0f} ms) "
                                        "for 5 minutes: the model is short of workers."}},
        {"alert": "KinferModelWithoutWorkers",
         "expr": "max by (model) (kinfer_warm_replicas) == 0 and max by (model) (kinfer_arrival_rps) > 0",
         "for": "5m", "labels": {"severity": "page"},
         "annotations": {"summary": "{{ $labels.model }} has traffic and no warm worker",
                         "description": "Records arrive and no worker has had the model warm for 5 minutes: "
                                        "a cold start takes seconds, not this."}},
        {"alert": "KinferDeadLetters", "expr": "sum by (model) (increase(kinfer_dead_letters_total[10m])) > 0",
         "labels": {"severity": "ticket"},
         "annotations": {"summary": "{{ $labels.model }}: records were dead-lettered in the last 10 minutes",
                         "description": "Malformed or poison records reached infer.dlq (kinfer_dead_letters_total"
                                        " by field says what was wrong)."}},
        {"alert": "KinferMalformedRecords",
         "expr": born_or_grew("kinfer_malformed_records_total", "reader, reason"),
         "labels": {"severity": "ticket"},
         "annotations": {"summary": "{{ $labels.reader }} refused malformed records ({{ $labels.reason }})",
                         "description": "A bug or a forgery: kinfer's own records (health, stats, residency, "
                                        "answered reports) that do not decode or are dated ahead."}},
        {"alert": "KinferForgedReplies",
         "expr": "sum(increase(kinfer_client_forged_replies_total[10m])) > 0\nor "
                 + born_or_grew('kinfer_client_replies_refused_total{reason=~"unsealed|unopened"}', "reason"),
         "labels": {"severity": "page"},
         "annotations": {"summary": "replies not sealed for their client were dropped",
                         "description": "Someone writes to clients' reply channels or topics without the "
                                        "workers' keys: a forgery attempt, or a worker with the wrong secrets."}},
        {"alert": "KinferTargetDown", "expr": 'up{job=~"kinfer-.*"} == 0', "for": "2m",
         "labels": {"severity": "ticket"},
         "annotations": {"summary": "{{ $labels.job }} {{ $labels.instance }} has not answered scrapes for 2 minutes",
                         "description": "A worker, lag monitor, telemetry processor or gateway is down or stuck. "
                                        "Without the lag monitor, producers run on adaptive throttling alone."}},
    ]


def rules() -> dict[str, Any]:
    return {"groups": [
        {"name": "kinfer-sli", "interval": "30s", "rules": recording_rules()},
        {"name": "kinfer-slo", "rules": burn_alerts()},
        {"name": "kinfer-signals", "rules": signal_alerts()},
    ]}


class _Literal(str):
    pass


def _literal(dumper: yaml.SafeDumper, value: _Literal) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


def render() -> str:
    """The rules file: multi-line expressions as YAML block literals, so it reads like hand-written PromQL."""
    yaml.SafeDumper.add_representer(_Literal, _literal)  # this module's own type: nothing else changes
    data = rules()
    for group in data["groups"]:
        for rule in group["rules"]:
            if "\n" in rule["expr"]:
                rule["expr"] = _Literal(rule["expr"])
    head = ("# Generated by `python -m kinfer.ops.deploy.slo` from ops/capacity/sla.py: edit those, not this.\n"
            "# Recording rules for kinfer's service level per model, multiwindow multi-burn-rate alerts on its\n"
            "# three objectives, and alerts on the signals that come before a breach. Tests: tests/prometheus/.\n")
    return head + str(yaml.safe_dump(data, sort_keys=False, width=120))


if __name__ == "__main__":
    sys.stdout.write(render())
