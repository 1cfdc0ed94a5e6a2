"""The Helm chart (``ops/deploy/helm/kinfer``), rendered by Helm itself (``make deps`` builds it) and
checked as the plain manifests are: every object against Kubernetes' schema, every kinfer command
with the real parser, the selectors, the autoscaler's rights, the grace periods, the KEDA object
against the emitter, secure mode's principals against the ACL table, tracing's variables; and the
values schema refusing what would deploy something broken."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kinfer.ops.control.autoscaler import keda_scaled_object
from kinfer.ops.control.scaling import ScalePolicy
from kinfer.ops.deploy import secure as sec
from kinfer.ops.localstack.procs import helm_binary
from tests import ROOT
from tests.unit.ops.deploy.test_manifests import CRDS, KUBERNETES, containers, parses

CHART = ROOT / "ops" / "deploy" / "helm" / "kinfer"

FLEET = {
    "models": [
        {"name": "minilm", "family": "embedding", "partitions": 12, "replicas": 2},
        {"name": "tiny-lm", "family": "generator", "partitions": 6, "replicas": 1, "gpu": 1,
         "args": ["--path", "/models/tiny-lm"]},
    ],
    "autoscaling": {"mode": "kinfer", "min": 1, "max": 6},
}


def helm() -> str:
    found = helm_binary()
    if found is None:
        pytest.fail("helm is missing: `make deps` builds it with Go into the cache")
    return found


def render(values: dict[str, Any] | None = None, tmp: Path | None = None) -> list[dict[str, Any]]:
    cmd = [helm(), "template", "kinfer", str(CHART), "--namespace", "kinfer"]
    if values is not None:
        assert tmp is not None
        path = tmp / "values.yaml"
        path.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def refused(values: dict[str, Any], tmp: Path) -> str:
    path = tmp / "bad.yaml"
    path.write_text(yaml.safe_dump(values))
    out = subprocess.run([helm(), "template", "kinfer", str(CHART), "-f", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0, f"rendered: {values}"
    return out.stderr


def named(objects: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


def test_helm_lint_passes() -> None:
    out = subprocess.run([helm(), "lint", "--strict", str(CHART)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("values", [None, FLEET, {**FLEET, "autoscaling": {"mode": "keda", "min": 1, "max": 6}},
                                    {**FLEET, "secure": {"enabled": True}},
                                    {"tracing": {"exporter": "otlp", "endpoint": "http://otel:4318"}}])
def test_every_object_matches_the_kubernetes_schema_and_every_command_parses(
        values: dict[str, Any] | None, tmp_path: Path) -> None:
    import kubernetes_validate

    objects = render(values, tmp_path)
    assert objects
    for obj in objects:
        if obj["kind"] not in CRDS:
            kubernetes_validate.validate(obj, KUBERNETES, strict=True)  # raises, naming the field
        for c in containers(obj):
            parses(c["command"])
        assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kinfer"


def test_a_worker_pool_per_model_with_its_topics_budget_and_selectors(tmp_path: Path) -> None:
    objects = render(FLEET, tmp_path)
    deployments = named(objects, "Deployment")
    for model in FLEET["models"]:
        worker = deployments[f"kinfer-worker-{model['name']}"]
        spec = worker["spec"]
        assert spec["replicas"] == model["replicas"]
        assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
        args = parses(containers(worker)[0]["command"])
        assert args.model == [model["name"]] or args.model == model["name"]
        # a stopping worker drains within its grace period
        assert args.drain_timeout_s < spec["template"]["spec"]["terminationGracePeriodSeconds"]
        job = named(objects, "Job")[f"kinfer-topics-{model['name']}"]
        topics = parses(containers(job)[0]["command"])
        assert topics.partitions == model["partitions"]
        budget = named(objects, "PodDisruptionBudget")[f"kinfer-worker-{model['name']}"]
        assert budget["spec"]["selector"]["matchLabels"] == spec["selector"]["matchLabels"]
    gpu = containers(deployments["kinfer-worker-tiny-lm"])[0]["resources"]["limits"]
    assert gpu["nvidia.com/gpu"] == 1
    service = named(objects, "Service")["kinfer-gateway"]
    gateway = deployments["kinfer-gateway"]
    assert service["spec"]["selector"].items() <= gateway["spec"]["template"]["metadata"]["labels"].items()


def test_the_autoscalers_may_scale_their_workers_and_nothing_else(tmp_path: Path) -> None:
    objects = render(FLEET, tmp_path)
    role = named(objects, "Role")["kinfer-autoscaler"]
    (rule,) = role["rules"]
    assert rule["resources"] == ["deployments/scale"] and set(rule["verbs"]) == {"get", "patch"}
    assert set(rule["resourceNames"]) == {f"kinfer-worker-{m['name']}" for m in FLEET["models"]}
    deployments = named(objects, "Deployment")
    for model in FLEET["models"]:
        scaler = deployments[f"kinfer-autoscaler-{model['name']}"]
        args = parses(containers(scaler)[0]["command"])
        assert args.deployment == f"kinfer-worker-{model['name']}" and args.deployment in deployments
        assert scaler["spec"]["template"]["spec"]["serviceAccountName"] == "kinfer-autoscaler"


def test_keda_objects_are_what_the_emitter_writes(tmp_path: Path) -> None:
    values = {**FLEET, "autoscaling": {"mode": "keda", "min": 1, "max": 6, "replicaRps": 60}}
    objects = render(values, tmp_path)
    assert "Role" not in {o["kind"] for o in objects}  # no kinfer autoscaler beside KEDA
    scaled = named(objects, "ScaledObject")
    bootstrap = yaml.safe_load((CHART / "values.yaml").read_text())["kafka"]["bootstrap"]
    for model in FLEET["models"]:
        name = f"kinfer-worker-{model['name']}"
        ours = scaled[f"{name}-lag"]
        emitted = keda_scaled_object(model["name"], bootstrap, ScalePolicy(min_replicas=1, max_replicas=6,
                                                                           replica_rps=60),
                                     deployment=name, namespace="kinfer")
        assert ours["spec"]["scaleTargetRef"] == emitted["spec"]["scaleTargetRef"]
        assert ours["spec"]["triggers"] == emitted["spec"]["triggers"]
        assert ours["spec"]["advanced"] == emitted["spec"]["advanced"]
        for key in ("minReplicaCount", "maxReplicaCount", "pollingInterval", "cooldownPeriod"):
            assert ours["spec"][key] == emitted["spec"][key], key


def test_secure_mode_runs_each_component_as_its_principal_of_the_acl_table(tmp_path: Path) -> None:
    objects = render({**FLEET, "secure": {"enabled": True}}, tmp_path)
    config = named(objects, "ConfigMap")["kinfer-endpoints"]["data"]
    assert config["KINFER_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL" and "KINFER_REDIS_URL" not in config
    seen = set()
    for obj in objects:
        for c in containers(obj):
            env = {e["name"]: e for e in c.get("env", [])}
            principal = env["KINFER_KAFKA_USER"]["value"]
            assert principal in sec.SERVICE_PRINCIPALS, principal
            seen.add(principal)
            for name in ("KINFER_KAFKA_PASSWORD", "KINFER_REDIS_URL"):
                assert env[name]["valueFrom"]["secretKeyRef"]["name"] == f"{principal}-credentials"
            signs = principal in (sec.WORKER, sec.GATEWAY)
            assert ("KINFER_SIGNING_SECRET" in env) == signs, principal
            mounts = {m["mountPath"] for m in c["volumeMounts"]}
            assert config["KINFER_KAFKA_CA_FILE"].rsplit("/", 1)[0] in mounts
    assert seen == set(sec.SERVICE_PRINCIPALS)


def test_tracing_and_json_logs_reach_every_component(tmp_path: Path) -> None:
    objects = render({"tracing": {"exporter": "otlp", "endpoint": "http://otel:4318", "samplerArg": "0.05"}},
                     tmp_path)
    config = named(objects, "ConfigMap")["kinfer-endpoints"]["data"]
    assert config["OTEL_TRACES_EXPORTER"] == "otlp" and config["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel:4318"
    assert config["OTEL_TRACES_SAMPLER_ARG"] == "0.05" and config["KINFER_LOG_FORMAT"] == "json"
    for obj in objects:
        for c in containers(obj):
            assert {"configMapRef": {"name": "kinfer-endpoints"}} in c["envFrom"]
    assert "OTEL_TRACES_EXPORTER" not in named(render(), "ConfigMap")["kinfer-endpoints"]["data"]  # off by default


@pytest.mark.parametrize(("values", "says"), [
    ({"models": [{"name": "MiniLM", "family": "embedding"}]}, "name"),
    ({"models": [{"name": "m", "family": "llama"}]}, "family"),
    ({"models": []}, "models"),
    ({"autoscaling": {"mode": "hpa"}}, "mode"),
    ({"redis": {"url": "http://redis"}}, "url"),
    ({"models": [{"name": "m", "family": "noop", "partitions": 3}], "autoscaling": {"mode": "kinfer", "max": 8}},
     "partitions"),
    ({"worker": {"drainTimeoutS": 60, "terminationGracePeriodSeconds": 45}}, "terminationGracePeriodSeconds"),
])
def test_values_that_would_deploy_something_broken_are_refused(values: dict[str, Any], says: str,
                                                               tmp_path: Path) -> None:
    assert says in refused(values, tmp_path)
