"""deploy/k8s: every overlay renders with ``kubectl kustomize``, with and without the monitoring
component; every built-in kind validates strictly against the Kubernetes schemas; the custom
resources (KServe InferenceService, PodMonitors, prometheus-adapter rules) are checked field by
field; the Triton Deployment runs tritonserver with exactly the flags ``nexus-sli serve`` builds
(model control off, the restricted APIs' header value from a Secret); the gateway Deployment's args
parse as the image's ``nexus-sli gateway`` command and reach the Triton Service, whose pods its
NetworkPolicy and Triton's admit.  tests/test_monitoring.py checks the metrics named here against
real scrapes."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml

from helpers.k8s import ADAPTER_VALUES, K8S, ROOT, adapter_rules, by_name, dashboard, render
from nexus_sli.exporter.serving.server import ADMIN_HEADER, RESTRICTED_APIS, server_args

OVERLAYS = ("cpu", "gpu")
#: each overlay with the monitoring component (deploy/k8s/components/monitoring)
MONITORED = tuple(f"{overlay}-monitored" for overlay in OVERLAYS)
K8S_VERSION = "1.37.0"
TRITON, GATEWAY = "nexus-sli-triton", "nexus-sli-gateway"
#: the namespace the NetworkPolicies expect Prometheus in (docs/deployment.md)
MONITORING_NAMESPACE = {"kubernetes.io/metadata.name": "monitoring"}


@pytest.fixture(scope="module", params=OVERLAYS + MONITORED)
def rendered(request):
    """(the overlay's export: cpu or gpu, the objects by (kind, name), the rendered documents)"""
    docs = render(request.param)
    return request.param.split("-")[0], by_name(docs), docs


def _container(objects: dict, name: str = TRITON) -> dict:
    (container,) = objects[("Deployment", name)]["spec"]["template"]["spec"]["containers"]
    return container


def _pod_labels(objects: dict, name: str) -> dict:
    return objects[("Deployment", name)]["spec"]["template"]["metadata"]["labels"]


def _matches(selector: dict, labels: dict) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _env(objects: dict, name: str = TRITON) -> dict[str, str]:
    """The container's environment as Kubernetes resolves it: the ConfigMap's values, Secret refs named."""
    container = _container(objects, name)
    env = {}
    for source in container.get("envFrom", []):
        config_map = objects[("ConfigMap", name)]
        assert source["configMapRef"]["name"] == config_map["metadata"]["name"]
        env.update(config_map["data"])
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = f"secret:{ref['name']}/{ref['key']}" if ref else item["value"]
    return env


# --- what renders ---------------------------------------------------------------------------------

BASE_OBJECTS = {("ConfigMap", TRITON), ("Service", TRITON), ("Service", f"{TRITON}-headless"),
                *((kind, name) for name in (TRITON, GATEWAY)
                  for kind in ("Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "NetworkPolicy")),
                ("Service", GATEWAY)}
COMPONENT_OBJECTS = {("PodMonitor", TRITON), ("PodMonitor", GATEWAY), ("ConfigMap", "nexus-sli-dashboard")}


def test_every_overlay_renders_the_expected_objects(rendered):
    overlay, objects, docs = rendered
    monitored = any(d["kind"] == "PodMonitor" for d in docs)
    assert set(objects) == BASE_OBJECTS | (COMPONENT_OBJECTS if monitored else set())
    # every object says what it belongs to (the base's common label, the component's own)
    assert all(d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "nexus-sli" for d in docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_component_adds_its_objects_and_changes_nothing_else(overlay):
    plain, monitored = by_name(render(overlay)), by_name(render(f"{overlay}-monitored"))
    assert set(monitored) - set(plain) == COMPONENT_OBJECTS
    assert {key: monitored[key] for key in plain} == plain


def test_every_built_in_kind_validates_strictly(rendered):
    _, _, docs = rendered
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no bundled schema (test_the_pod_monitors_field_by_field)
        # raises ValidationError (unknown field, wrong type, missing field) or SchemaNotFoundError
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_an_unknown_field():
    objects = by_name(render("cpu"))
    for name in (TRITON, GATEWAY):
        deployment = copy.deepcopy(objects[("Deployment", name)])
        deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


# --- Triton ---------------------------------------------------------------------------------------

def test_the_server_runs_exactly_the_flags_nexus_sli_serve_builds(rendered):
    _, objects, _ = rendered
    container = _container(objects)
    # no `command`: the NGC image's ENTRYPOINT (NVIDIA's entrypoint script) runs the args
    assert "command" not in container and container["args"][0] == "tritonserver"
    # model control off (no supervisor there: Kubernetes restarts the pod), restricted APIs
    # behind the header whose value Kubernetes substitutes from the Secret
    expected = server_args("$(MODEL_REPOSITORY)", 8000, 8001, 8002, "0.0.0.0",
                           admin_key="$(NEXUS_SLI_ADMIN_KEY)", reload_models=False)
    assert container["args"][1:] == expected
    assert "--model-control-mode=none" in container["args"]
    restricted = f"--http-restricted-api={','.join(RESTRICTED_APIS)}:{ADMIN_HEADER}=$(NEXUS_SLI_ADMIN_KEY)"
    assert restricted in container["args"]
    env = _env(objects)
    assert env["NEXUS_SLI_ADMIN_KEY"] == "secret:nexus-sli-admin/admin-key"
    assert env["AWS_ACCESS_KEY_ID"].startswith("secret:") and env["AWS_SECRET_ACCESS_KEY"].startswith("secret:")
    # every $(VAR) in the args is defined, else Kubernetes leaves it as literal text
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["args"]))) <= set(env)


def test_each_overlay_reads_its_own_export_from_object_storage(rendered):
    overlay, objects, _ = rendered
    env = _env(objects)
    assert env["MODEL_REPOSITORY"] == f"s3://nexus-sli-models/repositories/{overlay}"
    resources = _container(objects)["resources"]
    gpus = [resources.get(part, {}).get("nvidia.com/gpu") for part in ("requests", "limits")]
    assert gpus == (["1", "1"] if overlay == "gpu" else [None, None])
    assert resources["requests"]["cpu"] and resources["limits"]["memory"]
    # the gateway needs no GPU in either
    assert "nvidia.com/gpu" not in json.dumps(objects[("Deployment", GATEWAY)])


def test_probes_security_and_shutdown(rendered):
    overlay, objects, _ = rendered
    deployment = objects[("Deployment", TRITON)]
    pod = deployment["spec"]["template"]["spec"]
    container = _container(objects)
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model download and load
    _assert_locked_down(pod, container)
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= set(mounts)  # scratch files; the python backend's tensors
    # Triton's copy of the repository: writable (read-only root) and a folder of its own, empty at start
    # as Triton's docs ask (not /tmp, where the python backend and the TensorRT engine cache write)
    copies = _env(objects)["TRITON_AWS_MOUNT_DIRECTORY"]
    assert copies in mounts and copies != "/tmp" and list(mounts.values()).count(mounts[copies]) == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[copies]] and volumes[mounts[copies]]["emptyDir"]["sizeLimit"]
    # preStop and Triton's exit timeout fit in the grace period
    exit_timeout = int(next(a for a in container["args"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert _pre_stop_s(container) + exit_timeout < pod["terminationGracePeriodSeconds"]
    rolling = deployment["spec"]["strategy"]["rollingUpdate"]
    if overlay == "gpu":  # no spare GPU for a surge pod: replace one at a time, the others keep serving
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)
        assert deployment["spec"]["replicas"] >= 2
        assert objects[("HorizontalPodAutoscaler", TRITON)]["spec"]["minReplicas"] >= 2
        assert objects[("PodDisruptionBudget", TRITON)]["spec"]["minAvailable"] >= 1
    else:  # a new pod ready before an old one goes
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)


def _assert_locked_down(pod: dict, container: dict) -> None:
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}


def _pre_stop_s(container: dict) -> int:
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    return int(command[1])


def test_selectors_reach_the_pods_of_their_own_deployment_only(rendered):
    _, objects, _ = rendered
    pods = {name: _pod_labels(objects, name) for name in (TRITON, GATEWAY)}
    for name, other in ((TRITON, GATEWAY), (GATEWAY, TRITON)):
        selectors = [objects[("Deployment", name)]["spec"]["selector"]["matchLabels"],
                     objects[("Service", name)]["spec"]["selector"],
                     objects[("PodDisruptionBudget", name)]["spec"]["selector"]["matchLabels"],
                     objects[("NetworkPolicy", name)]["spec"]["podSelector"]["matchLabels"]]
        for selector in selectors:
            assert _matches(selector, pods[name]) and not _matches(selector, pods[other]), (name, selector)
        hpa = objects[("HorizontalPodAutoscaler", name)]["spec"]["scaleTargetRef"]
        assert hpa == {"apiVersion": "apps/v1", "kind": "Deployment", "name": name}
    assert {p["name"]: p["port"] for p in objects[("Service", TRITON)]["spec"]["ports"]} == {
        "http": 8000, "grpc": 8001, "metrics": 8002}
    # who may connect to Triton: exactly the client label docs/deployment.md asks for (kustomize's common
    # labels must not be added to it), the gateway's pods for gRPC, and the monitoring namespace for metrics
    policy = objects[("NetworkPolicy", TRITON)]
    sources = {tuple(p["port"] for p in rule["ports"]): rule["from"] for rule in policy["spec"]["ingress"]}
    assert sources[(8000, 8001)] == [{"podSelector": {"matchLabels": {"nexus-sli/client": "true"}}}]
    assert sources[(8002,)] == [{"namespaceSelector": {"matchLabels": MONITORING_NAMESPACE}}]
    assert objects[("Deployment", TRITON)]["spec"]["template"]["metadata"]["annotations"][
        "prometheus.io/port"] == "8002"


def test_the_headless_service_names_every_ready_triton_pod(rendered):
    _, objects, _ = rendered
    headless, service = objects[("Service", f"{TRITON}-headless")]["spec"], objects[("Service", TRITON)]["spec"]
    assert headless["clusterIP"] == "None" and headless["publishNotReadyAddresses"] is False
    assert headless["selector"] == service["selector"]
    ports = {p["name"]: p for p in service["ports"]}
    for port in headless["ports"]:  # the same ports, names and targets as the regular Service
        assert port == ports[port["name"]]


# --- the gateway ----------------------------------------------------------------------------------

DOCKERFILE_GATEWAY = ROOT / "deploy" / "docker" / "Dockerfile.gateway"
#: Docker's own parser (Go, in a C extension) in an interpreter of its own: tests/test_gpu_docker.py says why
_PARSE = ("import dockerfile, json, sys; print(json.dumps([{'cmd': c.cmd, 'value': list(c.value)} "
          "for c in dockerfile.parse_file(sys.argv[1])]))")


def _gateway_image() -> dict[str, list[list[str]]]:
    """Dockerfile.gateway's instructions by name (upper case), each a list of their values."""
    out = subprocess.run([sys.executable, "-c", _PARSE, str(DOCKERFILE_GATEWAY)], capture_output=True, text=True,
                         check=True)
    found: dict[str, list[list[str]]] = {}
    for command in json.loads(out.stdout):
        found.setdefault(command["cmd"].upper(), []).append(command["value"])
    return found


def _gateway_config(objects: dict):
    """The gateway's settings as its container runs: the image's ENTRYPOINT with the Deployment's args,
    parsed by the real command line (an unknown or misspelt option fails here as it would in the pod)."""
    from nexus_sli.cli.gateway_command import config_from
    from nexus_sli.cli.main import build_parser

    container = _container(objects, GATEWAY)
    assert "command" not in container  # the image's ENTRYPOINT runs the args
    (entrypoint,) = _gateway_image()["ENTRYPOINT"]
    assert entrypoint[:2] == ["nexus-sli", "gateway"]
    return config_from(build_parser().parse_args([*entrypoint[1:], *container["args"]]))


def _named_port(container: dict, name: str) -> int:
    (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == name]
    return port


def _service_port(objects: dict, name: str, port: int) -> int:
    """The container port a Service's ``port`` leads to."""
    (target,) = [p["targetPort"] for p in objects[("Service", name)]["spec"]["ports"] if p["port"] == port]
    return _named_port(_container(objects, name), target) if isinstance(target, str) else target


def _triton_target(objects: dict) -> tuple[str, int]:
    """The Service the gateway's --triton names, and the Triton container port it leads to.
    ``HOST:PORT`` names the regular Service; ``dns:///NAME:PORT`` (every address of a name) the
    headless one, whose addresses are the pods' own."""
    target = _gateway_config(objects).triton
    spread = target.startswith("dns:///")
    host, port = target.removeprefix("dns:///").rsplit(":", 1)
    assert host == (f"{TRITON}-headless" if spread else TRITON), target
    # both Services lead to the same container port (test_the_headless_service_names_every_ready_triton_pod)
    return host, _service_port(objects, TRITON, int(port))


def test_the_gateway_runs_its_image_command_against_the_triton_service(rendered):
    _, objects, _ = rendered
    from nexus_sli.gateway.config import API_KEY_ENV

    config = _gateway_config(objects)
    container = _container(objects, GATEWAY)
    _, grpc_port = _triton_target(objects)
    assert f"--grpc-port={grpc_port}" in _container(objects)["args"]
    assert config.host == "0.0.0.0" and config.port == _named_port(container, "http")
    assert _service_port(objects, GATEWAY, 8080) == config.port
    # the API key from the Secret, through the environment (args show in the process list)
    assert config.api_key is None and not any("api-key" in a for a in container["args"])
    assert _env(objects, GATEWAY)[API_KEY_ENV] == "secret:nexus-sli-gateway/api-key"


def test_the_gateway_image_is_this_package_with_the_gateway_extra(rendered):
    _, objects, _ = rendered
    tomllib = pytest.importorskip("tomllib")
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _container(objects, GATEWAY)["image"] == f"nexus-sli-gateway:{version}"
    image = _gateway_image()
    assert any("[gateway]" in " ".join(run) and "pip install" in " ".join(run) for run in image["RUN"])
    # the user the Deployment runs as is the image's own, not root
    (user,) = image["USER"]
    uid = objects[("Deployment", GATEWAY)]["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    assert user[0].split(":")[0] == str(uid) != "0"


def test_gateway_probes_security_and_shutdown(rendered):
    _, objects, _ = rendered
    from nexus_sli.gateway.auth import OPEN_PATHS

    pod = objects[("Deployment", GATEWAY)]["spec"]["template"]["spec"]
    container = _container(objects, GATEWAY)
    readiness = container["readinessProbe"]["httpGet"]
    # ready while Triton is (its /health), and reachable without the API key, as a probe sends none
    assert readiness["path"] == "/health" and readiness["path"] in OPEN_PATHS and readiness["port"] == "http"
    # liveness must not follow Triton's health: a Triton outage would restart every gateway
    assert container["livenessProbe"].get("httpGet", {}).get("path") != "/health"
    _assert_locked_down(pod, container)
    # the same hardening as the Triton container's, field for field
    assert container["securityContext"] == _container(objects)["securityContext"]
    assert {m["mountPath"] for m in container["volumeMounts"]} == {"/tmp"}  # the only writable place
    # uvicorn answers what it has on SIGTERM: preStop plus the longest request (its Triton call, and the
    # retries of a retryable failure where the gateway has them) fit in the grace period
    config = _gateway_config(objects)
    longest = config.triton_timeout_s + getattr(config, "triton_retry_s", 0.0)
    assert _pre_stop_s(container) + longest < pod["terminationGracePeriodSeconds"]
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    deployment = objects[("Deployment", GATEWAY)]["spec"]
    rolling = deployment["strategy"]["rollingUpdate"]
    assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0) and deployment["replicas"] >= 2
    assert objects[("PodDisruptionBudget", GATEWAY)]["spec"]["minAvailable"] >= 1


def admits(policy: dict, direction: str, peer_labels: dict, peer_namespace: dict | None, port: int,
           protocol: str = "TCP") -> bool:
    """Whether a NetworkPolicy's ``ingress`` (or ``egress``) rules let a peer through on a port.
    ``peer_namespace``: the peer's namespace labels, None for the policy's own namespace."""
    spec = policy["spec"]
    if direction.capitalize() not in spec["policyTypes"]:
        return True  # the policy does not restrict that direction
    side = "from" if direction == "ingress" else "to"

    def peer_matches(peer: dict) -> bool:
        if "namespaceSelector" in peer:
            if peer_namespace is None or not _matches(peer["namespaceSelector"]["matchLabels"], peer_namespace):
                return False
        elif peer_namespace is not None:
            return False  # a bare podSelector means this namespace's pods
        return "podSelector" not in peer or _matches(peer["podSelector"]["matchLabels"], peer_labels)

    for rule in spec.get(direction, []):
        peers_ok = side not in rule or any(peer_matches(peer) for peer in rule[side])
        ports_ok = "ports" not in rule or any(p["port"] == port and p.get("protocol", "TCP") == protocol
                                              for p in rule["ports"])
        if peers_ok and ports_ok:
            return True
    return False


def test_the_network_policies_let_the_gateway_reach_triton_and_no_further(rendered):
    _, objects, _ = rendered
    triton, gateway = objects[("NetworkPolicy", TRITON)], objects[("NetworkPolicy", GATEWAY)]
    triton_pods, gateway_pods = _pod_labels(objects, TRITON), _pod_labels(objects, GATEWAY)
    _, grpc = _triton_target(objects)
    # out of the gateway and into Triton, on the port --triton leads to
    assert admits(gateway, "egress", triton_pods, None, grpc) and admits(triton, "ingress", gateway_pods, None, grpc)
    # only there: not Triton's HTTP or metrics ports, not elsewhere (DNS apart, to resolve the Service)
    assert not admits(gateway, "egress", triton_pods, None, 8000) and not admits(triton, "ingress", gateway_pods,
                                                                                  None, 8000)
    assert not admits(gateway, "egress", {"app": "anything"}, None, grpc)
    assert admits(gateway, "egress", {}, {"kubernetes.io/metadata.name": "kube-system"}, 53, "UDP")
    # an unlabelled pod reaches neither Triton port; a labelled client both
    assert not admits(triton, "ingress", {}, None, grpc)
    assert admits(triton, "ingress", {"nexus-sli/client": "true"}, None, 8000)
    # the gateway is the entry point: its API port from any namespace (an ingress controller, Prometheus)
    port = _named_port(_container(objects, GATEWAY), "http")
    assert admits(gateway, "ingress", {}, {"kubernetes.io/metadata.name": "ingress-nginx"}, port)
    assert admits(triton, "ingress", {}, MONITORING_NAMESPACE, 8002)


def test_a_policy_that_names_the_gateway_wrongly_is_caught():
    """The reach check is not vacuous: the gateway's label misspelt in Triton's policy fails it."""
    objects = by_name(render("cpu"))
    broken = copy.deepcopy(objects[("NetworkPolicy", TRITON)])
    for rule in broken["spec"]["ingress"]:
        for peer in rule["from"]:
            labels = peer.get("podSelector", {}).get("matchLabels", {})
            if labels.get("app.kubernetes.io/name") == GATEWAY:
                labels["app.kubernetes.io/name"] = "nexus-sli-gatway"
    assert not admits(broken, "ingress", _pod_labels(objects, GATEWAY), None, 8001)
    assert admits(objects[("NetworkPolicy", TRITON)], "ingress", _pod_labels(objects, GATEWAY), None, 8001)


# --- autoscaling ----------------------------------------------------------------------------------



def test_each_autoscaler_scales_on_a_metric_an_adapter_rule_serves(rendered):
    _, objects, _ = rendered
    rules = adapter_rules()
    for name in (TRITON, GATEWAY):
        hpa = objects[("HorizontalPodAutoscaler", name)]
        assert hpa["apiVersion"] == "autoscaling/v2"
        assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
        (metric,) = hpa["spec"]["metrics"]
        assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] in rules, metric
        # the whole pod: an ensemble's own queue time is near zero, its steps' is the signal; the gateway
        # has one in-flight series per pod
        assert "selector" not in metric["pods"]["metric"]
        assert metric["pods"]["target"]["type"] == "AverageValue" and int(metric["pods"]["target"]["averageValue"]) > 0
        assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60
    assert objects[("HorizontalPodAutoscaler", TRITON)]["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
        "nexus_sli_queue_us_per_request"
    assert objects[("HorizontalPodAutoscaler", GATEWAY)]["spec"]["metrics"][0]["pods"]["metric"]["name"] == \
        "nexus_sli_gateway_requests_in_flight"


def test_the_prometheus_adapter_rules_field_by_field():
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    assert set(values) == {"rules"} and set(values["rules"]) == {"default", "custom"}
    for name, rule in adapter_rules().items():
        assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}, name
        series = re.match(r"(\w+)\{", rule["seriesQuery"]).group(1)
        # the pod's own series: Pods metrics are looked up by namespace and pod
        assert rule["seriesQuery"] == f'{series}{{namespace!="",pod!=""}}'
        assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"},
                                                   "pod": {"resource": "pod"}}}
        assert re.fullmatch(rule["name"]["matches"], series), name
        query = " ".join(rule["metricsQuery"].split())
        # every selector restricted to the HPA's pods, every sum per pod
        selectors = re.findall(r"\b(\w+)\{([^}]*)\}", query)
        assert selectors and all(inside == "<<.LabelMatchers>>" for _, inside in selectors), name
        assert query.count("sum by (<<.GroupBy>>)") == len(selectors) and series in dict(selectors)
    queue = " ".join(adapter_rules()["nexus_sli_queue_us_per_request"]["metricsQuery"].split())
    numerator, denominator = queue.split(" / ")
    assert "rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])" in numerator
    assert "rate(nv_inference_request_success{<<.LabelMatchers>>}[1m])" in denominator
    in_flight = " ".join(adapter_rules()["nexus_sli_gateway_requests_in_flight"]["metricsQuery"].split())
    assert "avg_over_time(nexus_sli_gateway_requests_in_flight{<<.LabelMatchers>>}[1m])" in in_flight


# --- the monitoring component ---------------------------------------------------------------------

#: The PodMonitor fields this project sets, by path; anything else is a mistake.  (PodMonitor is the
#: Prometheus operator's CRD, whose schema kubernetes-validate does not bundle.  The rendered objects
#: were also checked once against monitoring.coreos.com_podmonitors.yaml of prometheus-operator 0.93.0,
#: made strict; that file is not part of this repository.)
_POD_MONITOR_KEYS = {
    (): {"apiVersion", "kind", "metadata", "spec"},
    ("metadata",): {"name", "labels"},
    ("spec",): {"selector", "podMetricsEndpoints"},
    ("spec", "selector"): {"matchLabels"},
}
_ENDPOINT_KEYS = {"port", "path", "interval", "authorization"}


def _monitored_objects(overlay: str = "cpu") -> dict:
    return by_name(render(f"{overlay}-monitored"))


def pod_monitor_problems(monitor: dict, objects: dict) -> list[str]:
    """What is wrong with a PodMonitor: unknown fields, a selector that does not pick exactly one
    Deployment's pods, an endpoint port those pods do not name, credentials that are not the
    gateway's own Secret."""
    problems = []
    for path, keys in _POD_MONITOR_KEYS.items():
        node = monitor
        for part in path:
            node = node[part]
        if set(node) - keys:
            problems.append(f"unknown fields at {'.'.join(path) or '.'}: {sorted(set(node) - keys)}")
    if monitor["apiVersion"] != "monitoring.coreos.com/v1":
        problems.append(f"apiVersion {monitor['apiVersion']}")
    picked = [name for name in (TRITON, GATEWAY) if _matches(monitor["spec"]["selector"]["matchLabels"],
                                                              _pod_labels(objects, name))]
    if len(picked) != 1:
        return problems + [f"its selector picks {picked}"]
    container = _container(objects, picked[0])
    for endpoint in monitor["spec"]["podMetricsEndpoints"]:
        if set(endpoint) - _ENDPOINT_KEYS:
            problems.append(f"unknown endpoint fields {sorted(set(endpoint) - _ENDPOINT_KEYS)}")
        if endpoint["port"] not in {p["name"] for p in container["ports"]}:
            problems.append(f"port {endpoint['port']!r} is not a port of {picked[0]}'s container")
        if endpoint.get("path") != "/metrics" or not re.fullmatch(r"\d+s", endpoint.get("interval", "")):
            problems.append(f"path {endpoint.get('path')!r}, interval {endpoint.get('interval')!r}")
        if picked[0] == GATEWAY:  # every gateway route but /health needs its key, /metrics too
            credentials = endpoint.get("authorization", {}).get("credentials", {})
            secret = f"secret:{credentials.get('name')}/{credentials.get('key')}"
            if endpoint.get("authorization", {}).get("type") != "Bearer" or \
                    secret != _env(objects, GATEWAY)["NEXUS_SLI_API_KEY"]:
                problems.append(f"the gateway's scrape sends {endpoint.get('authorization')}, not its API key")
    return problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_monitors_field_by_field(overlay):
    objects = _monitored_objects(overlay)
    monitors = {name: objects[("PodMonitor", name)] for name in (TRITON, GATEWAY)}
    for name, monitor in monitors.items():
        assert pod_monitor_problems(monitor, objects) == [], name
        assert _matches(monitor["spec"]["selector"]["matchLabels"], _pod_labels(objects, name))
    # Triton's endpoint is the port --metrics-port opens, which its NetworkPolicy opens to Prometheus
    (endpoint,) = monitors[TRITON]["spec"]["podMetricsEndpoints"]
    metrics_port = _named_port(_container(objects), endpoint["port"])
    assert f"--metrics-port={metrics_port}" in _container(objects)["args"]
    for name, port in ((TRITON, metrics_port), (GATEWAY, _named_port(_container(objects, GATEWAY), "http"))):
        assert admits(objects[("NetworkPolicy", name)], "ingress", {}, MONITORING_NAMESPACE, port), name


def test_a_broken_pod_monitor_is_caught():
    objects = _monitored_objects()
    for breaks in (lambda m: m["spec"]["podMetricsEndpoints"][0].update(bearerToken="x"),  # a misspelt field
                   lambda m: m["spec"]["podMetricsEndpoints"][0].update(port="metric"),
                   lambda m: m["spec"]["selector"]["matchLabels"].update({"app.kubernetes.io/component": "server"}),
                   lambda m: m["spec"]["podMetricsEndpoints"][0].pop("authorization")):
        monitor = copy.deepcopy(objects[("PodMonitor", GATEWAY)])
        breaks(monitor)
        assert pod_monitor_problems(monitor, objects), monitor


def test_the_dashboard_is_provisioned_from_a_config_map_grafana_loads():
    objects = _monitored_objects()
    config_map = objects[("ConfigMap", "nexus-sli-dashboard")]
    # Grafana's sidecar convention; a stable name (no hash suffix: the old version would stay beside it)
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["name"] == "nexus-sli-dashboard"
    ((key, text),) = config_map["data"].items()
    assert key.endswith(".json") and json.loads(text) == dashboard()


def test_the_dashboard_shows_what_a_platform_team_asks_for():
    board = dashboard()
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in board["panels"]}) == len(board["panels"]) and board["uid"]
    expressions = " ".join(t["expr"] for p in panels for t in p["targets"])
    for metric in ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_queue_duration_us",
                   "nv_inference_compute_infer_duration_us", "nexus_sli_gateway_request_duration_seconds_bucket",
                   "nexus_sli_gateway_requests_total"):
        assert metric in expressions, metric
    assert "histogram_quantile(0.5," in expressions and "histogram_quantile(0.99," in expressions
    assert "count by (pod)" in expressions  # replicas
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for panel in panels:  # every query on the chosen data source and namespace
        assert panel["datasource"]["uid"] == "${datasource}" and panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["refId"] and 'namespace="$namespace"' in target["expr"], target


# --- images ---------------------------------------------------------------------------------------

#: The InferenceService fields this project sets, by path; anything else is a mistake.
_INFERENCE_SERVICE_KEYS = {
    (): {"apiVersion", "kind", "metadata", "spec"},
    ("metadata",): {"name", "annotations"},
    ("spec",): {"predictor"},
    ("spec", "predictor"): {"minReplicas", "maxReplicas", "serviceAccountName", "model"},
    ("spec", "predictor", "model"): {"modelFormat", "protocolVersion", "storageUri", "image", "resources"},
    ("spec", "predictor", "model", "modelFormat"): {"name"},
}


def test_the_kserve_service_account_lists_the_secret_the_docs_create():
    account = yaml.safe_load((K8S / "kserve" / "serviceaccount.yaml").read_text())
    service = yaml.safe_load((K8S / "kserve" / "inferenceservice.yaml").read_text())
    assert (account["apiVersion"], account["kind"]) == ("v1", "ServiceAccount")
    kubernetes_validate.validate(account, K8S_VERSION, strict=True)
    assert account["metadata"]["name"] == service["spec"]["predictor"]["serviceAccountName"]
    docs = (ROOT / "docs" / "deployment.md").read_text()
    assert [s["name"] for s in account["secrets"]] == ["nexus-sli-object-store"]
    assert "kubectl create secret generic nexus-sli-object-store" in docs


def test_the_kserve_inference_service_field_by_field():
    service = yaml.safe_load((K8S / "kserve" / "inferenceservice.yaml").read_text())
    for path, keys in _INFERENCE_SERVICE_KEYS.items():
        node = service
        for part in path:
            node = node[part]
        assert set(node) == keys, path
    assert service["apiVersion"] == "serving.kserve.io/v1beta1" and service["kind"] == "InferenceService"
    predictor = service["spec"]["predictor"]
    model = predictor["model"]
    assert model["modelFormat"] == {"name": "triton"} and model["protocolVersion"] == "v2"
    assert model["storageUri"] == "s3://nexus-sli-models/repositories/cpu"
    assert 1 < predictor["minReplicas"] < predictor["maxReplicas"]
    # the container fields are the core Container schema's: validate them as one
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"},
                                  "spec": {"containers": [{"name": "kserve-container", "image": model["image"],
                                                           "resources": model["resources"]}]}},
                                 K8S_VERSION, strict=True)


def test_the_image_is_the_one_deploy_docker_builds():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    tag = re.search(r"^FROM nvcr\.io/nvidia/tritonserver:([\w.]+)-py3", dockerfile, re.MULTILINE).group(1)
    images = {_container(by_name(render(o)))["image"] for o in OVERLAYS}
    kserve = yaml.safe_load((K8S / "kserve" / "inferenceservice.yaml").read_text())
    assert images | {kserve["spec"]["predictor"]["model"]["image"]} == {f"nexus-sli-triton:{tag}"}
