"""The service level's Prometheus rules: generated from the SLA, valid to promtool, every alert tested
by ``promtool test rules`` (fires on a synthetic breach, silent on a healthy series), and written on
series the code exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from kinfer.ops.deploy.slo import render
from kinfer.ops.localstack.procs import prometheus_binary
from tests.unit.ops.deploy.test_manifests import defined_metrics

ROOT = Path(__file__).resolve().parents[4]
RULES = ROOT / "ops" / "deploy" / "prometheus" / "rules" / "kinfer.yml"
TESTS = ROOT / "tests" / "prometheus" / "kinfer_test.yml"


def promtool() -> str:
    found = prometheus_binary("promtool")
    if found is None:
        pytest.fail("promtool is missing: `make deps` unpacks Debian's prometheus package into the cache")
    return found


def run(*args: str) -> str:
    done = subprocess.run([promtool(), *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def rules() -> list[dict[str, object]]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]


def test_the_rules_file_is_what_the_sla_generates() -> None:
    assert RULES.read_text() == render(), f"regenerate it: python -m kinfer.ops.deploy.slo > {RULES.relative_to(ROOT)}"


def test_promtool_accepts_the_rules_and_the_scrape_configuration() -> None:
    assert f"SUCCESS: {len(rules())} rules found" in run("check", "rules", str(RULES))
    assert "1 rule files found" in run("check", "config", "ops/deploy/prometheus/prometheus.yml")


def test_every_alert_fires_on_a_breach_and_is_silent_when_healthy_in_promtool() -> None:
    run("test", "rules", str(TESTS))
    cases = [c for t in yaml.safe_load(TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in (str(r["alert"]) for r in rules() if "alert" in r):
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c.get("exp_alerts") for c in mine), f"{alert}: no test where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{alert}: no test where it stays silent"


def test_the_rules_ask_only_for_series_the_code_exports_with_their_labels() -> None:
    defined = defined_metrics() | {"up": {"job", "instance"}}
    recorded = {str(r["record"]) for r in rules() if "record" in r}
    for rule in rules():
        expr = str(rule["expr"])
        names = set(re.findall(r"\b([a-z_][a-z0-9_:]*)\s*[{\[]", expr))
        names |= set(re.findall(r"\b(model:[a-z0-9_:]+)", expr))
        for name in names:
            assert name in defined or name in recorded, (rule.get("alert") or rule.get("record"), name)
        for metric, matchers in re.findall(r"\b([a-z_][a-z0-9_]*)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in defined[metric] | {"job", "instance"}, (expr, metric, label)


def test_the_latency_histogram_has_bounds_at_the_sla_thresholds() -> None:
    from kinfer.ops.capacity.sla import SLA_P95_MS, SLA_P99_MS
    from kinfer.producers.metrics import LATENCY_BUCKETS

    assert SLA_P95_MS / 1000 in LATENCY_BUCKETS and SLA_P99_MS / 1000 in LATENCY_BUCKETS
