"""HumanEval grading's sandbox: a program that escapes its folder, leaves processes behind, takes too much
memory or uses the network fails alone and leaves nothing behind, and a correct solution still passes.

Each attack is top-level code after HumanEval/0's correct solution, so only the attack can make it fail. Every
test runs with the namespaces (skipped where ``unshare`` cannot make them) and without them (what grading falls
back to), and asserts what the module docstring of ``eval.grading`` promises for each.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import textwrap
import time
import uuid

import pytest

from eval import grading
from eval.benchmarks import load_benchmark
from eval.grading import humaneval_passes

TASK = load_benchmark("humaneval")[0].reference
NAMESPACES = bool(grading._namespace_prefix())


@pytest.fixture(params=[True, False], ids=["namespaces", "no_namespaces"])
def namespaces(request, monkeypatch) -> bool:
    if request.param and not NAMESPACES:
        pytest.skip("unshare cannot create user, mount, network and PID namespaces here (eval.grading logged why)")
    if not request.param:
        monkeypatch.setattr(grading, "_namespace_prefix", lambda: ())
    return request.param


def grade(attack: str = "", solution: str = TASK["canonical_solution"], **kwargs) -> bool:
    completion = f"{solution}\n{textwrap.dedent(attack)}"
    return humaneval_passes(TASK["prompt"], completion, TASK["test"], TASK["entry_point"], **kwargs)


def test_right_wrong_and_crashing_solutions(namespaces):
    assert grade()
    assert not grade(solution="    return False\n")
    assert not grade("raise SystemExit(1)")


def test_the_program_runs_in_a_private_folder_that_is_removed(namespaces, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert grade("""
        import os
        assert os.getcwd() == os.environ["HOME"] == os.environ["TMPDIR"]
        assert os.path.basename(os.getcwd()).startswith("ppd-grading-")
        open("scratch.txt", "w").write("mine")
        """)
    assert os.listdir(tmp_path) == []


def test_writes_outside_the_private_folder_land_only_without_namespaces(namespaces, tmp_path):
    target = tmp_path / "escaped.txt"
    attack = f"""
        import subprocess
        for command in (["mount", "-o", "remount,bind,rw", "/"], ["unshare", "-rm", "mount", "-o", "remount,rw", "/"]):
            try:  # with the namespaces: not permitted (no capabilities, no id to make a namespace with)
                subprocess.run(command, stderr=subprocess.DEVNULL)
            except OSError:
                pass
        open({str(target)!r}, "w").write("escaped")
        """
    assert grade(attack) is not namespaces
    assert target.exists() is not namespaces


def _living(marker: str) -> list[int]:
    """Processes with ``marker`` on their command line, after giving SIGKILL a second to land."""
    deadline = time.monotonic() + 1.0
    while True:
        living = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if marker.encode() in handle.read():  # a zombie's is empty
                        living.append(int(pid))
            except OSError:
                pass
        if not living or time.monotonic() > deadline:
            return living
        time.sleep(0.05)


@pytest.mark.parametrize("ending", ["exit", "timeout"])
@pytest.mark.parametrize("new_session", [False, True], ids=["child", "setsid_child"])
def test_processes_the_program_started_die_with_it(namespaces, ending, new_session):
    if new_session and not namespaces:
        pytest.skip("without a PID namespace a child that calls setsid() leaves the group (documented)")
    marker = f"ppd-grading-test-{uuid.uuid4().hex}"
    # The child says it is alive in the private folder, then would live 30 s; it holds the program's stdout.
    child = "import sys, time; open('alive', 'w').close(); time.sleep(30)"
    attack = f"""
        import os, subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", {child!r}, {marker!r}], start_new_session={new_session})
        for _ in range(200):
            if os.path.exists("alive"):
                break
            time.sleep(0.05)
        else:
            raise SystemExit("the child never started")
        {"time.sleep(60)" if ending == "timeout" else ""}
        """
    started = time.monotonic()
    passed = grade(attack, timeout_s=2.0 if ending == "timeout" else 20.0)
    took = time.monotonic() - started
    try:
        assert _living(marker) == []
    finally:
        for pid in _living(marker):
            os.kill(pid, 9)
    # A program that exited counts at once, though its child lives on with its stdout (it used to time out).
    assert passed is (ending == "exit") and took < 10.0


def test_too_much_memory_fails_that_program_only(namespaces):
    attack = "_ = bytes({} << 20)"  # calloc: the pages are never touched, so an unlimited run costs nothing
    assert grade(attack.format(1024))
    assert not grade(attack.format(1024), memory_mb=512)
    assert not grade(attack.format(4096))


def test_network_only_without_namespaces(namespaces):
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        port = server.getsockname()[1]
        assert grade(f"""
            import socket
            socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
            """) is not namespaces
        try:
            server.accept()[0].close()
            connected = True
        except BlockingIOError:
            connected = False
    assert connected is not namespaces


def test_without_unshare_grading_warns_once_and_runs_without_namespaces(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no `unshare` on it
    with caplog.at_level(logging.WARNING, logger="eval.grading"):
        assert grading._probe_namespaces.__wrapped__() == ()
    assert "`unshare` program (util-linux) is not on PATH" in caplog.text
    assert "write wherever this user can" in caplog.text
