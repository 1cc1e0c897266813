"""``workers.supervisor`` on real (tiny Python) child processes: restarts with backoff, crash
loops reported while the others run on, staged stops that leave no process behind, and
children that die with a supervisor killed outright."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from tests.procs import ROOT, wait_until
from workers.supervisor import Backoff, Child, ChildSpec, State, Supervisor, describe_exit

PY = sys.executable
SLEEPER = [PY, "-c", "import time; print('up', flush=True); time.sleep(600)"]
FAST = Backoff(base_s=0.05, cap_s=0.2)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, str]] = []

    def __call__(self, child: Child, event: str) -> None:
        self.events.append((child.name, event, child.last_exit))

    def of(self, name: str, event: str) -> list[tuple[str, str, str]]:
        return [e for e in self.events if e[0] == name and e[1] == event]


def run_until(sup: Supervisor, check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sup.poll()
        if check():
            return
        time.sleep(0.02)
    states = [(c.name, c.state, c.last_exit) for c in sup.children.values()]
    raise AssertionError(f"timed out waiting for {what}: {states}")


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def sink(tmp_path: Path):
    with open(tmp_path / "out.log", "w+b") as f:
        yield f


def test_describe_exit_names_signals() -> None:
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exit status 1"
    assert describe_exit(0) == "exit status 0"


def test_backoff_doubles_up_to_its_cap() -> None:
    b = Backoff(base_s=0.5, cap_s=5.0)
    assert [b.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]


@pytest.mark.integration
def test_a_killed_child_is_restarted_and_reported_with_its_signal(sink) -> None:
    rec = Recorder()
    sup = Supervisor([ChildSpec("a", SLEEPER), ChildSpec("b", SLEEPER)], backoff=FAST,
                     ready_after_s=0.1, listener=rec, output=sink)
    sup.start()
    try:
        run_until(sup, lambda: all("up" in c.tail for c in sup.children.values()),
                  10, "both running")
        a, b = sup.children["a"], sup.children["b"]
        first, b_pid = a.pid, b.pid
        os.kill(first, signal.SIGKILL)
        run_until(sup, lambda: a.pid != first and a.state is State.RUNNING, 10, "a restarted")
        assert rec.of("a", "exited") == [("a", "exited", "killed by SIGKILL")]
        assert b.pid == b_pid and b.alive()  # the others are untouched
        assert not a.failing
        run_until(sup, lambda: list(a.tail).count("up") == 2, 10, "the new run's output")
        sink.flush()
        assert b"a | up\n" in Path(sink.name).read_bytes()  # relayed with the child's name
    finally:
        sup.stop()


@pytest.mark.integration
def test_a_crash_loop_is_reported_once_and_retried_while_the_rest_run(sink) -> None:
    rec = Recorder()
    crasher = [PY, "-c", "import sys; print('bad setting: warp_drive'); sys.exit(3)"]
    sup = Supervisor([ChildSpec("bad", crasher), ChildSpec("good", SLEEPER)], backoff=FAST,
                     crash_limit=3, crash_window_s=60, ready_after_s=30, listener=rec,
                     output=sink)
    sup.start()
    try:
        good = sup.children["good"]
        run_until(sup, lambda: "up" in good.tail, 10, "good running")
        pid = good.pid
        bad = sup.children["bad"]
        run_until(sup, lambda: len(rec.of("bad", "exited")) >= 5, 20, "bad retried")
        assert bad.failing and len(rec.of("bad", "failing")) == 1
        assert bad.last_exit == "exit status 3"
        assert "warp_drive" in bad.output()
        assert good.pid == pid and good.alive()
    finally:
        sup.stop()


@pytest.mark.integration
def test_a_failing_child_that_comes_up_recovers(tmp_path: Path, sink) -> None:
    flag = tmp_path / "fixed"
    script = (f"import os, sys, time; sys.exit(1) if not os.path.exists({str(flag)!r}) "
              "else time.sleep(600)")
    rec = Recorder()
    sup = Supervisor([ChildSpec("c", [PY, "-c", script])], backoff=FAST, crash_limit=2,
                     ready_after_s=0.5, listener=rec, output=sink)
    sup.start()
    try:
        child = sup.children["c"]
        run_until(sup, lambda: child.failing, 20, "failing")
        flag.write_text("")
        run_until(sup, lambda: child.state is State.RUNNING and not child.failing, 20, "recovered")
        assert rec.of("c", "recovered")
    finally:
        sup.stop()


@pytest.mark.integration
def test_ready_probe_holds_a_child_in_starting(tmp_path: Path, sink) -> None:
    flag = tmp_path / "ready"
    sup = Supervisor([ChildSpec("r", SLEEPER, ready=lambda pid: flag.exists())], output=sink)
    sup.start()
    try:
        child = sup.children["r"]
        for _ in range(10):
            sup.poll()
            time.sleep(0.02)
        assert child.state is State.STARTING
        flag.write_text("")
        run_until(sup, lambda: child.state is State.RUNNING, 5, "ready")
    finally:
        sup.stop()


@pytest.mark.integration
def test_stop_goes_stage_by_stage_and_kills_what_ignores_its_signal(sink) -> None:
    stubborn = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                          "print('up', flush=True); time.sleep(600)"]
    rec = Recorder()
    sup = Supervisor([ChildSpec("first", SLEEPER), ChildSpec("second", stubborn,
                                                             stop_timeout_s=0.5),
                      ChildSpec("third", SLEEPER)], listener=rec, output=sink)
    sup.start()
    run_until(sup, lambda: all("up" in c.tail for c in sup.children.values()), 10, "all up")
    pids = [c.pid for c in sup.children.values()]
    started = time.monotonic()
    sup.stop([["first"], ["second"]])
    assert time.monotonic() - started < 5
    assert [e[0] for e in rec.events if e[1] == "stopped"] == ["first", "second", "third"]
    assert all(gone(p) for p in pids)
    assert sup.children["second"].popen.returncode == -signal.SIGKILL


@pytest.mark.integration
def test_what_a_child_started_goes_with_it(sink) -> None:
    # The child starts a grandchild in its process group, prints its pid, then dies: the
    # grandchild must not outlive it (as uvicorn's workers after their master was killed).
    parent = [PY, "-c", textwrap.dedent("""
        import subprocess, sys, time
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(g.pid, flush=True)
        time.sleep(600)
    """)]
    sup = Supervisor([ChildSpec("p", parent)], backoff=Backoff(base_s=30), output=sink)
    sup.start()
    try:
        child = sup.children["p"]
        run_until(sup, lambda: len(child.tail) >= 1, 10, "grandchild pid")
        grandchild = int(child.tail[0])
        os.kill(child.pid, signal.SIGKILL)
        run_until(sup, lambda: child.state is State.RESTARTING, 10, "exit seen")
        wait_until(lambda: gone(grandchild), 5, "grandchild gone")
    finally:
        sup.stop()


@pytest.mark.integration
def test_children_die_with_a_supervisor_killed_outright(tmp_path: Path) -> None:
    script = textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from workers.supervisor import ChildSpec, Supervisor
        sup = Supervisor([ChildSpec("s", {SLEEPER!r})])
        sup.start()
        while "up" not in sup.children["s"].tail:
            time.sleep(0.02)
        print("child", sup.children["s"].pid, flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([PY, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = ""
        while not line.startswith("child "):
            line = proc.stdout.readline()
            assert line, "the supervisor ended early"
        child = int(line.split()[1])
        assert not gone(child)
        proc.kill()
        wait_until(lambda: gone(child), 5, "the orphaned child to stop")
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.integration
def test_hurry_kills_what_is_left_without_waiting_out_the_timeouts(sink) -> None:
    stubborn = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                          "print('up', flush=True); time.sleep(600)"]
    sup = Supervisor([ChildSpec("s", stubborn, stop_timeout_s=60)], output=sink)
    sup.start()
    run_until(sup, lambda: "up" in sup.children["s"].tail, 10, "up")
    pid = sup.children["s"].pid
    threading.Timer(0.3, sup.hurry).start()  # a second Ctrl-C
    started = time.monotonic()
    sup.stop()
    assert time.monotonic() - started < 5 and gone(pid)


@pytest.mark.integration
def test_a_child_added_while_others_run_starts_and_a_retired_one_goes_for_good(sink) -> None:
    """What serve does when a pool is added, disabled or changed: the others never stop."""
    rec = Recorder()
    sup = Supervisor([ChildSpec("a", SLEEPER)], backoff=FAST, listener=rec, output=sink,
                     ready_after_s=0.1)
    sup.start()
    a = sup.children["a"].pid
    added = sup.add(ChildSpec("b", SLEEPER))
    run_until(sup, lambda: added.state is State.RUNNING, 10, "b running")
    with pytest.raises(ValueError):
        sup.add(ChildSpec("b", SLEEPER))  # one child per name
    b = added.pid
    assert b is not None
    sup.retire("b")
    run_until(sup, lambda: "b" not in sup.children, 10, "b dropped")
    assert gone(b) and rec.of("b", "stopped") and not rec.of("b", "exited")
    # The name is free again: the same pool re-enabled, a new process.
    again = sup.add(ChildSpec("b", SLEEPER))
    run_until(sup, lambda: again.state is State.RUNNING, 10, "b running again")
    assert again.pid != b and sup.children["a"].pid == a and sup.children["a"].alive()
    sup.stop()
    assert gone(a) and again.pid is not None and gone(again.pid)


@pytest.mark.integration
def test_a_retired_child_that_ignores_its_signal_is_killed_after_its_timeout(sink) -> None:
    stubborn = [PY, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                " print('up', flush=True); time.sleep(600)"]
    sup = Supervisor([ChildSpec("s", stubborn, stop_timeout_s=0.5)], output=sink,
                     ready_after_s=0.1)
    sup.start()
    child = sup.children["s"]
    run_until(sup, lambda: "up" in child.output(), 10, "s up")
    pid = child.pid
    started = time.monotonic()
    sup.retire("s")
    run_until(sup, lambda: "s" not in sup.children, 10, "s killed")
    assert 0.4 < time.monotonic() - started < 5 and pid is not None and gone(pid)


@pytest.mark.integration
def test_a_child_between_restarts_is_retired_at_once(sink) -> None:
    sup = Supervisor([ChildSpec("c", [PY, "-c", "raise SystemExit(3)"])],
                     backoff=Backoff(base_s=30, cap_s=30), output=sink)
    sup.start()
    child = sup.children["c"]
    run_until(sup, lambda: child.state is State.RESTARTING, 10, "c exited")
    sup.retire("c")
    sup.poll()
    assert "c" not in sup.children
