"""The sandbox's launcher: `python -I -S -c "import sandbox_launcher; sandbox_launcher.main()" CONFIG` (the config a
marshal dump in hex: no import costs), standard library only.

It isolates one program from the operating system, then executes it:
1. (this process) new mount, PID, network, IPC and UTS namespaces (and a user namespace when not root);
2. (PID 1 of the new namespace) a fresh root on a tmpfs holding read-only binds of /usr, /etc and the
   interpreter's prefixes, a size-limited tmpfs at /tmp (the only writable place) holding program.py, a
   minimal /dev and a new /proc;
3. (the program) rlimits, a dedicated unprivileged uid/gid (as root) or the caller's uid without
   capabilities (user namespace), no_new_privs, then exec of the interpreter on the program.
PID 1 waits for the program and exits; the kernel then kills whatever the program left behind. The outcome
is written to the status file as one line: `exit N`, `signal N`, `timeout`, or `setup MESSAGE`.
Mode `none` (only with --unsafe-code-exec) skips steps 1-2 and the uid change.
"""

from __future__ import annotations

import _signal as signal  # the C module: `signal` imports enum, which costs this launcher milliseconds
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 1, 38, 47, 4
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41, "ppc64le": 203, "s390x": 217}
SYSTEM_DIRS = ("usr", "etc", "bin", "sbin", "lib", "lib32", "lib64", "libx32")
DEVICES = ("null", "zero", "random", "urandom")
SETUP_FAILED = 125

libc = ctypes.CDLL(None, use_errno=True)


class SetupError(Exception):
    """The isolation could not be set up (reported as `setup MESSAGE`)."""


def _check(result: int, what: str) -> None:
    if result != 0:
        raise SetupError(f"{what}: {os.strerror(ctypes.get_errno())}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = [None if v is None else os.fsencode(v) for v in (source, target, fstype, data)]
    _check(libc.mount(enc[0], enc[1], enc[2], ctypes.c_ulong(flags), enc[3]), f"mount {target}")


def _locked_flags(path: str) -> int:
    """Flags a remount must keep (a user namespace may not clear them)."""
    st, flags = os.statvfs(path).f_flag, 0
    for st_flag, ms_flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
                             (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME),
                             (getattr(os, "ST_RELATIME", 4096), MS_RELATIME)):
        if st & st_flag:
            flags |= ms_flag
    return flags


def _mounts_under(target: str) -> list[str]:
    with open("/proc/self/mountinfo", "rb") as handle:
        points = [os.fsdecode(line.split()[4].decode("unicode_escape").encode("latin-1")) for line in handle]
    return sorted({p for p in points if p == target or p.startswith(target.rstrip("/") + "/")})


def bind(source: str, target: str, writable: bool = False, device: bool = False) -> None:
    """Bind `source` (a path or /proc/self/fd/N) on `target`, then make it and every mount below it read-only."""
    _mount(source, target, None, MS_BIND | MS_REC)
    extra = (0 if writable else MS_RDONLY) | MS_NOSUID | (0 if device else MS_NODEV)
    for point in _mounts_under(target) if not device else [target]:
        _mount(None, point, None, MS_REMOUNT | MS_BIND | extra | _locked_flags(point))


def _mkdirs(path: str) -> None:
    os.makedirs(path, mode=0o755, exist_ok=True)


def build_root(cfg: dict, fds: dict[str, int]) -> None:
    """A new root at cfg['root']: system dirs and interpreter prefixes read-only, the program's dir at /tmp."""
    root = cfg["root"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for name in SYSTEM_DIRS:
        host, inside = "/" + name, root + "/" + name
        if os.path.islink(host):
            os.symlink(os.readlink(host), inside)
        elif os.path.isdir(host):
            _mkdirs(inside)
            bind(host, inside)
    for path in cfg["binds"]:
        if not os.path.exists(root + path):
            _mkdirs(root + path)
            bind(path, root + path)
    _build_tmp(root, cfg, fds["program"])
    _build_dev(root, cfg["limits"]["file_size_mb"])
    _mkdirs(root + "/proc")
    _mount("proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.chdir(root)
    _check(libc.syscall(SYS_PIVOT_ROOT[os.uname().machine], b".", b"."), "pivot_root")
    _check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/")
    _mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _build_tmp(root: str, cfg: dict, program: int) -> None:
    """The program's only writable directory: a size-limited tmpfs at /tmp holding program.py."""
    owner = f",uid={cfg['uid']},gid={cfg['gid']}" if cfg["mode"] == "uid" else ""
    _mkdirs(root + "/tmp")
    _mount("tmpfs", root + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['limits']['tmp_mb']}m,mode=700{owner}")
    with os.fdopen(program, "rb") as source, open(root + "/tmp/program.py", "wb") as target:
        target.write(source.read())


def _build_dev(root: str, shm_mb: int) -> None:
    dev = root + "/dev"
    _mkdirs(dev)
    _mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        os.close(os.open(f"{dev}/{name}", os.O_WRONLY | os.O_CREAT, 0o644))
        bind(f"/dev/{name}", f"{dev}/{name}", writable=True, device=True)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{name}")
    _mkdirs(dev + "/shm")
    _mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, f"size={shm_mb}m,mode=1777")
    _mount(None, dev, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def set_limits(limits: dict) -> None:
    memory = limits["memory_mb"] << 20
    cpu = int(limits["timeout_s"]) + 1
    for name, value in ((resource.RLIMIT_AS, memory), (resource.RLIMIT_DATA, memory), (resource.RLIMIT_CPU, cpu),
                        (resource.RLIMIT_FSIZE, limits["file_size_mb"] << 20), (resource.RLIMIT_CORE, 0),
                        (resource.RLIMIT_NPROC, limits["max_processes"]), (resource.RLIMIT_NOFILE, 256)):
        resource.setrlimit(name, (value, value))


def exec_program(cfg: dict) -> None:
    """In the child: limits, an unprivileged identity, then the interpreter on the program (never returns)."""
    try:
        set_limits(cfg["limits"])
        if cfg["mode"] == "uid":
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
        os.chdir(cfg["cwd"])
        os.closerange(3, 1 << 16)
        os.execve(cfg["python"], [cfg["python"], *cfg["argv"]], cfg["env"])
    except BaseException as exc:  # noqa: BLE001 -- the child must never return into the launcher
        os.write(2, f"sandbox: could not start the program: {exc}\n".encode())
    os._exit(SETUP_FAILED)


def wait_program(pid: int, timeout_s: float) -> str:
    """Reap every child (this is PID 1) until the program ends or the wall-clock limit passes."""
    def expire(*_: object) -> None:
        raise TimeoutError

    signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, timeout_s)
    try:
        while True:
            done, status = os.waitpid(-1, 0)
            if done == pid:
                break
    except TimeoutError:
        return "timeout"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if os.WIFSIGNALED(status):
        return f"signal {os.WTERMSIG(status)}"
    return f"exit {os.WEXITSTATUS(status)}"


def init(cfg: dict, fds: dict[str, int], report: int) -> None:
    """PID 1 of the new namespaces: build the root, start the program, report how it ended, exit."""
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    signal.signal(signal.SIGINT, signal.SIG_DFL)  # PID 1 ignores signals it has no handler for
    try:
        build_root(cfg, fds)
    except (SetupError, OSError) as exc:
        os.write(report, f"setup {exc}".encode())
        os._exit(SETUP_FAILED)
    pid = os.fork()
    if pid == 0:
        exec_program(cfg)
    os.write(report, wait_program(pid, cfg["limits"]["timeout_s"]).encode())
    os._exit(0)


def enter_namespaces(cfg: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if cfg["mode"] == "userns":
        flags |= CLONE_NEWUSER
    if libc.unshare(flags) != 0:
        hint = " (user namespaces off or at their limit: sysctl user.max_user_namespaces)" \
            if cfg["mode"] == "userns" else ""
        raise SetupError(f"unshare: {os.strerror(ctypes.get_errno())}{hint}")
    if cfg["mode"] == "userns":
        for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
            with open(f"/proc/self/{name}", "w", encoding="ascii") as handle:
                handle.write(text)


def run_unisolated(cfg: dict) -> str:
    """Mode none: limits and a new session only."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        exec_program({**cfg, "mode": "none"})
    outcome = wait_program(pid, cfg["limits"]["timeout_s"])
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    return outcome


def launch(cfg: dict) -> str:
    """Run the program isolated as cfg says; the outcome line."""
    if cfg["mode"] == "none":
        return run_unisolated(cfg)
    try:  # opened before a user namespace may make its directory unreachable
        fds = {"program": os.open(cfg["program"], os.O_RDONLY)}
        enter_namespaces(cfg)
    except (SetupError, OSError) as exc:
        return f"setup {exc}"
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        init(cfg, fds, write_end)
    os.close(write_end)
    os.waitpid(pid, 0)
    with os.fdopen(read_end, "rb") as handle:
        return handle.read().decode("utf-8", "replace") or "setup PID 1 of the sandbox died"


def main() -> None:
    cfg = marshal.loads(bytes.fromhex(sys.argv[1]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    status = os.open(cfg["status"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # before the root changes
    os.write(status, launch(cfg).encode("utf-8", "replace"))
    os.close(status)


if __name__ == "__main__":
    main()
