"""Run untrusted generated programs: one subprocess each, limited, in a throw-away directory.

Layers, each enough for the common failures: a Python audit hook (no fork/exec/kill/sockets/ctypes, no write,
delete or rename outside the working directory), resource limits (address space, CPU seconds, file size,
process count where the kernel applies it: not for root), a clean environment, a new session killed as a
whole process group on timeout and after every run.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GUARD = r'''
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED = ("os.fork", "os.forkpty", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.kill", "os.killpg",
            "subprocess.Popen", "pty.spawn", "socket.connect", "socket.bind", "ctypes.dlopen", "ctypes.dlsym",
            "ctypes.cdata", "os.chroot", "os.setuid", "os.putenv", "os.unsetenv", "sys.addaudithook",
            "os.link", "os.symlink", "os.truncate", "shutil.chown", "os.chown", "os.chmod", "os.chdir")
_PATH_EVENTS = {"os.remove": 1, "os.rmdir": 1, "os.rename": 2, "shutil.rmtree": 1, "os.mkdir": 1,
                "shutil.move": 2, "shutil.copyfile": 2, "os.replace": 2, "os.utime": 1}
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    try:
        real = os.path.realpath(os.fsdecode(path) if not isinstance(path, int) else "/")
    except Exception:
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _BLOCKED or event.startswith(("os.exec", "os.spawn")):
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = (list(args) + [None, None, 0])[:3]
        writing = (mode is not None and any(c in str(mode) for c in "wax+")) or bool((flags or 0) & _WRITE_FLAGS)
        if writing and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"sandbox: writing {path} outside the working directory")
    elif event in _PATH_EVENTS:
        for path in args[:_PATH_EVENTS[event]]:
            if not isinstance(path, int) and not _inside(path):
                raise PermissionError(f"sandbox: {event} on {path} outside the working directory")

_source = open("program.py", encoding="utf-8").read()
sys.addaudithook(_hook)
exec(compile(_source, "program.py", "exec"), {"__name__": "__main__"})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    file_size_mb: int = 16
    max_processes: int = 16


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended: passed, failed (non-zero exit), timeout or killed by a limit."""

    status: str
    returncode: int | None
    stderr: str
    seconds: float

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def _apply_limits(limits: SandboxLimits) -> None:
    memory = limits.memory_mb << 20
    cpu = int(limits.timeout_s) + 1
    for name, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory), (resource.RLIMIT_CPU, cpu),
                        (resource.RLIMIT_FSIZE, limits.file_size_mb << 20), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_NPROC, limits.max_processes), (resource.RLIMIT_NOFILE, 64)):
        try:
            resource.setrlimit(name, (value, value))
        except (ValueError, OSError):
            pass


def clean_env(work: Path) -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _status(returncode: int, stderr: str) -> str:
    if returncode == 0:
        return "passed"
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL) or "sandbox: " in stderr:
        return "killed" if "sandbox: " not in stderr else "blocked"
    return "memory" if "MemoryError" in stderr else "failed"


def run_program(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` as a script in a fresh temporary directory; never raises for what the program does."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="layerprune-sandbox-") as tmp:
        work = Path(tmp)
        (work / "program.py").write_text(code, encoding="utf-8")
        proc = subprocess.Popen(
            [sys.executable, "-I", "-B", "-c", GUARD], cwd=work, env=clean_env(work), stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True,
            preexec_fn=lambda: _apply_limits(limits), close_fds=True,
        )
        try:
            _, err = proc.communicate(timeout=limits.timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid)
            proc.communicate()
            return SandboxResult("timeout", None, "", time.perf_counter() - start)
        finally:
            _kill_group(proc.pid)
        stderr = err.decode("utf-8", "replace")[-2000:]
        return SandboxResult(_status(proc.returncode, stderr), proc.returncode, stderr, time.perf_counter() - start)
