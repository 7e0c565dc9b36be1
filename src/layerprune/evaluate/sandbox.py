"""Run untrusted generated programs, each isolated from the operating system (not only from Python).

Each program runs through `sandbox_launcher.py` (a small stdlib script) in new mount, PID, network, IPC and
UTS namespaces, on a fresh read-only root holding only the system directories and this interpreter, with a
size-limited tmpfs at /tmp as its only writable place; as a dedicated unprivileged uid/gid with no home when
the evaluator is root (a user namespace otherwise), no capabilities, no_new_privs and rlimits set before
exec. When the program ends, PID 1 of its namespace exits and the kernel kills every process it left.
Output goes to files, so RLIMIT_FSIZE caps what a program can print; the evaluator reads their tails.

Where neither root nor user namespaces are available, running generated code is refused unless the user
opts in (`--unsafe-code-exec`); every result records the isolation it ran under.

Known limits: memory is bounded per process (RLIMIT_AS), so one program may hold up to max_processes x
memory_mb (no cgroup is created); there is no seccomp filter; the pass token guards against early exits, not
against a program that deliberately digs it out of the wrapper's frame.
"""

from __future__ import annotations

import functools
import marshal
import os
import random
import re
import secrets
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from layerprune.core.errors import LayerpruneError, one_line
from layerprune.evaluate import sandbox_launcher

# The launcher is imported (not run as a script) so that its cached bytecode is used: compiling it costs ms.
LAUNCH = f"import sys; sys.path[:0] = [{str(Path(sandbox_launcher.__file__).parent)!r}]; " \
         "import sandbox_launcher; sandbox_launcher.main()"
ISOLATED = ("uid", "userns")  # namespaces with a dedicated uid (evaluator is root) or with a user namespace
UID_BASE = 1_500_000_000  # dedicated ids own no file and no home; one per run so rlimits and signals stay apart
GRACE_S = 5.0
TAIL_BYTES = 64 << 10
MARKER = b"layerprune-sandbox-complete:"
# the error the program ended on (its stderr's last line: a traceback's, or a harness's report of it) is one
# the isolation produces: EPERM, EACCES, EROFS, no address family, no address, unreachable, refused
BLOCKED = re.compile(r"\b\w*Error: \[Errno (1|13|30|97|99|101|111)\]")
STATUSES = ("passed", "failed", "timeout", "memory", "blocked", "killed", "error")

# The program runs inside this wrapper: it takes the run's token from stdin (then closed), executes
# program.py, and only when its last statement has run writes the token to stdout. An early
# sys.exit(0)/os._exit(0)/exit() leaves no token, so it does not pass.
WRAPPER = r'''
def _run():
    import os, sys
    token = b""
    while not token.endswith(b"\n"):
        chunk = os.read(0, 128)
        if not chunk:
            break
        token += chunk
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    with open("program.py", encoding="utf-8") as handle:
        source = handle.read()
    sys.argv = ["program.py"]
    exec(compile(source, "program.py", "exec"), {"__name__": "__main__"})
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(1, b"\n" + token)
_run()
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-program limits, and whether to run generated code without isolation when none is available."""

    timeout_s: float = 10.0
    memory_mb: int = 2048
    file_size_mb: int = 16
    max_processes: int = 16
    tmp_mb: int = 64
    allow_unsafe: bool = False


@dataclass(frozen=True)
class SandboxResult:
    """How one program ended (`status`, one of STATUSES) and under which isolation it ran."""

    status: str
    returncode: int | None
    stderr: str
    seconds: float
    isolation: str = ""
    reason: str = ""
    stdout: str = ""

    @property
    def passed(self) -> bool:
        return self.status == "passed"


def clean_env(home: str) -> dict[str, str]:
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8",
            "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def interpreter_dirs() -> list[str]:
    """The directories this interpreter needs, outside the system ones that are always bound."""
    dirs = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    system = [Path("/usr"), Path("/etc")] + [Path("/", name) for name in ("bin", "sbin", "lib", "lib32", "lib64")]
    return sorted((d for d in dirs if d != "/" and not any(Path(d).is_relative_to(s) for s in system)), key=len)


def _config(run: Path, mode: str, limits: SandboxLimits) -> dict:
    isolated = mode in ISOLATED
    uid = UID_BASE + random.randrange(1_000_000) if mode == "uid" else os.getuid()
    home = "/tmp" if isolated else str(run / "work")
    program = run / "program.py" if isolated else run / "work" / "program.py"
    return {"mode": mode, "uid": uid, "gid": uid if mode == "uid" else os.getgid(), "root": str(run / "root"),
            "binds": interpreter_dirs(), "program": str(program), "status": str(run / "status"),
            "python": sys.executable, "argv": ["-I", "-B", "-c", WRAPPER], "cwd": home, "env": clean_env(home),
            "limits": {"timeout_s": limits.timeout_s, "memory_mb": limits.memory_mb, "tmp_mb": limits.tmp_mb,
                       "file_size_mb": limits.file_size_mb, "max_processes": limits.max_processes}}


def _tail(path: Path, size: int = TAIL_BYTES) -> bytes:
    try:
        with open(path, "rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - size))
            return handle.read()
    except OSError:
        return b""


def _exited_within(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait for `proc` up to `seconds` without polling (Popen.wait(timeout) sleeps in steps of up to 50 ms)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout=seconds)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        ready, _, _ = select.select([fd], [], [], seconds)
    finally:
        os.close(fd)
    if ready:
        proc.wait()
    return bool(ready)


def _wait(proc: subprocess.Popen, limits: SandboxLimits) -> bool:
    """Wait for the launcher; past the limit kill it (its namespace dies with it). False when it timed out."""
    if _exited_within(proc, limits.timeout_s + GRACE_S):
        return True
    for kill in (lambda: os.killpg(proc.pid, signal.SIGKILL), proc.kill):
        try:
            kill()
        except OSError:
            pass
    _exited_within(proc, GRACE_S)  # an unkillable one (uninterruptible IO) is left rather than stall the evaluator
    return False


def classify(outcome: str, stdout_tail: bytes, stderr: str, token: bytes) -> tuple[str, int | None, str]:
    """(status, returncode, reason) from the launcher's outcome line and the output tails."""
    kind, _, value = outcome.partition(" ")
    if kind == "timeout":
        return "timeout", None, "wall-clock limit"
    if kind == "signal":
        sig = int(value)
        if sig == signal.SIGXCPU:
            return "timeout", -sig, "CPU-time limit"
        return "killed", -sig, f"killed by {signal.strsignal(sig) or sig}"
    if kind != "exit":
        return "error", None, f"sandbox setup failed: {outcome[6:] if kind == 'setup' else outcome or 'no outcome'}"
    code = int(value)
    if code == 0:
        if token in stdout_tail:
            return "passed", 0, ""
        return "failed", 0, "exited before its last statement ran"
    if "MemoryError" in stderr:
        return "memory", code, "memory limit"
    if BLOCKED.search((stderr.strip().splitlines() or [""])[-1]):
        return "blocked", code, "an operation the sandbox forbids"
    return "failed", code, "non-zero exit"


def execute(code: str, limits: SandboxLimits, mode: str) -> SandboxResult:
    """Run `code` once under `mode` (uid, userns or none)."""
    start = time.perf_counter()
    token = MARKER + secrets.token_hex(16).encode() + b"\n"
    with tempfile.TemporaryDirectory(prefix="layerprune-sandbox-", ignore_cleanup_errors=True) as tmp:
        run = Path(tmp)
        (run / "root").mkdir()
        (run / "work").mkdir()
        cfg = _config(run, mode, limits)
        Path(cfg["program"]).write_text(code, encoding="utf-8")
        with open(run / "stdout", "wb") as out, open(run / "stderr", "wb") as err:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", LAUNCH, marshal.dumps(cfg).hex()],
                                    stdin=subprocess.PIPE, stdout=out, stderr=err, env=clean_env(tmp),
                                    close_fds=True, start_new_session=True)
        try:
            proc.stdin.write(token)  # type: ignore[union-attr]
            proc.stdin.close()  # type: ignore[union-attr]
        except OSError:
            pass
        finished = _wait(proc, limits)
        outcome = _tail(run / "status").decode("utf-8", "replace") if finished else "timeout"
        stderr = _tail(run / "stderr", 4000).decode("utf-8", "replace")
        stdout = _tail(run / "stdout")
        status, returncode, reason = classify(outcome, stdout, stderr, token)
    shown = stdout.replace(b"\n" + token, b"").decode("utf-8", "replace")[-2000:]
    return SandboxResult(status, returncode, stderr[-2000:], time.perf_counter() - start, mode, reason, shown)


@functools.cache
def available_isolation() -> tuple[str, str]:
    """The strongest isolation this machine allows ('uid', 'userns' or 'none'), with why the others failed."""
    reasons = []
    for mode in ISOLATED if os.geteuid() == 0 else ISOLATED[1:]:
        probe = execute("pass\n", SandboxLimits(timeout_s=20), mode)
        if probe.passed:
            return mode, ""
        reasons.append(one_line(f"{mode}: {probe.reason or probe.status} {probe.stderr.strip()[-200:]}"))
    if os.geteuid() != 0:
        reasons.insert(0, "not root")
    return "none", "; ".join(reasons)


def isolation_level(allow_unsafe: bool = False) -> str:
    """The isolation generated code will run under; refuses (LayerpruneError) when there is none."""
    mode, why = available_isolation()
    if mode == "none" and not allow_unsafe:
        raise LayerpruneError(f"refusing to run generated code without isolation ({why}); "
                              "pass --unsafe-code-exec to run it anyway")
    return mode


def run_program(code: str, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run `code` as a script in the sandbox; never raises for what the program does.

    Passed means exit code 0 after the program's last statement ran. Raises LayerpruneError only when the
    machine offers no isolation and `limits.allow_unsafe` is false.
    """
    limits = limits or SandboxLimits()
    return execute(code, limits, isolation_level(limits.allow_unsafe))
