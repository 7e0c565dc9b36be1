"""The source of the two programs humaneval.py runs in subprocesses, read as text (never imported by them):
`reference_program()` appends `_references()` (the trusted oracle run of every problem, in one process),
`check_program()` appends the candidate's parameters (the `_NONCE` ... `_CANDIDATE` assignments below, filled in)
and `_main()` (the sandboxed check).

Standard library only, no import of layerprune, and nothing runs at import: the sandbox executes this text as
program.py. `_digest` is shared: a digest under which equal outputs (as `==` sees them for these types:
1 == 1.0 == True, dict and set order ignored) agree. Large outputs (HumanEval/15 and /130 return megabytes) are
compared by it, as embedding them made 100-200 MB programs.
"""

import base64 as _b64
import cmath as _cmath
import hashlib as _hashlib
import io as _io
import json as _json
import math as _dmath
import math as _math
import os as _os
import pickle as _pickle
import signal as _signal
import sys as _sys


def _canon(x, h):
    t = type(x)
    if x is None:
        h.update(b"N")
    elif t in (bool, int) or (t is float and _dmath.isfinite(x) and x == int(x)):
        n = int(x)
        h.update(b"n" + n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True) + b";")
    elif t is float:
        h.update(b"f" + repr(x).encode() + b";")
    elif t is str:
        data = x.encode("utf-8", "surrogatepass")
        h.update(b"s%d:" % len(data) + data)
    elif t in (list, tuple):
        h.update((b"l" if t is list else b"t") + b"%d[" % len(x))
        for item in x:
            _canon(item, h)
        h.update(b"]")
    elif t in (set, frozenset):
        h.update(b"S" + b"".join(sorted(_digest(item).encode() for item in x)))
    elif t is dict:
        h.update(b"d" + b"".join(sorted((_digest(k) + _digest(v)).encode() for k, v in x.items())))
    else:
        h.update(b"o" + t.__name__.encode() + b":" + repr(x).encode("utf-8", "replace"))


def _digest(x):
    h = _hashlib.sha256()
    _canon(x, h)
    return h.hexdigest()


# the check's parameters: check_program() assigns each again after this text, before it calls _main()
_NONCE = ""
_ENTRY = ""
_ATOL = 0.0
_LIMITS = []
_INPUTS = []
_EXPECTED = []
_DIGESTS = []
_CANDIDATE = ""


def _decode(inputs, expected):
    # the inputs as JSON text, the expected outputs as base64 of a pickle: how check_program() carries them
    return _json.loads(inputs), _pickle.loads(_b64.b64decode(expected))


def _say(line):
    data = (_NONCE + " " + line + "\n").encode("utf-8", "replace")
    for fd in (1, 2):
        try:
            _os.write(fd, data)
        except OSError:
            pass


class _Timeout(BaseException):
    pass


def _alarm(signum, frame):
    raise _Timeout()


def _poly(xs, x):
    return sum([coeff * _math.pow(x, i) for i, coeff in enumerate(xs)])


def _is_floats(x):
    if isinstance(x, float):
        return True
    if isinstance(x, (list, tuple)):
        return all(isinstance(i, float) for i in x)
    return False


def _same(out, exp, inp, atol):
    exact = out == exp
    if _ENTRY == "find_zero":
        return abs(_poly(*inp, out)) <= atol
    if atol == 0 and _is_floats(exp):
        atol = 1e-6
    if not exact and atol != 0:
        if type(out) != type(exp) or (isinstance(exp, (list, tuple)) and len(out) != len(exp)):  # noqa: E721
            return False
        return _allclose(out, exp, atol)
    return bool(exact)


def _allclose(out, exp, atol, rtol=1e-07):
    # numpy.allclose(out, exp, rtol, atol) for numbers and equal-shaped nested sequences, in plain Python (the
    # sandbox may not import numpy): |out - exp| <= atol + rtol * |exp|, NaN never close, infinities only to themselves
    if isinstance(exp, (list, tuple)) or isinstance(out, (list, tuple)):
        if not (isinstance(exp, (list, tuple)) and isinstance(out, (list, tuple))) or len(out) != len(exp):
            return False
        return all(_allclose(o, e, atol, rtol) for o, e in zip(out, exp, strict=False))
    if isinstance(out, str) or isinstance(exp, str):
        raise TypeError("not numbers")
    if _cmath.isinf(out) or _cmath.isinf(exp):
        return out == exp
    return abs(out - exp) <= atol + rtol * abs(exp)


def _main():
    sink = _io.StringIO()
    _sys.stdout = _sys.stderr = sink
    _sys.stdin = _io.StringIO()
    _signal.signal(_signal.SIGALRM, _alarm)
    namespace = {}
    try:
        exec(compile(_CANDIDATE, "candidate.py", "exec"), namespace)
        fn = namespace[_ENTRY]
    except BaseException as exc:
        _say("failed load " + type(exc).__name__ + ": " + str(exc)[:300].replace("\n", " "))
        _os._exit(1)
    for i, inp in enumerate(_INPUTS):
        try:
            _signal.setitimer(_signal.ITIMER_REAL, _LIMITS[i])
            try:
                out = fn(*inp)
            finally:
                _signal.setitimer(_signal.ITIMER_REAL, 0)
        except _Timeout:
            _say(f"timeout {i} over {_LIMITS[i]:.2f}s")
            _os._exit(3)
        except MemoryError:
            _say(f"memory {i}")
            _os._exit(4)
        except BaseException as exc:
            _say(f"failed {i} raised {type(exc).__name__}: " + str(exc)[:300].replace("\n", " "))
            _os._exit(1)
        try:
            if _DIGESTS[i] is not None:
                same = _digest(out) == _DIGESTS[i]
            else:
                same = _same(out, _EXPECTED[i], inp, _ATOL)
        except BaseException:
            same = False
        if not same:
            _say(f"failed {i} wrong output")
            _os._exit(1)
    _say(f"passed {len(_INPUTS)}")  # then return: the sandbox's own pass needs the program to end normally


def _reference_outputs(problem, inline_bytes):
    # one problem's expected outputs, the seconds each input took, and the digest of each output too large to inline
    import copy
    import pickle
    import time

    namespace = {}
    exec(compile(problem["code"], "reference.py", "exec"), namespace)
    fn = namespace[problem["entry_point"]]
    outputs, seconds, digests = [], [], []
    for args in problem["inputs"]:
        args = copy.deepcopy(args)
        start = time.time()
        value = fn(*args)
        seconds.append(time.time() - start)
        big = len(pickle.dumps(value, protocol=4)) > inline_bytes
        digests.append(_digest(value) if big else None)
        outputs.append(None if big else value)
    return outputs, seconds, digests


def _references():
    # every problem of the job in this one trusted process, as EvalPlus computes its ground truth; each problem
    # announced on stderr before it runs, so that a crash is laid at its door; stops at the first that fails. The
    # watchdog is faulthandler's C thread: it ends the process (traceback on stderr, exit 1) when a problem runs
    # over, even one stuck inside C code (a huge bigint, a regex) where SIGALRM would wait for the next bytecode
    import faulthandler
    import json
    import pickle
    import sys

    job = json.loads(sys.stdin.read())
    out = sys.stdout.buffer
    sys.stdout = sys.stderr
    done, failure = [], None
    for problem in job["problems"]:
        sys.stderr.write(job["mark"] + problem["task_id"] + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback_later(job["timeout_s"], exit=True, file=sys.__stderr__)
        try:
            result = _reference_outputs(problem, job["inline_bytes"])
        except BaseException as exc:
            failure = (problem["task_id"], type(exc).__name__ + ": " + str(exc)[:200].replace("\n", " "))
            break
        finally:
            faulthandler.cancel_dump_traceback_later()
        done.append((problem["task_id"], *result))
    out.write(pickle.dumps((done, failure), protocol=4))
