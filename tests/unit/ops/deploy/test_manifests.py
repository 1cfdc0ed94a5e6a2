"""The deployment files, checked without a cluster: every kinfer command in them parses with the real
command line, the Kubernetes objects hang together (selectors, config, RBAC for the autoscaler, grace
periods longer than a worker's drain), and the KEDA object is what ``--emit keda`` writes today.

``docker-compose.yml`` (no Docker engine here: checked by reading it): every service restarts and
reports its health but the one-shot jobs, which others wait for; every service that talks to Kafka
acts as a principal of ``ops.deploy.secure``'s table with its own secrets volume, which the secrets job
writes; the brokers are the layout the secrets job wrote their configuration for; Prometheus
scrapes every metrics port; the Grafana dashboard asks only for metrics the code defines."""

from __future__ import annotations

import ast
import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from kinfer.ops.cli import build_parser
from kinfer.ops.control.autoscaler import keda_scaled_object
from kinfer.ops.control.scaling import ScalePolicy
from kinfer.ops.deploy import secure as sec
from kinfer.ops.deploy import secure_init as si
from tests import ROOT

K8S = ROOT / "ops" / "deploy" / "k8s"
SECURE_INIT = ["python", "-m", "kinfer.ops.deploy.secure_init"]


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
    for name, service in compose_services().items():
        args = kinfer_args(service)
        if args is not None and args.command == "worker":
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
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().replace("\\\n", " ").splitlines()]
    instructions = [line.split(None, 1) for line in lines if line and not line.startswith("#") and line[0].isupper()]
    names = [i[0] for i in instructions]
    deps = next(n for n, i in enumerate(instructions) if i[0] == "RUN" and "uv sync --frozen" in i[1])
    code = next(n for n, i in enumerate(instructions) if i == ["COPY", "ops ops"])
    assert deps < code  # the heavy layer is built from pyproject.toml and the lock alone
    assert next(i for i in instructions if i[0] == "COPY")[1] == "pyproject.toml uv.lock ./"
    user = [i[1] for i in instructions if i[0] == "USER"]
    assert user and user[-1] not in ("root", "0") and names.index("USER") > code
    cmd = next(i[1] for i in instructions if i[0] == "CMD")
    assert parses(yaml.safe_load(cmd)).command == "gateway"
    assert "EXPOSE" in names


def test_the_image_has_build_stages_a_cuda_variant_a_healthcheck_and_the_license() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM \S+ AS (\w+)$", text, re.MULTILINE)
    assert stages == ["deps", "build", "runtime"]
    runtime = text.split("AS runtime", 1)[1]
    assert "COPY --from=build /opt/kinfer /opt/kinfer" in runtime and "pip install" not in runtime
    assert "ARG TORCH=cpu" in text and "download.pytorch.org/whl/cpu" in text
    assert 'CMD ["python", "-m", "kinfer.ops.deploy.healthcheck"]' in runtime and "HEALTHCHECK" in runtime
    assert "COPY LICENSE" in runtime and (ROOT / "LICENSE").read_text().count("Apache License") >= 1
    gpu = compose_services()["worker-minilm-gpu"]
    assert gpu["build"]["args"] == {"TORCH": "cuda"}


def test_every_kinfer_service_is_checked_where_it_serves() -> None:
    """The image's check (ops/deploy/healthcheck.py) asks each compose service what its command serves:
    the gateway's /healthz, else the metrics port Prometheus scrapes."""
    from kinfer.ops.deploy.healthcheck import probe

    targets = prometheus_targets()
    for name, service in compose_services().items():
        if service.get("healthcheck", {}).get("test") != ["CMD", "python", "-m", "kinfer.ops.deploy.healthcheck"]:
            continue
        kind, port = probe(["/opt/kinfer/bin/kinfer", *service["command"][1:]]) or ("none", 0)
        host = "kinfer-workers" if "kinfer-workers" in str(service.get("networks")) else name
        assert kind == "tcp" and (host, port) in targets, (name, kind, port)
    assert probe(["kinfer", "gateway", "--port", "8080"]) == ("http", 8080)
    assert probe(["/opt/kinfer/bin/python", "/opt/kinfer/bin/kinfer", "gateway"]) == ("http", 8000)
    assert probe(["python", "-m", "kinfer.ops.cli", "lagmon", "--metrics-port=9101"]) == ("tcp", 9101)
    assert probe(["kinfer", "topics", "--model", "m"]) is None  # nothing to ask: healthy while it runs
    assert probe(["python", "-m", "kinfer.ops.deploy.secure_init"]) is None


def test_the_healthcheck_reads_a_console_script_started_through_its_interpreter(tmp_path: Path) -> None:
    """PID 1 of the image is the ``kinfer`` console script; Linux runs it through its #! line, so the
    process's command line starts with the interpreter, not with kinfer."""
    import subprocess
    import sys
    import time

    from kinfer.ops.deploy.healthcheck import main_command, probe

    script = tmp_path / "bin" / "kinfer"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(30)\n")
    script.chmod(0o755)
    proc = subprocess.Popen([str(script), "worker", "--model", "minilm", "--metrics-port", "9100"])
    try:
        for _ in range(50):  # until the interpreter has exec'd (a count, not a clock)
            if main_command(proc.pid)[:2] == [sys.executable, str(script)]:
                break
            time.sleep(0.1)
        command = main_command(proc.pid)
        assert command[0] == sys.executable and command[1] == str(script)
        assert probe(command) == ("tcp", 9100)
    finally:
        proc.kill()
        proc.wait()




# ---------------------------------------------------------------------------------------------
# docker-compose.yml


def compose_file() -> dict[str, Any]:
    """The compose file as ``docker compose config`` would see it with nothing set in the environment:
    ``${VAR:-default}`` is its default, ``$$`` a literal ``$``."""
    text = (ROOT / "docker-compose.yml").read_text()
    text = re.sub(r"(?<!\$)\$\{\w+:-([^}]*)\}", r"\1", text)
    assert not re.search(r"(?<!\$)\$\{", text), "a variable without a default"
    text = text.replace("$$", "$")
    data: dict[str, Any] = yaml.safe_load(text)
    return data


def compose_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = compose_file()["services"]
    return services


def full_command(service: dict[str, Any]) -> list[str]:
    """What the container runs, less the kinfer image's entrypoint (which runs the rest)."""
    return [*service.get("entrypoint", []), *service.get("command", [])]


def kinfer_args(service: dict[str, Any]) -> Any:
    """The parsed `kinfer` command of a service (None for other commands)."""
    command = full_command(service)
    return parses(command) if command[:1] == ["kinfer"] else None


def secure_init_args(service: dict[str, Any]) -> Any:
    command = full_command(service)
    assert command[:3] == SECURE_INIT, command
    try:
        return si.build_parser().parse_args(command[3:])
    except SystemExit as exc:
        raise AssertionError(f"`{shlex.join(command)}` does not parse") from exc


def mounts(service: dict[str, Any]) -> dict[str, tuple[str, bool]]:
    """source -> (target, read only) of a service's volumes (short syntax)."""
    out = {}
    for volume in service.get("volumes", []):
        source, target, *mode = volume.split(":")
        out[source] = (target, mode == ["ro"])
    return out


def one_shot_jobs() -> set[str]:
    return {name for name, service in compose_services().items() if service.get("restart") == "no"}


def test_every_command_in_compose_parses() -> None:
    for name, service in compose_services().items():
        if not service.get("build"):
            continue
        command = full_command(service)
        assert command[:1] == ["kinfer"] or command[:3] == SECURE_INIT, name
        if command[:1] == ["kinfer"]:
            kinfer_args(service)
        else:
            secure_init_args(service)


def test_compose_services_restart_and_report_health() -> None:
    services = compose_services()
    jobs = one_shot_jobs()
    assert jobs == {"secrets", "topics", "setup"}
    for name, service in services.items():
        if name in jobs:
            assert "healthcheck" not in service, name
            continue
        assert service.get("restart") == "unless-stopped", name
        test = service["healthcheck"]["test"]
        assert test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, name
    for name, service in services.items():
        for dependency, condition in service.get("depends_on", {}).items():
            assert dependency in services, (name, dependency)
            expected = "service_completed_successfully" if dependency in jobs else "service_healthy"
            assert condition == {"condition": expected}, (name, dependency)

    def needs(name: str) -> set[str]:
        direct = set(services[name].get("depends_on", {}))
        return direct.union(*(needs(d) for d in direct)) if direct else set()

    for name, service in services.items():  # whoever reads a secret starts after they are written
        if name != "secrets" and any(source.startswith("secrets-") for source in mounts(service)):
            assert "secrets" in needs(name), name


def test_every_kafka_client_acts_as_a_principal_of_the_acl_table() -> None:
    from kinfer.ops.cli import COMMANDS

    services = compose_services()
    layout = si.layout_from(secure_init_args(services["secrets"]))
    table = {acl.principal.removeprefix("User:") for acl in sec.kafka_acls(sec.DEFAULT_TENANTS, ["minilm"])}
    known = table | {sec.ADMIN}  # admin: a super user (super.users), allowed without ACLs
    users = set()
    for name, service in services.items():
        env = service.get("environment", {})
        if "KINFER_BOOTSTRAP" not in env:
            assert not any(key.startswith("KINFER_KAFKA") for key in env), name
            continue
        user = env["KINFER_KAFKA_USER"]
        users.add(user)
        assert user in known, (name, user)
        assert env["KINFER_BOOTSTRAP"] == layout.bootstrap, name
        assert env["KINFER_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL", name
        assert env["KINFER_KAFKA_SASL_MECHANISM"] == "SCRAM-SHA-512", name
        assert not {"KINFER_KAFKA_PASSWORD", "KINFER_SIGNING_SECRET"} & set(env), name  # files only
        volumes = mounts(service)
        secret_volumes = {source for source in volumes if source.startswith("secrets-")}
        assert secret_volumes <= {f"secrets-{user}", "secrets-state"}, name  # its own secrets, no one else's
        target, read_only = volumes[f"secrets-{user}"]
        assert read_only, name
        assert env["KINFER_KAFKA_CA_FILE"] == f"{target}/ca.pem", name
        assert env["KINFER_KAFKA_PASSWORD_FILE"] == env["KINFER_REDIS_PASSWORD_FILE"] == f"{target}/password", name
        url = re.fullmatch(r"redis://([^:@/]+)@redis:6379/0", env["KINFER_REDIS_URL"])
        assert url and url.group(1) == user, name  # the same principal on Redis, its password from the file
        args = kinfer_args(service)
        command = COMMANDS[args.command] if args is not None else None
        if command is not None and command.principal and command.name not in ("infer", "bench"):
            assert user == command.principal, name  # what `stack up --secure` gives it
        signs = args is not None and args.command in ("worker", "gateway")
        if signs:
            assert env["KINFER_SIGNING_SECRET_FILE"] == f"{target}/signing-secret", name
            assert user in si.SIGNERS
        else:
            assert "KINFER_SIGNING_SECRET_FILE" not in env, name
    principals = secure_init_args(services["secrets"]).principals or si.COMPOSE_PRINCIPALS
    assert users == set(principals)


def test_the_secrets_job_writes_the_volumes_their_readers_mount() -> None:
    services = compose_services()
    declared = {name for name in compose_file()["volumes"] if name.startswith("secrets-")}
    init = secure_init_args(services["secrets"])
    assert services["secrets"]["user"] == "root"  # it hands each volume to its reader
    written = {source: target for source, (target, read_only) in mounts(services["secrets"]).items()}
    principals = init.principals or si.COMPOSE_PRINCIPALS
    assert written == {f"secrets-{name}": f"{init.out}/{name}"
                       for name in ["state", "kafka", "redis", "grafana", *principals]}
    assert set(written) == declared
    assert written["secrets-state"] == init.state
    readers: dict[str, set[str]] = {}
    for name, service in services.items():
        for source, (_, read_only) in mounts(service).items():
            if source in declared and name != "secrets":
                readers.setdefault(source, set()).add(name)
                assert read_only, (name, source)
    assert readers["secrets-state"] == {"setup"}  # the CA key and every password: the jobs only
    setup = services["setup"]
    assert secure_init_args(setup).state == mounts(setup)["secrets-state"][0]
    assert secure_init_args(setup).action == "setup"
    redis = services["redis"]
    aclfile = redis["command"][redis["command"].index("--aclfile") + 1]
    assert aclfile == f"{mounts(redis)['secrets-redis'][0]}/users.acl"
    grafana = services["grafana"]
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == \
        f"{mounts(grafana)['secrets-grafana'][0]}/admin-password"
    assert readers["secrets-kafka"] == {"kafka-1", "kafka-2", "kafka-3", "kafka-controller-1", "kafka-controller-2",
                                        "kafka-controller-3"}


def test_the_kafka_nodes_are_the_layout_the_secrets_job_configured() -> None:
    services = compose_services()
    layout = si.layout_from(secure_init_args(services["secrets"]))
    nodes = [name for name, service in services.items() if service.get("image", "").startswith("apache/kafka:")]
    assert nodes == list(layout.nodes) and len(layout.controllers) == len(layout.brokers) == 3
    for name in layout.controllers:  # the quorum of its own: no client listener, nothing published
        service = services[name]
        assert service["environment"] == {"KINFER_NODE": name} and "ports" not in service
        assert mounts(service)[name] == (layout.data_dir, False)
        assert f"/{layout.controller_port}" in service["healthcheck"]["test"][1]
        assert service["command"] == services[layout.brokers[0]]["command"]
    for i, name in enumerate(layout.brokers):
        service = services[name]
        assert service["environment"] == {"KINFER_NODE": name}
        port = layout.host_port_of(i)
        assert service["ports"] == [f"127.0.0.1:{port}:{port}"]  # the HOST listener, loopback by default
        volumes = mounts(service)
        assert volumes[name] == (layout.data_dir, False)
        assert volumes["secrets-kafka"] == (layout.kafka_dir, True)
        script = next(source for source in volumes if source.endswith("kafka-start.sh"))
        assert (ROOT / script).is_file() and service["command"] == ["bash", volumes[script][0]]
        assert f"{layout.kafka_dir}/admin.properties" in service["healthcheck"]["test"][1]
        props = dict(line.split("=", 1) for line in si.broker_properties(layout, i, "pw").splitlines())
        assert props["advertised.listeners"] == f"CLIENT://{name}:9092,HOST://localhost:{port}"
    assert layout.host_bootstrap == "localhost:19092,localhost:19093,localhost:19094"


def test_workers_for_embeddings_generation_and_a_gpu_profile() -> None:
    services = compose_services()
    topics = kinfer_args(services["topics"])
    workers = {name: kinfer_args(s) for name, s in services.items()
               if kinfer_args(s) is not None and kinfer_args(s).command == "worker"}
    assert {name: args.model for name, args in workers.items()} == {
        "worker-minilm": ["minilm"], "worker-minilm-gpu": ["minilm"], "worker-tiny-lm": ["tiny-lm"]}
    assert {m for args in workers.values() for m in args.model} <= set(topics.model)
    for name, service in services.items():
        assert ("profiles" in service) == (name == "worker-minilm-gpu"), name
    gpu = services["worker-minilm-gpu"]
    assert gpu["profiles"] == ["gpu"] and workers["worker-minilm-gpu"].device == "cuda"
    assert gpu["deploy"]["resources"]["reservations"]["devices"] == [
        {"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "resources" not in services["worker-minilm"].get("deploy", {})
    for name in workers:
        assert "kinfer-workers" in services[name]["networks"]["default"]["aliases"], name


def test_compose_mounts_files_that_exist() -> None:
    for name, service in compose_services().items():
        for source in mounts(service):
            if source.startswith("./"):
                assert (ROOT / source).exists(), (name, source)


def test_the_image_runs_the_secrets_entrypoint() -> None:
    lines = [line.strip() for line in (ROOT / "Dockerfile").read_text().splitlines()]
    entrypoint = next(json.loads(line.split(None, 1)[1]) for line in lines if line.startswith("ENTRYPOINT"))
    assert entrypoint[:1] == ["/bin/sh"] and entrypoint[1].startswith("/app/")
    assert (ROOT / entrypoint[1].removeprefix("/app/")).is_file()


# ---------------------------------------------------------------------------------------------
# Prometheus and Grafana


def prometheus_targets() -> set[tuple[str, int]]:
    config = yaml.safe_load((ROOT / "ops" / "deploy" / "prometheus" / "prometheus.yml").read_text())
    targets = set()
    for job in config["scrape_configs"]:
        assert job.get("metrics_path", "/metrics") == "/metrics", job["job_name"]
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                targets.add((host, int(port)))
        for dns in job.get("dns_sd_configs", []):
            assert dns["type"] == "A"
            targets |= {(name, int(dns["port"])) for name in dns["names"]}
    return targets


def test_prometheus_scrapes_every_metrics_port_compose_opens() -> None:
    targets = prometheus_targets()
    services = compose_services()
    opened = 0
    for name, service in services.items():
        args = kinfer_args(service)
        if args is None:
            continue
        port = args.port if args.command == "gateway" else getattr(args, "metrics_port", None)  # gateway: /metrics
        if not port:
            continue
        if args.command != "gateway":
            assert args.metrics_host == "0.0.0.0", name  # reachable from Prometheus's container
        names = {name, *service.get("networks", {}).get("default", {}).get("aliases", [])}
        assert any((host, port) in targets for host in names), (name, port)
        opened += 1
    assert opened >= 5
    scraped_hosts = {host for host, _ in targets} - {"localhost"}
    aliases = {a for s in services.values() for a in s.get("networks", {}).get("default", {}).get("aliases", [])}
    assert scraped_hosts <= set(services) | aliases  # and nothing that does not exist


def defined_metrics() -> dict[str, set[str]]:
    """Every series name the code exports -> its labels, from the prometheus_client constructors in
    the source (a Counter "x" or "x_total" is exported as x_total, a Histogram "x" as x_bucket, x_sum,
    x_count), plus prometheus_client's default process collector (process_cpu_seconds_total, ...)."""
    import prometheus_client

    kinds = {"Counter", "Gauge", "Histogram", "Summary"}
    out: dict[str, set[str]] = {}
    for folder in ("topics", "producers", "consumers", "batcher", "ops"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call) or len(node.args) < 2:
                    continue
                kind = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                first = node.args[0]
                if kind not in kinds or not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
                    continue
                label_node = node.args[2] if len(node.args) > 2 else next(
                    (k.value for k in node.keywords if k.arg == "labelnames"), None)
                labels = {e.value for e in getattr(label_node, "elts", []) if isinstance(e, ast.Constant)}
                name = first.value
                if kind == "Counter":
                    series = [name.removesuffix("_total") + "_total"]
                elif kind == "Histogram":
                    series = [f"{name}_bucket", f"{name}_sum", f"{name}_count"]
                elif kind == "Summary":
                    series = [name, f"{name}_sum", f"{name}_count"]
                else:
                    series = [name]
                for s in series:
                    out[s] = labels | ({"le"} if s.endswith("_bucket") else set())
    for family in prometheus_client.ProcessCollector(registry=None).collect():
        for sample in family.samples:
            out[sample.name] = set()
    return out


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads((ROOT / "ops" / "deploy" / "grafana" / "dashboards" / "kinfer.json").read_text())
    return data


def dashboard_queries() -> list[str]:
    board = dashboard()
    queries = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    for variable in board["templating"]["list"]:
        query = variable["query"]
        queries.append(query["query"] if isinstance(query, dict) else query)
    return queries


def test_every_metric_the_dashboard_asks_for_is_one_the_code_defines() -> None:
    defined = defined_metrics()
    assert {"kinfer_results_total", "kinfer_compute_seconds_bucket", "kinfer_lag_records",
            "kinfer_health_level", "kinfer_gateway_seconds_bucket", "process_cpu_seconds_total"} <= set(defined)
    functions = {"sum", "max", "min", "avg", "rate", "irate", "increase", "histogram_quantile", "label_values",
                 "by", "without", "count"}
    for expr in dashboard_queries():
        names = set(re.findall(r"\b([a-z_][a-z0-9_:]*)\s*[{\[]", expr))
        names |= set(re.findall(r"\b((?:kinfer|process)_[a-z0-9_]+)\b", expr))
        assert names and names <= set(defined), (expr, names - set(defined))
        labels = set().union(*(defined[n] for n in names))
        for metric, matchers in re.findall(r"\b([a-z_][a-z0-9_:]*)\{([^}]*)\}", expr):
            for label in re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", matchers):
                assert label in defined[metric] | {"job", "instance"}, (expr, metric, label)
        for group in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            for label in (g.strip() for g in group.split(",")):
                assert label in labels | {"job", "instance"}, (expr, label)
        assert not set(re.findall(r"\b([a-z_]+)\s*\(", expr)) - functions - {"by"}, expr


def test_the_dashboard_covers_what_operators_ask_per_model() -> None:
    queries = " ".join(dashboard_queries())
    for metric in ("kinfer_results_total", "kinfer_queue_wait_seconds_bucket", "kinfer_compute_seconds_bucket",
                   "kinfer_gateway_seconds_bucket", "kinfer_lag_records", "kinfer_health_level",
                   "kinfer_predicted_compute_seconds", "kinfer_batch_size", "kinfer_padding_ratio",
                   "kinfer_shed_total", "kinfer_compute_seconds_sum", "process_cpu_seconds_total",
                   "kinfer_generated_tokens_total"):
        assert metric in queries, metric
    for quantile in ("0.5", "0.95", "0.99"):
        assert f"histogram_quantile({quantile}," in queries
    assert dashboard()["templating"]["list"][0]["name"] == "model"


def test_grafana_is_provisioned_with_the_dashboard_and_its_datasource() -> None:
    provisioning = ROOT / "ops" / "deploy" / "grafana" / "provisioning"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"][0]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    board = dashboard()
    uids = {p["datasource"]["uid"] for p in board["panels"] if "datasource" in p}
    uids |= {v["datasource"]["uid"] for v in board["templating"]["list"]}
    assert uids == {source["uid"]}
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"])
    provider = yaml.safe_load((provisioning / "dashboards" / "kinfer.yml").read_text())["providers"][0]
    grafana = compose_services()["grafana"]
    volumes = mounts(grafana)
    assert volumes["./ops/deploy/grafana/dashboards"] == (provider["options"]["path"], True)
    assert volumes["./ops/deploy/grafana/provisioning"] == ("/etc/grafana/provisioning", True)
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{provider['options']['path']}/kinfer.json"
    prometheus = compose_services()["prometheus"]
    assert mounts(prometheus)["./ops/deploy/prometheus/prometheus.yml"] == ("/etc/prometheus/prometheus.yml", True)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]


def test_the_healthcheck_asks_the_gateway_and_metrics_ports() -> None:
    import http.server
    import socket
    import threading

    from kinfer.ops.deploy.healthcheck import healthy

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    listener = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()
    try:
        assert healthy(("http", server.server_address[1]))
        assert healthy(("tcp", listener.getsockname()[1]))
        assert not healthy(("tcp", closed_port)) and not healthy(("http", closed_port))
        assert healthy(None)
    finally:
        server.shutdown()
        server.server_close()
        listener.close()


def test_workers_and_the_gateway_have_disruption_budgets() -> None:
    budgets = by_kind("PodDisruptionBudget")
    for name, obj in by_kind("Deployment").items():
        labels = obj["spec"]["template"]["metadata"]["labels"]
        if labels["app.kubernetes.io/component"] not in ("worker", "gateway"):
            continue
        covering = [b for b in budgets.values() if b["spec"]["selector"]["matchLabels"].items() <= labels.items()]
        assert len(covering) == 1, name
        spec = covering[0]["spec"]
        # A worker leaving is a rebalance of its group: one at a time. The gateway keeps one serving.
        assert spec == ({"maxUnavailable": 1} if "worker" in name else {"minAvailable": 1}) | {
            "selector": spec["selector"]}, name


# ---------------------------------------------------------------------------------------------
# Schemas: what a compose engine and a cluster would check, offline


KUBERNETES = "1.30"  # the oldest release the manifests promise to fit (PodDisruptionBudget policy/v1, ...)
CRDS = {"ScaledObject", "Kustomization"}  # not core Kubernetes: KEDA's and kustomize's, checked above


def test_the_compose_file_matches_the_compose_spec() -> None:
    """tests/schemas/compose-spec.json: the Compose Specification's JSON schema (as shipped in
    docker-compose 1.29.2's wheel, Apache-2.0)."""
    import jsonschema

    schema = json.loads((ROOT / "tests" / "schemas" / "compose-spec.json").read_text())
    validator = jsonschema.Draft201909Validator(schema)  # its $schema (draft 2019-09)
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(compose_file())]
    assert errors == []
    broken = json.loads(json.dumps(compose_file()))
    broken["services"]["lagmon"]["helthcheck"] = broken["services"]["lagmon"].pop("healthcheck")
    assert not validator.is_valid(broken)  # the schema does catch a misspelt key


def test_every_manifest_matches_the_kubernetes_schema() -> None:
    import kubernetes_validate

    from kinfer.ops.capacity.placement import Fleet, load_models, place, render_k8s

    emitted = list(yaml.safe_load_all(render_k8s(place(load_models(ROOT / "ops" / "deploy" / "models.example.yaml"),
                                                        Fleet(gpus=12, gpu_memory_gib=80)))))
    checked = 0
    for obj in [*k8s_objects(), *emitted]:
        if obj["kind"] in CRDS:
            continue
        kubernetes_validate.validate(obj, KUBERNETES, strict=True)  # raises, naming the field
        checked += 1
    assert checked >= 12
    broken = dict(by_kind("PodDisruptionBudget")["kinfer-gateway"])
    broken["spec"] = {**broken["spec"], "minAvaliable": 1}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)
