"""The HumanEval+ sandbox: each misbehaving program fails alone and harms nothing."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from layerprune.evaluate.sandbox import SandboxLimits, available_isolation, run_program

LIMITS = SandboxLimits(timeout_s=3, memory_mb=512)
pytestmark = pytest.mark.skipif(available_isolation()[0] == "none",
                                reason="no isolation here: " + available_isolation()[1])
GOOD = "def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n"


def test_good_program_passes():
    assert run_program(GOOD, LIMITS).passed


def test_failing_assert_fails():
    result = run_program("assert 1 == 2\n", LIMITS)
    assert not result.passed and result.status == "failed"


def test_infinite_loop_times_out():
    result = run_program("while True:\n    pass\n", replace(LIMITS, timeout_s=1.5))  # it spins a core until then
    assert result.status == "timeout" and result.seconds < 30


def test_fork_bomb_fails_and_leaves_no_process():
    before = len(os.listdir("/proc"))
    result = run_program("import os\nwhile True:\n    os.fork()\n", LIMITS)
    assert not result.passed
    assert len(os.listdir("/proc")) < before + 20


def test_subprocess_runs_inside_the_sandbox():
    code = "import subprocess\nassert subprocess.run(['id', '-u'], capture_output=True).stdout.strip() != b'0'\n"
    assert run_program(code, LIMITS).passed


def test_huge_allocation_fails():
    result = run_program("x = bytearray(64 << 30)\n", LIMITS)
    assert not result.passed and result.status == "memory"


def test_write_outside_fails_and_writes_nothing(tmp_path):
    target = tmp_path / "outside.txt"
    result = run_program(f"open({str(target)!r}, 'w').write('x')\n", LIMITS)
    assert not result.passed and not target.exists()


def test_delete_outside_fails_and_deletes_nothing(tmp_path):
    victim = tmp_path / "keep.txt"
    victim.write_text("keep")
    for code in (f"import os\nos.remove({str(victim)!r})\n", f"import shutil\nshutil.rmtree({str(tmp_path)!r})\n"):
        assert not run_program(code, LIMITS).passed
    assert victim.read_text() == "keep"


def test_own_directory_is_writable():
    assert run_program("open('scratch.txt', 'w').write('x')\nimport os\nos.remove('scratch.txt')\n", LIMITS).passed


def test_environment_is_clean(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "abc")
    code = "import posix\nassert b'SECRET_TOKEN' not in posix.environ\nassert posix.environ[b'HOME'] != b'/root'\n"
    assert run_program(code, LIMITS).passed


def test_bad_sample_fails_only_itself():
    programs = [GOOD, "while True:\n    pass\n", GOOD, "import os\nos.kill(os.getpid(), 9)\n", GOOD]
    results = [run_program(code, SandboxLimits(timeout_s=2)).passed for code in programs]
    assert results == [True, False, True, False, True]


def test_humaneval_harness_on_real_rows(shared_data: Path):
    from layerprune.evaluate.project_tasks import humaneval_program, humaneval_rows

    rows = humaneval_rows(shared_data)[:3]
    for row in rows:
        assert run_program(humaneval_program(row, row["reference"]), SandboxLimits(timeout_s=20)).passed
    wrong = "    return None\n"
    assert not run_program(humaneval_program(rows[0], wrong), SandboxLimits(timeout_s=20)).passed
