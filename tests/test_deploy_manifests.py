"""deploy/docker and deploy/k8s together: the Triton image runs as the user the Deployment runs as,
not root.  (tests/test_k8s.py checks the manifests, tests/test_gpu_docker.py the image's packages.)"""

from __future__ import annotations

import json
import subprocess
import sys

from helpers.k8s import ROOT, by_name, render

DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
#: Docker's own parser, in an interpreter of its own (tests/test_gpu_docker.py says why)
_PARSE = ("import dockerfile, json, sys; print(json.dumps([{'cmd': c.cmd, 'value': list(c.value)} "
          "for c in dockerfile.parse_file(sys.argv[1])]))")


def _image_user() -> str:
    """The user the image's container runs as: its last USER instruction, root without one."""
    out = subprocess.run([sys.executable, "-c", _PARSE, str(DOCKERFILE)], capture_output=True, text=True, check=True)
    users = [command["value"][0] for command in json.loads(out.stdout) if command["cmd"].upper() == "USER"]
    return users[-1] if users else "root"


def test_the_triton_image_runs_as_the_deployments_non_root_user():
    # `docker run` of the image runs as this user too, not only the pods; a number, which runAsNonRoot can check
    uid, _, gid = _image_user().partition(":")
    assert uid.isdigit() and int(uid) != 0, uid
    pod = by_name(render("cpu"))[("Deployment", "nexus-sli-triton")]["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid or uid)) == (pod["runAsUser"], pod["runAsGroup"])
