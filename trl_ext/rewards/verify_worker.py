"""Time-bounded math-verify grading in a child process, safe from any thread.

Why a process: math-verify's timeout is ``signal.alarm`` (main thread only), and ``9^{9^{9^{9}}}`` makes sympy
compute a huge integer in one C call holding the interpreter lock, so the whole process hangs; a child process can
always be killed. Each ``parse`` + ``verify`` runs in a worker (this file as a script: standard library and
``math_verify`` only) forked from a warmed-up "zygote"; the caller waits for ``timeout`` CPU seconds of the worker
(Linux; wall time elsewhere), at most ``WALL_FACTOR * timeout`` wall seconds, then kills it: not equivalent.

Inside the worker a size bound (:func:`_too_large`: results over :data:`MAX_DIGITS` digits, symbolic exponents over
:data:`MAX_SYMBOLIC_EXPONENT`) rejects degenerate answers at once, under a memory limit (:data:`WORKER_MEMORY_BYTES`).
Workers are pooled per grading thread, reused and replaced when dead; a forked child process drops the inherited pool
and starts its own. POSIX only.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import select
import subprocess
import sys
import threading
import time

MAX_DIGITS = 10_000
"""A number with more decimal digits than this (10^10000) is not an answer: such expressions are graded 0 unseen."""

MAX_SYMBOLIC_EXPONENT = 1_000
"""Largest exponent of a symbolic power (``(x+1)^{1000}``) that ``verify`` may try to expand."""

WORKER_MEMORY_BYTES = 4 * 2**30
"""Address-space limit of each worker process (4 GiB)."""

WALL_FACTOR = 2.0
"""A worker starved of CPU by a loaded machine may take up to this many times the limit in wall time."""

STARTUP_TIMEOUT_S = 120.0
"""How long to wait for a new worker to import math-verify (not counted in the grading timeout)."""


# ------------------------------------------------------------------------------------------------ worker side
_WARM_UP = [
    ("\\frac{1}{2}", "0.5"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("[1, 3)", "[1,3)"),
    ("\\{1, 2\\}", "2, 1"),
    ("(1, -1)", "(1,-1)"),
    ("(x+1)^2", "x^2 + 2x + 1"),
    ("x = 2", "2"),
    ("3\\pi", "3\\pi"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "(1, 2)"),
    ("10\\%", "0.1"),
    ("\\text{(A)}", "A"),
    ("e^{i\\pi}", "-1"),
    ("\\log_2 8", "3"),
    ("x \\in (0, \\infty)", "(0,\\infty)"),
]


def _too_large(expr) -> bool:
    """True when evaluating ``expr`` (a sympy object) would build a number of more than MAX_DIGITS digits."""
    import sympy

    limit = float(MAX_DIGITS)

    def digits(e) -> float:
        """Upper bound of log10 of the size of e's digits (0 for |e| <= 1); math.inf beyond any limit."""
        if isinstance(e, sympy.Integer):
            return math.log10(abs(int(e))) if e != 0 else 0.0
        if isinstance(e, sympy.Rational):  # numerator and denominator are both written out
            return max(math.log10(abs(e.p)), math.log10(abs(e.q)))
        if isinstance(e, sympy.Float):
            value = abs(float(e))
            return math.log10(value) if 1 < value < math.inf else (math.inf if value == math.inf else 0.0)
        if isinstance(e, sympy.Pow):
            base, exponent = e.args
            size = magnitude(exponent)
            if not base.free_symbols:
                base_digits = digits(base)
                return base_digits * size + digits(exponent) if base_digits > 0 else digits(exponent)
            return math.inf if size > MAX_SYMBOLIC_EXPONENT else digits(base) + digits(exponent)
        if isinstance(e, (sympy.factorial, sympy.gamma, sympy.factorial2, sympy.subfactorial, sympy.binomial)):
            n = magnitude(e.args[0])
            return n * math.log10(max(n, 10.0)) + sum(digits(a) for a in e.args)  # n! < n^n
        if not e.args:
            return 0.0
        parts = [digits(a) for a in e.args]
        if isinstance(e, sympy.Mul):
            return sum(parts)
        return max(parts) + math.log10(len(parts))

    def magnitude(e) -> float:
        """Upper bound of |e| for a numeric e (its value when it is a plain number); 1 for symbols."""
        if isinstance(e, sympy.Number):
            value = abs(float(e))
            return value if value == value else math.inf
        if e.free_symbols and not isinstance(e, sympy.Pow):
            return max((magnitude(a) for a in e.args), default=1.0)
        d = digits(e)
        return 10**d if d < 300 else math.inf

    def walk(e) -> bool:
        if isinstance(e, sympy.Basic):
            try:
                return digits(e) > limit
            except (OverflowError, TypeError, ValueError):
                return True
        if isinstance(e, sympy.MatrixBase):
            return any(walk(x) for x in e)
        return False

    return walk(expr)


def _grade(parse, verify, gold_text: str, pred_text: str) -> bool:
    def parse_answer(text: str) -> list:
        # Wrapped in $...$ so LaTeX answers ("\frac{1}{2}") are picked up by math-verify's LaTeX extractor; plain
        # text that does not parse that way is retried as-is (math-verify's expression extractor).
        return parse(f"${text}$", parsing_timeout=None) or parse(text, parsing_timeout=None)

    gold, pred = parse_answer(gold_text), parse_answer(pred_text)
    if not gold or not pred or any(_too_large(x) for x in (*gold, *pred)):
        return False
    return bool(verify(gold, pred, timeout_seconds=None))


def _serve(sock) -> None:  # pragma: no cover - runs in a worker process
    """Answer grading requests, one JSON line in, one JSON line out, until the caller closes the socket."""
    import functools

    from math_verify import parse as math_verify_parse
    from math_verify import verify

    # The same texts come back often (one reference per GRPO group, repeated completions); sympy results are
    # immutable, so parses are cached.
    @functools.lru_cache(maxsize=4096)
    def parse(text: str, parsing_timeout=None) -> list:
        return math_verify_parse(text, parsing_timeout=parsing_timeout)

    stream = sock.makefile("rw", buffering=1)
    for line in stream:
        try:
            request = json.loads(line)
            ok = _grade(parse, verify, request["gold"], request["pred"])
        except Exception:  # noqa: BLE001 - any failure to parse or compare means "not shown equivalent"
            ok = False
        stream.write(json.dumps({"ok": ok}) + "\n")
        stream.flush()


def _zygote_main(control_fd: int) -> None:  # pragma: no cover - runs in the child process
    """Import math-verify once, then fork one grading worker per socket the caller sends (fork: ~ms, no imports)."""
    import logging
    import signal
    import socket

    sys.stdout = sys.stderr
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    for name in ("math_verify", "math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    import math_verify

    # Lazy initialization (grammars, sympy caches) happens here once, not in the first request of every worker.
    for gold, pred in _WARM_UP:
        try:
            _grade(math_verify.parse, math_verify.verify, gold, pred)
        except Exception:  # noqa: BLE001
            pass

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers are reaped automatically
    control = socket.socket(fileno=control_fd)
    control.sendall(b"ready\n")
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 16, 1)
        except OSError:
            break
        if not fds:  # the caller closed the control socket: it is gone
            break
        pid = os.fork()
        if pid == 0:
            control.close()
            _die_with_parent()
            _serve(socket.socket(fileno=fds[0]))
            os._exit(0)
        os.close(fds[0])
        control.sendall(f"{pid}\n".encode())


def _die_with_parent() -> None:  # pragma: no cover - runs in a worker process
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass


# ------------------------------------------------------------------------------------------------ caller side
TIMED_OUT, DIED = "timed out", "died"
"""The two ways a request ends without a verdict (see ``_Worker.request``)."""


class _Zygote:
    """The child process that has imported math-verify and forks workers on request."""

    def __init__(self) -> None:
        import socket

        ours, theirs = socket.socketpair()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        theirs.close()
        self.control = ours
        self.reader = ours.makefile("r", buffering=1)
        readable, _, _ = select.select([ours], [], [], STARTUP_TIMEOUT_S)
        if not readable or self.reader.readline() != "ready\n":
            self.proc.kill()
            raise RuntimeError(
                f"the math-verify worker process ({sys.executable} {__file__}) did not start within "
                f"{STARTUP_TIMEOUT_S:.0f} s (exit code {self.proc.poll()}); is math-verify installed?"
            )

    def fork_worker(self) -> _Worker | None:
        """A new worker (a fork of this zygote), or None when the zygote is dead."""
        import socket

        ours, theirs = socket.socketpair()
        try:
            socket.send_fds(self.control, [b"w"], [theirs.fileno()])
            line = self.reader.readline()
        except OSError:
            line = ""
        finally:
            theirs.close()
        if not line.strip().isdigit():
            ours.close()
            return None
        return _Worker(ours, int(line))

    def close(self) -> None:
        self.control.close()
        self.proc.wait(timeout=10)


class _Worker:
    def __init__(self, sock, pid: int) -> None:
        self.sock, self.pid = sock, pid
        self.stream = sock.makefile("rw", buffering=1)

    def cpu_seconds(self) -> float | None:
        """CPU time the worker has used (Linux /proc); None where it cannot be read."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, ValueError, IndexError):
            return None

    def request(self, gold: str, pred: str, timeout: float, deadline: float) -> bool | str:
        """The worker's verdict; ``TIMED_OUT`` when it spent ``timeout`` seconds on it or ``deadline``
        (``time.monotonic()``) passed; ``DIED`` when it ended without answering (killed from outside, crashed).

        The budget is the worker's CPU time where it can be read (Linux), so that a machine loaded by other work
        does not turn slow ordinary answers into wrong ones, capped by the wall-clock ``deadline``; elsewhere it is
        wall time. On an idle machine both are the same ~``timeout`` seconds.
        """
        try:
            self.stream.write(json.dumps({"gold": gold, "pred": pred}) + "\n")
            self.stream.flush()
            start_wall, start_cpu = time.monotonic(), self.cpu_seconds()
            while True:
                now = time.monotonic()
                cpu = self.cpu_seconds()
                used = now - start_wall if start_cpu is None or cpu is None else cpu - start_cpu
                if used >= timeout or now >= deadline:
                    return TIMED_OUT
                wait = min(max(timeout - used, 0.02), deadline - now)
                readable, _, _ = select.select([self.sock], [], [], wait)
                if readable:
                    line = self.stream.readline()
                    return bool(json.loads(line)["ok"]) if line else DIED
        except (OSError, ValueError, KeyError):  # a broken pipe, or a partial line from a worker killed mid-write
            return DIED

    def kill(self) -> None:
        import signal

        try:
            os.kill(self.pid, signal.SIGKILL)
        except OSError:
            pass
        self.stream.close()
        self.sock.close()


_idle: list[_Worker] = []
_lock = threading.Lock()
_zygote: _Zygote | None = None
_owner_pid = os.getpid()
_stats = {"timeouts": 0}


def _close_inherited(sock) -> None:
    """Close this process's copy of an inherited socket: no flush, no shutdown, no kill, so the parent's end and
    the worker it talks to are untouched (the socket object forgets its descriptor, so nothing closes it twice)."""
    try:
        os.close(sock.detach())
    except OSError:
        pass


def _forget_parent_workers() -> None:
    """In a forked child: drop the workers and zygote inherited from the parent and start with none of its own.

    A fork copies the parent's pool, whose sockets lead to the parent's worker processes; a child writing to them
    would read the parent's answers (and the parent the child's). Runs after ``os.fork`` (``os.register_at_fork``)
    and, for forks that bypass Python's hooks, when a call finds ``os.getpid()`` changed. The lock is replaced too:
    another thread of the parent may have held it at the moment of the fork.
    """
    global _idle, _lock, _zygote, _owner_pid
    inherited, zygote = _idle, _zygote
    _idle, _lock, _zygote, _owner_pid = [], threading.Lock(), None, os.getpid()
    _stats["timeouts"] = 0
    for worker in inherited:
        _close_inherited(worker.sock)
    if zygote is not None:
        _close_inherited(zygote.control)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parent_workers)


def _new_worker() -> _Worker:
    global _zygote
    with _lock:
        for _ in range(2):
            if _zygote is None or _zygote.proc.poll() is not None:
                _zygote = _Zygote()
            worker = _zygote.fork_worker()
            if worker is not None:
                return worker
            _zygote = None
    raise RuntimeError("could not fork a math-verify worker process")


def _idle_worker() -> _Worker | None:
    """A pooled worker that is still alive, or None. An idle worker never writes, so a readable socket means it
    died (killed from outside, out of memory): it is dropped and the next one tried."""
    while True:
        with _lock:
            if not _idle:
                return None
            worker = _idle.pop()
        readable, _, _ = select.select([worker.sock], [], [], 0)
        if not readable:
            return worker
        worker.kill()


def verify_in_worker(gold: str, pred: str, timeout: float) -> bool:
    """True when math-verify shows ``pred`` equivalent to ``gold`` within ``timeout`` seconds (see ``_Worker.request``).

    ``math_verify.parse`` on both (LaTeX first, then plain) and ``math_verify.verify(gold, pred)`` in a pooled worker
    (module docstring); thread- and fork-safe. A request whose worker died is sent once more to a fresh one. The first
    call starts the zygote (a few seconds, not counted in the limit).

    Args:
        gold: reference answer text (LaTeX or plain).
        pred: predicted answer text.
        timeout: limit in seconds (> 0): the worker's CPU time on Linux, wall time elsewhere, at most
            ``WALL_FACTOR * timeout`` of wall time; on expiry the worker is killed and the result is False.

    Returns:
        The verdict; False on a parse failure, an expression over the size bound, a timeout, or a worker that died
        twice on this answer.

    Raises:
        ValueError: ``timeout`` <= 0.
        RuntimeError: the worker process could not be started.
    """
    if not timeout > 0:
        raise ValueError(f"timeout={timeout!r}; expected seconds > 0")
    if os.getpid() != _owner_pid:  # forked by a path that skipped os.register_at_fork (a fork() from C)
        _forget_parent_workers()
    wall_left = WALL_FACTOR * timeout  # grading time only: starting a worker is not counted
    for attempt in range(2):
        worker = _idle_worker() or _new_worker()
        start = time.monotonic()
        verdict = worker.request(gold, pred, timeout, start + wall_left)
        wall_left -= time.monotonic() - start
        if verdict is DIED and attempt == 0 and wall_left > 0:
            worker.kill()  # killed from outside while grading: a fresh fork answers in the time that is left
            continue
        if verdict is TIMED_OUT or verdict is DIED:
            worker.kill()
            with _lock:
                _stats["timeouts"] += verdict is TIMED_OUT
            return False
        with _lock:
            _idle.append(worker)
        return verdict
    raise AssertionError("unreachable")  # pragma: no cover


def timeouts() -> int:
    """How many gradings in this process have hit the wall-clock limit so far."""
    return _stats["timeouts"]


@atexit.register
def _shutdown() -> None:
    global _zygote
    if os.getpid() != _owner_pid:  # a forked child exiting: the workers it sees are its parent's
        _forget_parent_workers()
        return
    with _lock:
        workers, _idle[:] = list(_idle), []
        zygote, _zygote = _zygote, None
    for worker in workers:
        worker.kill()
    if zygote is not None:
        try:
            zygote.close()
        except (OSError, subprocess.TimeoutExpired):
            zygote.proc.kill()


if __name__ == "__main__":  # pragma: no cover
    _zygote_main(int(sys.argv[1]))
