"""Another revision of this project, runnable beside the checkout: its code, this environment's packages.

The bench's stack harness (bench/stack_ceiling.py) serves an earlier revision next to the checkout in
one run, so that a change is judged against the code before it under the same load at the same time.
A revision is extracted with ``git archive`` into a folder and given an interpreter of its own: a venv
without packages whose one ``.pth`` file puts the revision's import names (``nexus_sli.*``, the same
mapping as ``pyproject.toml``'s ``package-dir``) before this environment's site-packages.  The
editable install of the checkout is a ``.pth`` hook of this environment's site-packages, which a path
listed in another ``.pth`` does not run, so the revision's code is the only ``nexus_sli`` it sees;
Triton's python-backend stubs started from that interpreter see the same.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
import venv
from pathlib import Path

from .texts import repository_root


def package_dirs(root: Path) -> dict[str, str]:
    """``pyproject.toml``'s ``package-dir`` mapping of ``root`` (import name -> folder)."""
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["setuptools"]["package-dir"]


def resolve(revision: str) -> str:
    """The full commit ``revision`` names in this checkout; a ValueError naming it where git does not know it."""
    found = subprocess.run(["git", "rev-parse", "--verify", f"{revision}^{{commit}}"], cwd=repository_root(),
                           capture_output=True, text=True)
    if found.returncode != 0:
        raise ValueError(f"git does not know the revision {revision!r} here: {found.stderr.strip()}")
    return found.stdout.strip()


def interpreter(revision: str, folder: Path) -> Path:
    """A Python that imports ``nexus_sli`` from ``revision`` (made under ``folder`` on first use)."""
    commit = resolve(revision)
    home = folder.resolve() / commit[:12]
    python = home / "venv" / "bin" / "python"
    if python.exists():
        return python
    source = home / "source"
    source.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", commit], cwd=repository_root(), capture_output=True, check=True)
    subprocess.run(["tar", "-x", "-C", str(source)], input=archive.stdout, check=True)
    names = home / "names" / "nexus_sli"
    names.mkdir(parents=True, exist_ok=True)
    for name, path in package_dirs(source).items():
        (names / name.removeprefix("nexus_sli.")).symlink_to(source / path)
    venv.EnvBuilder(with_pip=False).create(home / "venv")
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # this environment's packages: its site-packages, and those it reaches through a .pth of its own
    ours = dict.fromkeys(p for p in sys.path if Path(p).name == "site-packages")
    (site / "nexus_sli_revision.pth").write_text("\n".join([str(names.parent), *ours]) + "\n")
    return python


if __name__ == "__main__":
    print(interpreter(sys.argv[1], Path(sys.argv[2])))
