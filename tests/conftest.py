from __future__ import annotations

import os

# before anything imports huggingface_hub, which reads these once: tests never wait on a hub they cannot reach
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from tiny import make_tiny_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = (ROOT.parent / "shared" / "data").resolve()
# the user's cache as the test run found it (xdist's workers read it from the controller, whose LAYERPRUNE_CACHE
# already points at the session's cache)
USER_CACHE = Path(os.environ.get("LAYERPRUNE_TESTS_USER_CACHE") or os.environ.get("LAYERPRUNE_CACHE")
                  or Path.home() / ".cache" / "layerprune")
# under pytest-xdist (make test: -n 2) each worker takes one core; alone, the tests use two
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
torch.set_num_threads(1 if WORKER else max(1, min(2, os.cpu_count() or 1)))
if WORKER:  # and so does every process a test starts (lm-eval's CLI, a model in a fresh process): two threads each
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # beside two workers oversubscribe the cores, and small ops wait


def isolated_cache(root: Path, user_cache: Path = USER_CACHE) -> Path:
    """A fresh cache under `root` for the session: nothing a test does is written to the user's cache.

    What takes minutes to rebuild and is only read once made (the embedded models converted to safetensors, the
    assembled Gemma GGUF) is linked in entry by entry where the user's cache has it complete; everything written
    (the eval cache, the hash memo, a conversion of another file) lands in the session's own folders, never
    through a link. Without a user cache the embedded models are converted here (minutes, once per session).
    """
    cache = root / "layerprune-cache"
    for sub in ("converted", "gguf"):
        (cache / sub).mkdir(parents=True, exist_ok=True)
        source = user_cache / sub
        for entry in sorted(source.iterdir()) if source.is_dir() else []:
            complete = (entry / "config.json").is_file() if sub == "converted" else entry.is_file()
            if complete:
                (cache / sub / entry.name).symlink_to(entry, target_is_directory=entry.is_dir())
    return cache


# before any test resolves settings: the process and every subprocess it starts use the session's cache. The
# process that makes it (pytest itself, or xdist's controller) owns it; xdist's workers inherit it through the
# environment, so an embedded model converted by one worker is there for the other (the cache lock builds it once).
_SHARED_ROOT = "LAYERPRUNE_TESTS_SESSION_ROOT"
_OWNER = _SHARED_ROOT not in os.environ
if _OWNER:
    _SESSION_ROOT = Path(tempfile.mkdtemp(prefix="layerprune-tests-"))
    os.environ[_SHARED_ROOT] = str(_SESSION_ROOT)
    os.environ["LAYERPRUNE_TESTS_USER_CACHE"] = str(USER_CACHE)
    os.environ["LAYERPRUNE_CACHE"] = str(isolated_cache(_SESSION_ROOT))
else:
    _SESSION_ROOT = Path(os.environ[_SHARED_ROOT])
    os.environ["LAYERPRUNE_CACHE"] = str(_SESSION_ROOT / "layerprune-cache")


def pytest_unconfigure(config):
    if _OWNER:
        shutil.rmtree(_SESSION_ROOT, ignore_errors=True)  # removes the links, never what they point at


# seconds per test module (setup, call and teardown of its tests), printed with --durations' list: under xdist the
# controller gets every worker's reports, so a module's total is its time on the worker that ran it
_MODULE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::", 1)[0]
    _MODULE_SECONDS[module] = _MODULE_SECONDS.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, config):
    shown = config.option.durations
    if not shown or not _MODULE_SECONDS:
        return
    ranked = sorted(_MODULE_SECONDS.items(), key=lambda item: -item[1])
    terminalreporter.write_sep("=", f"slowest {min(shown, len(ranked))} modules (setup + call + teardown)")
    for module, seconds in ranked[:shown]:
        terminalreporter.write_line(f"{seconds:8.2f}s {module}")
    terminalreporter.write_line(f"{sum(_MODULE_SECONDS.values()):8.2f}s in all {len(ranked)} modules")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def pytest_collection_finish(session):
    """The libraries nearly every worker loads are imported once the tests are collected, and everything alive then
    (modules, their functions and classes: ~0.5 million objects, none ever garbage) is moved out of the cyclic
    collector's reach (gc.freeze): each gc.collect() the code under test makes between models scans only what the
    tests built, ~0.1 s instead of ~0.45 s (21 such calls in the tiny sweep's test alone)."""
    import gc

    import datasets  # noqa: F401
    import lm_eval.evaluator  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import trl  # noqa: F401

    gc.collect()
    gc.freeze()


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip("../shared/data is not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def pruned_embedded():
    """(name, layers) -> (directory, its prune report): embedded:NAME minus `layers`, pruned once per test run (the
    default prune: streamed from the cached safetensors, block-major logits check). xdist's workers share it through
    the session's folder, under a lock; tests read it and never write into it."""
    from layerprune.core.outputs import cache_lock
    from layerprune.prune.api import prune_model
    from layerprune.prune.recipe import PruneRecipe

    def get(name: str, layers: list[int]) -> tuple[Path, dict]:
        target = _SESSION_ROOT / "pruned" / f"{name}-{'-'.join(map(str, layers))}"
        report = target / "prune_report.json"
        with cache_lock(_SESSION_ROOT, f"pruned-{target.name}"):
            if not report.is_file():
                prune_model(f"embedded:{name}", PruneRecipe(layers=layers), output=target)
        return target, json.loads(report.read_text())

    return get


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """arch -> directory of a saved tiny random model (built once per session)."""
    cache: dict[tuple[str, int], Path] = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(arch: str = "llama", layers: int = 6) -> Path:
        key = (arch, layers)
        if key not in cache:
            cache[key] = make_tiny_model(root / f"{arch}-{layers}", arch, layers)
        return cache[key]

    return get


@pytest.fixture
def tiny_llama(tiny_models) -> Path:
    return tiny_models("llama", 6)


@pytest.fixture
def pruned(capsys, tiny_llama, tmp_path) -> Path:
    """tiny_llama pruned of blocks 2 and 4 by `layerprune prune` (the CLI, as a user would); the recover tests' own
    `pruned` fixtures (a module-scoped pruned copy) override it in their modules."""
    from helpers import run_cli

    out = tmp_path / "pruned"
    code, _, err = run_cli(capsys, ["prune", "--model", str(tiny_llama), "--output", str(out), "--layers", "2,4"])
    assert code == 0, err
    return out


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """An empty data mirror at tmp_path/data (fill it with helpers.write_rows; a module's own `data_dir` does)."""
    root = tmp_path / "data"
    root.mkdir()
    return root
