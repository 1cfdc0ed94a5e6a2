"""The deployment files, checked without a cluster: every kinfer command in them parses with the real
command line, the Kubernetes objects hang together (selectors, config, RBAC for the autoscaler, grace
periods longer than a worker's drain), and the KEDA object is what ``--emit keda`` writes today."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from ops.autoscaler import keda_scaled_object
from ops.cli import build_parser
from ops.scaling import ScalePolicy

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "ops" / "k8s"


def k8s_objects() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    spec = obj.get("spec", {})
    pod = spec.get("template", {}).get("spec", {}) if obj["kind"] in ("Deployment", "Job") else {}
    return list(pod.get("containers", []))


def parses(command: list[str]) -> Any:
    assert command[0] == "kinfer", command
    try:
        return build_parser().parse_args(command[1:])
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(command)}` does not parse") from exc


def by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in k8s_objects() if o["kind"] == kind}


def test_every_object_is_well_formed_and_every_kinfer_command_parses() -> None:
    objects = k8s_objects()
    assert objects
    config_maps = set(by_kind("ConfigMap"))
    for obj in objects:
        assert obj.get("apiVersion") and obj.get("kind") and obj["metadata"].get("name"), obj
        if obj["kind"] == "Deployment":
            labels = obj["spec"]["template"]["metadata"]["labels"]
            assert obj["spec"]["selector"]["matchLabels"].items() <= labels.items(), obj["metadata"]["name"]
        for c in containers(obj):
            assert c["image"] and c["command"][0] == "kinfer"
            parses(c["command"])
            for ref in c.get("envFrom", []):
                assert ref["configMapRef"]["name"] in config_maps
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert all((K8S / r).exists() for r in kustomization["resources"])


def test_the_autoscaler_may_scale_its_workers_and_nothing_else() -> None:
    autoscaler = by_kind("Deployment")["kinfer-autoscaler-minilm"]
    args = parses(containers(autoscaler)[0]["command"])
    assert args.mode == "kubernetes" and args.deployment in by_kind("Deployment")
    workers = by_kind("Deployment")[args.deployment]
    assert parses(containers(workers)[0]["command"]).model == [args.model]
    account = autoscaler["spec"]["template"]["spec"]["serviceAccountName"]
    assert account in by_kind("ServiceAccount")
    binding = next(b for b in by_kind("RoleBinding").values() if b["subjects"][0]["name"] == account)
    role = by_kind("Role")[binding["roleRef"]["name"]]
    # Exactly what KubernetesPool calls: GET and PATCH on the Deployment's scale subresource.
    assert role["rules"] == [{"apiGroups": ["apps"], "resources": ["deployments/scale"],
                              "resourceNames": [args.deployment], "verbs": ["get", "patch"]}]


def test_workers_get_longer_to_stop_than_they_take_to_drain() -> None:
    for name, obj in by_kind("Deployment").items():
        for c in containers(obj):
            args = parses(c["command"])
            if args.command == "worker":
                assert obj["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > args.drain_timeout_s, name
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name, service in compose["services"].items():
        command = service.get("command")
        if service.get("build") and command:
            args = parses(command)
            if args.command == "worker":
                assert float(service["stop_grace_period"].rstrip("s")) > args.drain_timeout_s, name


def test_the_keda_object_is_what_the_emitter_writes() -> None:
    text = (K8S / "keda-minilm.yaml").read_text()
    header = " ".join(line.lstrip("# ").rstrip("\\").strip() for line in text.splitlines()[1:3])
    env, _, command = header.partition(" ")
    key, _, bootstrap = env.partition("=")
    assert key == "KINFER_BOOTSTRAP"
    args = parses(shlex.split(command))
    policy = ScalePolicy(min_replicas=args.min_replicas, max_replicas=args.max_replicas, replica_rps=args.replica_rps)
    expected = keda_scaled_object(args.model, bootstrap, policy, deployment=args.deployment, namespace=args.namespace)
    assert yaml.safe_load(text) == expected
    assert expected["spec"]["scaleTargetRef"]["name"] in by_kind("Deployment")
    assert bootstrap == by_kind("ConfigMap")["kinfer-endpoints"]["data"]["KINFER_BOOTSTRAP"]


def test_the_image_runs_as_a_user_and_a_code_change_does_not_reinstall_torch() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#") and line[0].isupper()]
    names = [i[0] for i in instructions]
    deps = next(n for n, i in enumerate(instructions) if i[0] == "RUN" and "tomllib" in i[1])
    code = next(n for n, i in enumerate(instructions) if i == ["COPY", "ops ops"])
    assert deps < code  # the heavy layer is built from pyproject.toml alone
    assert next(i for i in instructions if i[0] == "COPY")[1] == "pyproject.toml ./"
    user = [i[1] for i in instructions if i[0] == "USER"]
    assert user and user[-1] not in ("root", "0") and names.index("USER") > code
    cmd = next(i[1] for i in instructions if i[0] == "CMD")
    assert parses(yaml.safe_load(cmd)).command == "gateway"
    assert "EXPOSE" in names


def test_compose_services_restart_and_report_health() -> None:
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for name in ("worker-minilm", "gateway"):
        service = compose["services"][name]
        assert service["restart"] == "unless-stopped" and service["healthcheck"]["test"][0] == "CMD", name
