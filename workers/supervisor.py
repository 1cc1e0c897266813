"""A small process supervisor: what ``manage.py serve`` runs its children under (ADR 0012).

Each child runs in its own session (its own process group), so that

- a terminal's Ctrl-C reaches only the supervisor, which then stops the children in order;
- stopping or reaping a child signals its whole group: what it started (uvicorn's worker
  processes, a Celery worker's helpers) goes with it, even when the child itself died first;
- each child also gets the parent-death signal (Linux), so a supervisor that is itself killed
  with SIGKILL does not leave its children running.

A child that exits while the supervisor is not stopping is restarted after an exponential
backoff (``Backoff``), and its exit is reported with its status (the signal's name for a
negative return code) and the last lines it printed. A child that exited ``crash_limit`` times
within ``crash_window_s`` is reported as failing; it is still retried at the capped backoff, so
a fixed configuration is picked up without a restart of everything, and the others keep running.

Children's output is relayed line by line, prefixed with the child's name, and the last lines
are kept for the reports. Nothing here knows about Django: ``serve`` builds the child list,
listens to the events (logging, the pools' status in Redis) and decides the stop order.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import ctypes.util
import enum
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import IO

log = logging.getLogger(__name__)

TAIL_LINES = 20
POLL_S = 0.05


def describe_exit(code: int) -> str:
    """``exit status 1`` or ``killed by SIGKILL`` (Popen's negative codes are signals)."""
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit status {code}"


@dataclass(frozen=True)
class Backoff:
    """Delay before the n-th consecutive restart: base, 2 x base, 4 x base ... up to cap."""

    base_s: float = 0.5
    cap_s: float = 30.0

    def delay(self, streak: int) -> float:
        return min(self.cap_s, self.base_s * 2.0 ** max(0, streak - 1))


@dataclass
class ChildSpec:
    name: str
    argv: list[str]
    env: Mapping[str, str] | None = None
    stop_signal: int = signal.SIGTERM
    stop_timeout_s: float = 10.0  # after the stop signal; then SIGKILL to the group
    # Polled with the pid after each start until true; without it, up for ready_after_s.
    ready: Callable[[int], bool] | None = None


class State(enum.StrEnum):
    STARTING = "starting"  # started, its ready check not yet true
    RUNNING = "running"
    RESTARTING = "restarting"  # exited; waiting out the backoff
    RETIRING = "retiring"  # told to stop for good (``retire``); dropped once it has exited
    STOPPED = "stopped"


@dataclass
class Child:
    spec: ChildSpec
    popen: subprocess.Popen[bytes] | None = None
    state: State = State.STOPPED
    tail: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=TAIL_LINES))
    crashes: collections.deque[float] = field(default_factory=collections.deque)
    streak: int = 0  # consecutive exits without a stable run in between
    started_at: float = 0.0
    restart_at: float = 0.0
    last_exit: str = ""
    starts: int = 0
    # Exited crash_limit times within crash_window_s; cleared once it is ready again.
    failing: bool = False
    _reader: threading.Thread | None = None
    kill_at: float = 0.0  # while retiring: SIGKILL to its group from then on

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.popen.pid if self.popen is not None else None

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def output(self, lines: int = TAIL_LINES) -> str:
        return "\n".join(list(self.tail)[-lines:])


# (child, event), event one of: started, ready, exited, failing, recovered, stopped.
Listener = Callable[[Child, str], None]


class Supervisor:
    def __init__(self, specs: Iterable[ChildSpec], *, backoff: Backoff | None = None,
                 crash_limit: int = 3, crash_window_s: float = 60.0,
                 stable_after_s: float = 30.0, ready_after_s: float = 10.0,
                 listener: Listener | None = None, output: IO[bytes] | None = None) -> None:
        self.children = {spec.name: Child(spec) for spec in specs}
        self.backoff = backoff or Backoff()
        self.crash_limit = crash_limit
        self.crash_window_s = crash_window_s
        self.stable_after_s = stable_after_s
        self.ready_after_s = ready_after_s
        self.listener = listener
        self.output = output if output is not None else sys.stdout.buffer
        self._out_lock = threading.Lock()
        self._stopping = False
        self._hurry = threading.Event()
        self._hurried = False

    # -- running ------------------------------------------------------------------------------

    def start(self, names: Iterable[str] | None = None) -> None:
        for name in names if names is not None else list(self.children):
            self._spawn(self.children[name])

    def add(self, spec: ChildSpec) -> Child:
        """Start a new child while the others run (a pool added or re-enabled under ``serve``).

        Its name must be free: a child of that name still retiring must be gone first.
        """
        if spec.name in self.children:
            raise ValueError(f"a child named {spec.name} is still supervised")
        child = self.children[spec.name] = Child(spec)
        self._spawn(child)
        return child

    def retire(self, name: str, now: float | None = None) -> None:
        """Stop one child for good without waiting (a pool disabled or changed under ``serve``).

        It gets its stop signal now; ``poll`` sends SIGKILL to its group after its
        ``stop_timeout_s`` and drops it once it has exited (event ``stopped``), so the name is
        free again. A child between restarts is dropped at the next ``poll``.
        """
        child = self.children[name]
        if child.state is State.RETIRING:
            return
        now = time.monotonic() if now is None else now
        child.state = State.RETIRING
        child.kill_at = now + child.spec.stop_timeout_s
        if child.alive():
            assert child.popen is not None
            log.info("stopping %s (pid %d) for good", name, child.popen.pid)
            _kill_group(child.popen.pid, child.spec.stop_signal)

    def poll(self, now: float | None = None) -> None:
        """Reap exits, restart what is due, check readiness. Call it a few times a second."""
        now = time.monotonic() if now is None else now
        for child in list(self.children.values()):
            if child.state is State.RETIRING:
                self._retiring(child, now)
            elif child.state in (State.STARTING, State.RUNNING) and not child.alive():
                assert child.popen is not None
                self._exited(child, describe_exit(child.popen.returncode), now)
            elif child.state is State.STARTING and self._is_ready(child):
                child.state = State.RUNNING
                self._emit(child, "ready")
                if child.failing:
                    child.failing = False
                    log.warning("%s is running again", child.name)
                    self._emit(child, "recovered")
            elif child.state is State.RESTARTING and now >= child.restart_at \
                    and not self._stopping:
                self._spawn(child)
            if child.state is State.RUNNING and child.streak \
                    and now - child.started_at >= self.stable_after_s:
                child.streak = 0  # ran long enough: the next exit starts a new streak

    def _retiring(self, child: Child, now: float) -> None:
        if child.alive():
            if now >= child.kill_at:
                assert child.popen is not None
                log.warning("%s did not stop within %.0f s; killing it", child.name,
                            child.spec.stop_timeout_s)
                _kill_group(child.popen.pid, signal.SIGKILL)
            return
        if child.popen is not None:
            _kill_group(child.popen.pid, signal.SIGKILL)  # leftovers of an exited leader
        del self.children[child.name]
        child.state = State.STOPPED
        log.info("%s stopped for good", child.name)
        self._emit(child, "stopped")

    def _is_ready(self, child: Child) -> bool:
        if child.spec.ready is None:  # no probe: up for a moment (a crash at start is not up)
            return time.monotonic() - child.started_at >= self.ready_after_s
        try:
            return child.pid is not None and bool(child.spec.ready(child.pid))
        except Exception:  # a probe that cannot answer yet (Redis restarting ...) means no
            return False

    def _exited(self, child: Child, status: str, now: float) -> None:
        child.last_exit = status
        if child.popen is not None:
            _kill_group(child.popen.pid, signal.SIGKILL)  # what it started must not outlive it
        child.crashes.append(now)
        while child.crashes and now - child.crashes[0] > self.crash_window_s:
            child.crashes.popleft()
        child.streak += 1
        delay = self.backoff.delay(child.streak)
        child.restart_at = now + delay
        child.state = State.RESTARTING
        log.warning("%s (pid %s) exited unexpectedly: %s; restarting in %.1f s",
                    child.name, child.pid, status, delay)
        self._emit(child, "exited")
        if len(child.crashes) >= self.crash_limit and not child.failing:
            child.failing = True
            log.error("%s keeps exiting (%d times in %.0f s), last: %s; the others keep "
                      "running, and it is retried every %.0f s at most. Its last output:\n%s",
                      child.name, len(child.crashes), self.crash_window_s, status,
                      self.backoff.cap_s, child.output(10))
            self._emit(child, "failing")

    def _spawn(self, child: Child) -> None:
        spec = child.spec
        child.started_at = time.monotonic()
        child.starts += 1
        try:
            child.popen = subprocess.Popen(
                spec.argv, env=dict(spec.env) if spec.env is not None else None,
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                start_new_session=True, preexec_fn=_die_with_parent(os.getpid()),
            )
        except OSError as exc:  # e.g. a missing executable: an exit like any other, retried
            child.popen = None
            child.tail.append(f"could not start {spec.argv[0]}: {exc}")
            self._exited(child, f"could not start: {exc}", child.started_at)
            return
        child.state = State.STARTING
        assert child.popen.stdout is not None
        child._reader = threading.Thread(target=self._relay, args=(child, child.popen.stdout),
                                         name=f"relay-{spec.name}", daemon=True)
        child._reader.start()
        log.info("started %s (pid %d)", spec.name, child.popen.pid)
        self._emit(child, "started")

    def _relay(self, child: Child, stream: IO[bytes]) -> None:
        prefix = f"{child.name} | ".encode()
        for line in iter(stream.readline, b""):
            child.tail.append(line.decode(errors="replace").rstrip())
            with self._out_lock, contextlib.suppress(OSError, ValueError):
                self.output.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
                self.output.flush()
        stream.close()

    def _emit(self, child: Child, event: str) -> None:
        if self.listener is not None:
            try:
                self.listener(child, event)
            except Exception:  # a reporter must never take the supervisor down
                log.exception("reporting %s %s failed", child.name, event)

    # -- stopping -----------------------------------------------------------------------------

    def hurry(self) -> None:
        """Thread- and signal-safe: the stop in progress kills what is left at once."""
        self._hurry.set()

    def stop(self, stages: Iterable[Iterable[str]] = ()) -> None:
        """Stop every child, stage by stage (names; children in no stage go last).

        Within a stage each child gets its stop signal, then SIGKILL to its group after its
        ``stop_timeout_s``; a stage ends when all of its children have exited. Afterwards every
        child's group is sent SIGKILL once more, for anything a child left behind.
        """
        self._stopping = True
        ordered: list[list[Child]] = []
        seen: set[str] = set()
        for stage in stages:
            group = [self.children[n] for n in stage if n in self.children and n not in seen]
            seen.update(c.name for c in group)
            ordered.append(group)
        ordered.append([c for n, c in self.children.items() if n not in seen])
        for group in ordered:
            self._stop_stage(group)
        for child in self.children.values():
            if child.popen is not None:
                _kill_group(child.popen.pid, signal.SIGKILL)
            if child._reader is not None:
                child._reader.join(2)

    def _stop_stage(self, group: list[Child]) -> None:
        deadlines: dict[str, float] = {}
        for child in group:
            if child.alive():
                assert child.popen is not None
                log.info("stopping %s (pid %d)", child.name, child.popen.pid)
                _kill_group(child.popen.pid, child.spec.stop_signal)
                deadlines[child.name] = time.monotonic() + child.spec.stop_timeout_s
        while True:
            waiting = [c for c in group if c.alive()]
            if not waiting:
                break
            if self._hurry.is_set() and not self._hurried:
                self._hurried = True
                log.warning("stopping at once: killing what is left")
            for child in waiting:
                if self._hurry.is_set() or time.monotonic() >= deadlines.get(child.name, 0.0):
                    assert child.popen is not None
                    if not self._hurry.is_set():
                        log.warning("%s did not stop within %.0f s; killing it", child.name,
                                    child.spec.stop_timeout_s)
                    _kill_group(child.popen.pid, signal.SIGKILL)
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        child.popen.wait(5)
            time.sleep(POLL_S)
        for child in group:
            if child.popen is not None:
                _kill_group(child.popen.pid, signal.SIGKILL)  # leftovers of an exited leader
            if child.state is not State.STOPPED:
                child.state = State.STOPPED
                self._emit(child, "stopped")


def _kill_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl()  # resolved before any fork: the child only calls it
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None] | None:
    """preexec_fn: SIGTERM this child when the supervisor dies (then its own drain runs)."""
    if _PRCTL is None:
        return None
    prctl = _PRCTL

    def arm() -> None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os.kill(os.getpid(), signal.SIGTERM)

    return arm
