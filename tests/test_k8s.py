"""The Kubernetes manifests (deploy/k8s) and the Containerfile.

Every kustomization renders with `kubectl kustomize` and validates against Kubernetes' own
schemas; the pods run the commands, ports and probes the runner and the API serve; only API
pods reach the runner port; grace periods cover the drain; and the queries the runner
autoscalers read pass `promtool test rules` on synthetic series.
"""

from __future__ import annotations

import re
import secrets
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from batchserve.runner.core.config import parse
from batchserve.runner.core.timeouts import Timeouts
from batchserve.runner.metrics import capacity_rate, gauges

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
KUSTOMIZATIONS = ("base", "overlays/dev", "overlays/prometheus-adapter", "overlays/keda",
                  "overlays/keda-utilization", "overlays/grpc-probes")
GRPC_PORT = 8001
TOKEN_FILE = "base/runner-mlp-token.env"
# The oldest Kubernetes the manifests are for (the preStop `sleep` action is on by default
# from 1.30), and the newest whose schemas kubernetes-validate ships.
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())
# Custom resources kubernetes-validate has no schema for: checked by SCALED_OBJECT below.
CRD_GROUPS = {"keda.sh"}
RUNNER_PORT = 7000
METRICS_PORT = 9100
API_PORT = 3000

Doc = dict[str, Any]


def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed, so the kustomizations cannot be rendered")
    return binary


def kustomize(tree: Path, name: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl(), "kustomize", str(tree / name)], capture_output=True,
                          text=True, timeout=60, check=False)


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of deploy/k8s with a fresh token file, as a user makes it (docs/deployment.md)."""
    copy = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, copy)
    (copy / TOKEN_FILE).write_text(f"token={secrets.token_hex(32)}\n")
    return copy


@pytest.fixture(scope="module")
def rendered(tree: Path) -> dict[str, list[Doc]]:
    out = {}
    for name in KUSTOMIZATIONS:
        done = kustomize(tree, name)
        assert done.returncode == 0, f"kubectl kustomize {name}: {done.stderr}"
        out[name] = [doc for doc in yaml.safe_load_all(done.stdout) if doc]
    return out


def find(docs: list[Doc], kind: str, name: str | None = None) -> list[Doc]:
    return [doc for doc in docs if doc["kind"] == kind
            and (name is None or doc["metadata"]["name"] == name)]


def one(docs: list[Doc], kind: str, name: str | None = None) -> Doc:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def deployment(docs: list[Doc], component: str) -> Doc:
    return next(doc for doc in find(docs, "Deployment")
                if doc["metadata"]["labels"]["app.kubernetes.io/component"] == component)


def container(docs: list[Doc], component: str) -> Doc:
    containers = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1
    return containers[0]


def pod_labels(docs: list[Doc], component: str) -> dict[str, str]:
    return deployment(docs, component)["spec"]["template"]["metadata"]["labels"]


def configuration(docs: list[Doc]) -> Doc:
    config_map = next(doc for doc in find(docs, "ConfigMap")
                      if doc["metadata"]["name"].startswith("batchserve-config-"))
    return yaml.safe_load(config_map["data"]["configuration.yml"])


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# --- rendering and validation ----------------------------------------------------------------

@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_renders_the_api_and_the_runner(
    rendered: dict[str, list[Doc]], name: str,
) -> None:
    docs = rendered[name]
    for kind in ("Namespace", "Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy",
                 "ConfigMap", "Secret"):
        assert find(docs, kind), f"{name} renders no {kind}"
    assert {doc["metadata"]["name"] for doc in find(docs, "Deployment")} == {
        "batchserve-api", "batchserve-runner-mlp"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rendered_manifests_pass_kubernetes_validate_strictly(
    rendered: dict[str, list[Doc]], name: str, version: str,
) -> None:
    custom = []
    for doc in rendered[name]:
        if doc["apiVersion"].split("/")[0] in CRD_GROUPS:
            custom.append(doc)
            continue
        # Raises on any field the schema does not know (strict) or a value of a wrong type.
        kubernetes_validate.validate(doc, version, strict=True)
    for doc in custom:
        check_scaled_object(doc, version)


def test_validation_can_fail(rendered: dict[str, list[Doc]]) -> None:
    runner = yaml.safe_load(yaml.safe_dump(deployment(rendered["base"], "runner")))
    runner["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["path"] = "/x"
    with pytest.raises(kubernetes_validate.ValidationError, match="path"):
        kubernetes_validate.validate(runner, VERSIONS[0], strict=True)


# KEDA's ScaledObject is a custom resource, so kubernetes-validate has no schema for it. These
# are the fields of keda.sh/v1alpha1 that the keda overlay uses, closed to any other; the HPA
# behaviour KEDA passes on is checked by Kubernetes' own HPA schema below.
SCALED_OBJECT: Doc = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object", "required": ["name"], "additionalProperties": False,
                    "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                                   "name": {"type": "string"}},
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object", "additionalProperties": False,
                    "properties": {"horizontalPodAutoscalerConfig": {
                        "type": "object", "additionalProperties": False,
                        "properties": {"name": {"type": "string"},
                                       "behavior": {"type": "object"}}}},
                },
                "triggers": {
                    "type": "array", "minItems": 1,
                    "items": {
                        "type": "object", "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "prometheus"},
                            "metricType": {"enum": ["AverageValue", "Value"]},
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "additionalProperties": {"type": "string"},
                            },
                        },
                    },
                },
            },
        },
    },
}


def check_scaled_object(doc: Doc, version: str) -> None:
    jsonschema.validate(doc, SCALED_OBJECT)
    spec = doc["spec"]
    hpa = {
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": doc["metadata"]["name"]},
        "spec": {"scaleTargetRef": spec["scaleTargetRef"], "maxReplicas": spec["maxReplicaCount"],
                 "behavior": spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]},
    }
    kubernetes_validate.validate(hpa, version, strict=True)
    float(doc["spec"]["triggers"][0]["metadata"]["threshold"])


def test_without_a_token_file_nothing_renders(tmp_path: Path) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    (copy / TOKEN_FILE).unlink(missing_ok=True)
    for name in KUSTOMIZATIONS:
        done = kustomize(copy, name)
        assert done.returncode != 0, f"{name} rendered without a token"
        assert "runner-mlp-token.env" in done.stderr


def test_the_token_file_is_never_committed() -> None:
    ignored = subprocess.run(["git", "check-ignore", "-q", str(K8S / TOKEN_FILE)], cwd=ROOT,
                             timeout=30, check=False)
    assert ignored.returncode == 0


# --- what the pods run -----------------------------------------------------------------------

def test_the_configuration_is_the_bundled_mlp_reached_through_the_headless_service(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["base"]
    config = configuration(docs)
    bundled = yaml.safe_load((ROOT / "configuration.yml").read_text())["runners"]["mlp"]
    mlp = dict(config["runners"]["mlp"])
    addresses = mlp.pop("addresses")
    assert config["runners"].keys() == {"mlp"}
    assert mlp == bundled
    service = one(docs, "Service", "batchserve-runner-mlp")
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses", False)
    assert selects(service["spec"]["selector"], pod_labels(docs, "runner"))
    port = next(p["port"] for p in service["spec"]["ports"] if p["name"] == "runner")
    assert addresses == [f"dns+tcp:{service['metadata']['name']}:{port}"]


def test_the_runner_pod_runs_batchserve_runner_on_its_ports(
    rendered: dict[str, list[Doc]],
) -> None:
    runner = container(rendered["base"], "runner")
    assert runner["args"] == [
        "runner", "--config", "/etc/batchserve/configuration.yml", "--runner", "mlp",
        "--listen", f"tcp:0.0.0.0:{RUNNER_PORT}", "--metrics-port", str(METRICS_PORT)]
    ports = {port["name"]: port["containerPort"] for port in runner["ports"]}
    assert ports == {"runner": RUNNER_PORT, "metrics": METRICS_PORT}
    probes = {kind: (runner[kind]["httpGet"]["path"], ports[runner[kind]["httpGet"]["port"]])
              for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes == {"startupProbe": ("/health/live", METRICS_PORT),
                      "readinessProbe": ("/health/ready", METRICS_PORT),
                      "livenessProbe": ("/health/live", METRICS_PORT)}


def test_the_api_pod_runs_serve_api_only(rendered: dict[str, list[Doc]]) -> None:
    api = container(rendered["base"], "api")
    assert api["args"] == ["serve", "--api-only", "--config", "/etc/batchserve/configuration.yml",
                           "--host", "0.0.0.0", "--port", str(API_PORT),
                           "--grpc-port", str(GRPC_PORT)]
    assert api["ports"] == [{"name": "http", "containerPort": API_PORT, "protocol": "TCP"},
                            {"name": "grpc", "containerPort": GRPC_PORT, "protocol": "TCP"}]
    paths = {kind: api[kind]["httpGet"]["path"]
             for kind in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/v2/health/live", "readinessProbe": "/v2/health/ready",
                     "livenessProbe": "/v2/health/live"}


def test_the_grpc_overlay_probes_the_standard_health_service(
        rendered: dict[str, list[Doc]]) -> None:
    api = container(rendered["overlays/grpc-probes"], "api")
    assert api["readinessProbe"]["grpc"] == {"port": GRPC_PORT}
    assert api["livenessProbe"]["grpc"] == {"port": GRPC_PORT,
                                            "service": "inference.GRPCInferenceService"}
    assert "httpGet" in api["startupProbe"]


def test_the_runner_start_up_is_given_its_whole_timeout(rendered: dict[str, list[Doc]]) -> None:
    probe = container(rendered["base"], "runner")["startupProbe"]
    timeouts = Timeouts(**configuration(rendered["base"]).get("timeouts", {}))
    assert probe["periodSeconds"] * probe["failureThreshold"] >= timeouts.runner_start_s


@pytest.mark.parametrize("component", ["api", "runner"])
def test_pods_mount_the_configuration_and_the_token(
    rendered: dict[str, list[Doc]], component: str,
) -> None:
    docs = rendered["base"]
    spec = deployment(docs, component)["spec"]["template"]["spec"]
    volumes = {volume["name"]: volume for volume in spec["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in spec["containers"][0]["volumeMounts"]}
    config_map = volumes[mounts["/etc/batchserve"]]["configMap"]["name"]
    assert "configuration.yml" in one(docs, "ConfigMap", config_map)["data"]
    env = {item["name"]: item for item in spec["containers"][0]["env"]}
    secret = env["BATCHSERVE_TOKEN"]["valueFrom"]["secretKeyRef"]
    token = one(docs, "Secret", secret["name"])["data"][secret["key"]]
    assert len(token) >= 16


def test_a_leaving_runner_serves_until_the_api_resolves_its_service_again(
    rendered: dict[str, list[Doc]],
) -> None:
    """The API workers see a runner pod leave the headless Service at their next resolution
    (every timeouts.resolve_s, behind the DNS answer's own cache): its preStop sleep covers two."""
    docs = rendered["base"]
    config = configuration(docs)
    timeouts = Timeouts(**config["timeouts"])
    spec = deployment(docs, "runner")["spec"]["template"]["spec"]
    assert spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"] >= (
        2 * timeouts.resolve_s)
    parse(config)  # and the configuration, dns+tcp: address included, is valid


def test_grace_periods_cover_the_drain(rendered: dict[str, list[Doc]]) -> None:
    """A runner drains for drain_s and is stuck past kill_after_s; the API pod's supervisor
    stops within 2 x kill_after_s (docs/deployment.md, "Stopping"). Both after their preStop
    sleep."""
    docs = rendered["base"]
    timeouts = Timeouts(**configuration(docs)["timeouts"])
    for component, stop_s in (("runner", timeouts.kill_after_s),
                              ("api", 2 * timeouts.kill_after_s)):
        spec = deployment(docs, component)["spec"]["template"]["spec"]
        sleep_s = spec["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert spec["terminationGracePeriodSeconds"] >= sleep_s + stop_s, component
        assert spec["terminationGracePeriodSeconds"] >= timeouts.kill_after_s


@pytest.mark.parametrize("component", ["api", "runner"])
def test_pods_run_as_a_non_root_user_on_a_read_only_root(
    rendered: dict[str, list[Doc]], component: str,
) -> None:
    spec = deployment(rendered["base"], component)["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == containerfile_user()
    context = spec["containers"][0]["securityContext"]
    assert context == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                       "capabilities": {"drop": ["ALL"]}}
    assert spec["automountServiceAccountToken"] is False
    resources = spec["containers"][0]["resources"]
    assert resources["requests"].keys() == {"cpu", "memory"}
    assert "memory" in resources["limits"]


# --- the network policy ----------------------------------------------------------------------

def admits(policy: Doc, source: dict[str, str] | None, port: int) -> bool:
    """Whether `policy` lets a pod of this namespace with labels `source` (None: anything
    outside the namespace) reach `port` on the pods it selects."""
    for rule in policy["spec"].get("ingress", []):
        ports = [entry["port"] for entry in rule.get("ports", [])]
        if ports and port not in ports:
            continue
        peers = rule.get("from")
        if not peers or any(peer_admits(peer, source) for peer in peers):
            return True
    return False


def peer_admits(peer: Doc, source: dict[str, str] | None) -> bool:
    if "ipBlock" in peer or "namespaceSelector" in peer:
        return True  # reaches beyond this namespace's pods: counted as admitting anyone
    return source is not None and selects(peer["podSelector"].get("matchLabels", {}), source)


def test_only_api_pods_reach_the_runner_port(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    policy = one(docs, "NetworkPolicy", "batchserve-runner-mlp")
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    assert selects(policy["spec"]["podSelector"]["matchLabels"], pod_labels(docs, "runner"))
    api, runner = pod_labels(docs, "api"), pod_labels(docs, "runner")
    assert admits(policy, api, RUNNER_PORT)
    for stranger in (runner, {"app.kubernetes.io/name": "batchserve"}, {}, None):
        assert not admits(policy, stranger, RUNNER_PORT), stranger
    # Prometheus and the kubelet's probes read the metrics port from anywhere.
    assert admits(policy, None, METRICS_PORT)


def test_the_network_policy_check_can_fail() -> None:
    open_rule = {"spec": {"ingress": [{"ports": [{"port": RUNNER_PORT}]}]}}
    anywhere = {"spec": {"ingress": [{"from": [{"namespaceSelector": {}}]}]}}
    assert admits(open_rule, None, RUNNER_PORT)
    assert admits(anywhere, {}, RUNNER_PORT)


# --- the autoscalers -------------------------------------------------------------------------

QUEUE_DEPTH = gauges["queued"].describe()[0].name
ARRIVALS = gauges["arrival_rps"].describe()[0].name
CAPACITY = capacity_rate.describe()[0].name


def test_the_autoscalers_read_the_runners_queue_depth_gauge() -> None:
    assert QUEUE_DEPTH == "batchserve_queue_depth"


def adapter_rule() -> Doc:
    config = yaml.safe_load((K8S / "overlays/prometheus-adapter/adapter/config.yaml").read_text())
    [rule] = config["rules"]
    return rule


def test_the_adapter_serves_the_gauge_per_pod_to_the_runner_hpa(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["overlays/prometheus-adapter"]
    rule = adapter_rule()
    assert rule["seriesQuery"].startswith(QUEUE_DEPTH + "{")
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}
    hpa = one(docs, "HorizontalPodAutoscaler", "batchserve-runner-mlp")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": "batchserve-runner-mlp"}
    [metric] = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == rule["name"]["as"] == QUEUE_DEPTH
    assert metric["pods"]["target"]["type"] == "AverageValue"
    rules = one(docs, "ConfigMap", "batchserve-adapter-rules")
    assert rules["metadata"]["namespace"] == "monitoring"
    assert yaml.safe_load(rules["data"]["config.yaml"])["rules"] == [rule]


def scaled_object(rendered: dict[str, list[Doc]], overlay: str = "overlays/keda") -> Doc:
    return one(rendered[overlay], "ScaledObject", "batchserve-runner-mlp")


def test_keda_replaces_the_runner_hpa_and_scales_alike(rendered: dict[str, list[Doc]]) -> None:
    keda = scaled_object(rendered)
    hpa = one(rendered["overlays/prometheus-adapter"], "HorizontalPodAutoscaler",
              "batchserve-runner-mlp")
    targets = [doc["spec"]["scaleTargetRef"]["name"]
               for doc in find(rendered["overlays/keda"], "HorizontalPodAutoscaler")]
    assert "batchserve-runner-mlp" not in targets
    assert keda["spec"]["scaleTargetRef"]["name"] == "batchserve-runner-mlp"
    [trigger] = keda["spec"]["triggers"]
    assert trigger["metricType"] == "AverageValue"
    assert float(trigger["metadata"]["threshold"]) == float(
        hpa["spec"]["metrics"][0]["pods"]["target"]["averageValue"])
    assert (keda["spec"]["minReplicaCount"], keda["spec"]["maxReplicaCount"]) == (
        hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"])


def test_keda_can_scale_on_utilization_before_a_queue_forms(
    rendered: dict[str, list[Doc]],
) -> None:
    by_queue = scaled_object(rendered)
    by_use = scaled_object(rendered, "overlays/keda-utilization")
    [trigger] = by_use["spec"]["triggers"]
    # A ratio scales the pods it finds (ceil(pods * value / threshold)), not a total per pod.
    assert trigger["metricType"] == "Value"
    assert 0.0 < float(trigger["metadata"]["threshold"]) < 1.0
    query = trigger["metadata"]["query"]
    assert CAPACITY in query and ARRIVALS in query
    assert trigger["metadata"]["ignoreNullValues"] == "true"
    for key in ("scaleTargetRef", "minReplicaCount", "maxReplicaCount", "advanced"):
        assert by_use["spec"][key] == by_queue["spec"][key]


@pytest.mark.parametrize(
    "name", ["overlays/prometheus-adapter", "overlays/keda", "overlays/keda-utilization"])
def test_an_autoscaled_runner_deployment_leaves_replicas_to_it(
    rendered: dict[str, list[Doc]], name: str,
) -> None:
    assert "replicas" not in deployment(rendered[name], "runner")["spec"]
    assert "replicas" in deployment(rendered["base"], "runner")["spec"]


def test_dev_runs_one_pod_of_each(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["overlays/dev"]
    assert [deployment(docs, c)["spec"]["replicas"] for c in ("api", "runner")] == [1, 1]
    assert not find(docs, "HorizontalPodAutoscaler")


def recording_rules() -> dict[str, str]:
    groups = yaml.safe_load((K8S / "autoscaling-rules.yml").read_text())["groups"]
    return {rule["record"]: rule["expr"] for group in groups for rule in group["rules"]}


def adapter_query(rule: Doc, group_by: str) -> str:
    """The adapter's metricsQuery with its template filled in for every pod at once."""
    matchers = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"])
    assert matchers is not None
    values = {"Series": matchers[1], "LabelMatchers": matchers[2], "GroupBy": group_by}
    return re.sub(r"<<\.(\w+)>>", lambda m: values[m[1]], rule["metricsQuery"])


def test_the_recording_rules_are_the_autoscalers_queries(
    rendered: dict[str, list[Doc]],
) -> None:
    rules = recording_rules()
    assert rules["namespace_pod:batchserve_queue_depth:avg1m"] == adapter_query(
        adapter_rule(), "namespace, pod")
    query = scaled_object(rendered)["spec"]["triggers"][0]["metadata"]["query"]
    assert rules["batchserve:runner_mlp_queue_depth:sum_avg1m"] == query
    by_use = scaled_object(rendered, "overlays/keda-utilization")
    assert rules["batchserve:runner_mlp_utilization:avg1m"] == (
        by_use["spec"]["triggers"][0]["metadata"]["query"])
    namespace = deployment(rendered["overlays/keda"], "runner")["metadata"]["namespace"]
    assert f'namespace="{namespace}"' in query


def promtool(*args: str) -> str:
    binary = shutil.which("promtool")
    assert binary, "promtool is not installed; the README's test command installs it"
    done = subprocess.run([binary, *args], cwd=K8S, capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_autoscalers_queries_pass_promtool_on_synthetic_series() -> None:
    assert "SUCCESS: 3 rules found" in promtool("check", "rules", "autoscaling-rules.yml")
    promtool("test", "rules", "autoscaling-rules.test.yml")
    tests = yaml.safe_load((K8S / "autoscaling-rules.test.yml").read_text())["tests"]
    tested = {case["expr"].split("{")[0] for test in tests for case in test["promql_expr_test"]}
    assert tested == recording_rules().keys()


# --- the Containerfile -----------------------------------------------------------------------

def instructions() -> Iterator[tuple[str, str]]:
    """(INSTRUCTION, arguments) of deploy/Containerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", (DEPLOY / "Containerfile").read_text())
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            yield word.upper(), rest.strip()


def containerfile_user() -> int:
    users = [rest for word, rest in instructions() if word == "USER"]
    assert len(users) == 1
    return int(users[0].split(":")[0])


def test_the_containerfile_builds_a_non_root_batchserve_image() -> None:
    steps = list(instructions())
    assert steps[0] == ("FROM", "python:3.11-slim AS build")
    assert [rest for word, rest in steps if word == "FROM"][-1] == "python:3.11-slim"
    assert containerfile_user() >= 1000
    assert ("ENTRYPOINT", '["batchserve"]') in steps
    for word, rest in steps:
        if word == "COPY" and not rest.startswith("--from"):
            for source in rest.split()[:-1]:
                assert (ROOT / source).exists(), source


def test_the_containerfile_installs_the_pinned_torch() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    [torch] = [dep for dep in pyproject["project"]["dependencies"] if dep.startswith("torch")]
    runs = " ".join(rest for word, rest in instructions() if word == "RUN")
    assert f"download.pytorch.org/whl/cpu {torch}" in runs
    assert "pip install --no-cache-dir ." in runs
