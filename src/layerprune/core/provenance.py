"""Where and with what an output was made: package versions, the layerprune checkout, host, python, time."""

from __future__ import annotations

import importlib.metadata
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from layerprune.core.version import package_version

PACKAGES = ("torch", "transformers", "safetensors", "accelerate", "peft", "trl", "lm_eval", "datasets",
            "huggingface_hub", "scikit-learn", "scipy", "sacrebleu", "nltk", "bitsandbytes")


class GitState(BaseModel):
    """The commit of the layerprune source checkout that ran, and whether it had uncommitted changes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    commit: str
    dirty: bool


class Provenance(BaseModel):
    """Recorded in every report: enough to tell two outputs' software and machine apart."""

    model_config = ConfigDict(extra="forbid")

    layerprune: str = Field(description="layerprune version")
    versions: dict[str, str] = Field(description="Versions of the installed packages that shape results")
    git: GitState | None = Field(description="The layerprune checkout, or None when run from an installed package")
    host: str = Field(description="Machine name")
    cpu: str | None = Field(default=None, description="The CPU's model and widest vector extension (the same code and "
                            "seeds can train other weights on another: the math variant made again once came out "
                            "otherwise)")
    python: str = Field(description="Python version")
    time: datetime = Field(description="When the record was made (UTC)")


def collect_provenance() -> Provenance:
    """The provenance of this process, now."""
    return Provenance(layerprune=package_version(), versions=package_versions(), git=source_checkout(),
                      host=platform.node(), cpu=cpu_model(), python=platform.python_version(),
                      time=datetime.now(timezone.utc))


VECTOR_EXTENSIONS = ("amx_tile", "avx512f", "avx2", "avx", "sse4_2", "neon", "asimd", "sve")  # widest first


def cpu_model() -> str | None:
    """'MODEL (EXTENSION)' from /proc/cpuinfo (Linux), else the platform's processor string, else None."""
    try:
        lines = Path("/proc/cpuinfo").read_text(errors="replace").splitlines()
    except OSError:
        return platform.processor() or None
    fields = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip().lower(), value.strip())
    flags = set((fields.get("flags") or fields.get("features") or "").split())
    widest = next((name for name in VECTOR_EXTENSIONS if name in flags), None)
    name = fields.get("model name") or fields.get("cpu model") or platform.processor() or platform.machine()
    return f"{name} ({widest})" if widest else name or None


def package_versions() -> dict[str, str]:
    """Installed versions of PACKAGES (those not installed are left out)."""
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def source_checkout() -> GitState | None:
    """Commit and dirty flag when layerprune runs from its own git checkout, else None."""
    root = checkout_root(Path(__file__).resolve().parents[1])  # core/ -> src/layerprune
    return git_state(root) if root is not None else None


def checkout_root(package: Path) -> Path | None:
    """The project root when `package` is its src/layerprune (an installed package has none: a repository around
    site-packages is not layerprune's)."""
    root = package.parent.parent
    return root if package.parent.name == "src" and (root / "pyproject.toml").is_file() else None


def git_state(root: Path) -> GitState | None:
    """HEAD and uncommitted changes to tracked files of the repository whose top is `root` (None if it is not one)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    commit = _git(root, "rev-parse", "HEAD")
    if top is None or commit is None or Path(top).resolve() != root.resolve():
        return None
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return GitState(commit=commit, dirty=status is None or bool(status))


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
