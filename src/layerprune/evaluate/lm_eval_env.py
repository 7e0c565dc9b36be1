"""lm-eval's environment record, made once per process and working directory.

`simple_evaluate` ends every call by describing the environment it ran in: `torch.utils.collect_env` (which starts
pip, lscpu and other programs) and `git describe` for this folder and the one above it, about a third of a second a
call on a 2-core machine, with the same answer each time. A study scores dozens of (model, task) pairs in one process
and the test suite hundreds; `record_once()` has lm-eval make the record on the first call in a working directory and
hands later calls a copy. The results carry the same fields as before (lm-eval has no switch to skip them).
"""

from __future__ import annotations

import copy
import os
import subprocess
from typing import Any

_RECORDS: dict[tuple[str, str], Any] = {}


def record_once() -> None:
    """Replace lm-eval's `add_env_info` and `get_git_commit_hash`, as its evaluator module calls them, with memoized
    ones (idempotent)."""
    from lm_eval import evaluator

    if getattr(evaluator.add_env_info, "memoized", False):
        return
    evaluator.add_env_info = _memoized_env_info(evaluator.add_env_info)
    evaluator.get_git_commit_hash = _memoized_git_hash(evaluator.get_git_commit_hash)


def _memoized_env_info(original: Any) -> Any:
    def add_env_info(storage: dict[str, Any]) -> None:
        key = ("env", os.getcwd())
        if key not in _RECORDS:
            record: dict[str, Any] = {}
            original(record)
            _RECORDS[key] = record
        storage.update(copy.deepcopy(_RECORDS[key]))

    add_env_info.memoized = True  # type: ignore[attr-defined]
    return add_env_info


def _in_git_tree() -> bool:
    try:
        found = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True, timeout=10,
                               check=False)
    except (OSError, subprocess.SubprocessError):
        return False
    return found.returncode == 0


def _memoized_git_hash(original: Any) -> Any:
    def get_git_commit_hash() -> Any:
        key = ("git", os.getcwd())
        if key not in _RECORDS:  # outside a git work tree git says "fatal: not a git repository" on our stderr
            _RECORDS[key] = original() if _in_git_tree() else None
        return _RECORDS[key]

    return get_git_commit_hash
