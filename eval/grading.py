"""Answer quality: HumanEval programs run against their tests, and GSM8K final answers.

HumanEval follows the official harness's recipe: prompt + completion + the task's tests + a call of
``check(entry_point)``, run as its own Python process with a time limit (an infinite loop or a crash fails
that one task, nothing else). The program is untrusted, so ``run_confined`` runs it:

- always: in its own session and process group, killed whole when the time is up and after a normal exit
  too; with limits on address space (``memory_mb``), CPU seconds (the time limit + 1) and file size
  (64 MiB), no core dumps; in a private temporary folder (working directory, HOME and TMPDIR) deleted
  afterwards; with no stdin, its output thrown away, and only PATH, PYTHONHASHSEED, HOME and TMPDIR set.
- where ``unshare`` (util-linux) can create user, mount, network and PID namespaces (tried once per
  process; otherwise a warning says what failed): without network (its own network namespace, whose
  loopback is down); with every mount read-only except the private folder, locked by a second user
  namespace that maps no id (the program has no capabilities: it cannot remount or make namespaces); in
  its own PID namespace with its own /proc, so it sees no other process and everything it starts dies
  with it, setsid() or not; at most 64 processes (a limit the kernel does not apply to the real root).

It can still read whatever the grading user can read, connect to Unix sockets whose files it can reach,
and use every core and ``memory_mb`` per process until the time limit. Without the namespaces it can also
write wherever the grading user can, use the network, and leave behind a process that called setsid().
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

logger = logging.getLogger(__name__)

STOP_SEQUENCES = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")
MEMORY_MB = 2048  # address space of one graded process; HumanEval's solutions need a few tens of MB
_NAMESPACES = ("--user", "--map-root-user", "--mount", "--net", "--pid", "--fork", "--kill-child", "--mount-proc")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_PROBE_LOCK = threading.Lock()

# The sandbox's inside, a program of its own: `python -I -S -B -c _INSIDE FOLDER CPU_S MEMORY_BYTES NAMESPACES`.
# Inside the namespaces it remounts everything read-only except FOLDER, then enters a user namespace that maps
# no id (which locks the mounts and makes exec drop every capability); it sets the limits and runs task.py as
# its child. There it is the PID namespace's init: when it exits, the kernel kills every process left. It is
# kept apart from this module and runs without site so that it starts in tens of milliseconds, not hundreds:
# it runs once per graded program. (ctypes, as Python 3.11 has no os.mount or os.unshare.)
_INSIDE = r"""
import os, resource, sys

folder, cpu_s, memory_bytes, namespaces = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
if namespaces:
    import ctypes

    MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x1, 0x20, 0x1000, 0x4000, 0x40000
    # (statvfs ST_*, mount MS_*): flags a remount must repeat, as a user namespace may not clear them.
    KEPT = ((0x2, 0x2), (0x4, 0x4), (0x8, 0x8), (0x400, 0x400), (0x800, 0x800), (0x1000, 0x200000))
    CLONE_NEWNS, CLONE_NEWUSER = 0x20000, 0x10000000
    libc = ctypes.CDLL(None, use_errno=True)

    def check(result, what):
        if result != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"{what}: {os.strerror(error)}")

    def mount(source, target, flags):
        check(libc.mount(source, target, None, ctypes.c_ulong(flags), None), f"mount {os.fsdecode(target)}")

    def unescape(field):  # mountinfo writes a space, tab, newline or backslash as \ and 3 octal digits
        head, *rest = field.split(b"\\")
        return head + b"".join(bytes([int(part[:3], 8)]) + part[3:] for part in rest)

    mount(None, b"/", MS_REC | MS_PRIVATE)
    mount(os.fsencode(folder), os.fsencode(folder), MS_BIND | MS_REC)
    with open("/proc/self/mountinfo", "rb") as handle:
        targets = [unescape(line.split()[4]) for line in handle]
    for target in targets:
        if target == os.fsencode(folder):
            continue
        try:
            have = os.statvfs(target).f_flag
        except OSError:  # out of this process's reach, so out of the program's too
            continue
        kept = sum(ms for st, ms in KEPT if have & st)
        mount(None, target, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)
    check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS), "unshare")

limits = {resource.RLIMIT_AS: memory_bytes, resource.RLIMIT_CPU: cpu_s, resource.RLIMIT_FSIZE: 64 << 20,
          resource.RLIMIT_CORE: 0}
if namespaces:  # counted per user and user namespace: outside one it would count all the user's processes
    limits[resource.RLIMIT_NPROC] = 64
for kind, value in limits.items():
    hard = resource.getrlimit(kind)[1]
    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
    resource.setrlimit(kind, (value, value))

env = {"PATH": os.environ.get("PATH", os.defpath), "PYTHONHASHSEED": "0", "HOME": folder, "TMPDIR": folder}
pid = os.fork()
if pid == 0:
    try:
        os.chdir(folder)
        nothing = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(nothing, fd)
        os.execve(sys.executable, [sys.executable, "-s", "-B", "task.py"], env)
    finally:
        os._exit(127)
status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
sys.exit(status if status >= 0 else 128 - status)
"""


def humaneval_completion(text: str) -> str:
    """The function body of a raw completion: cut at the first top-level statement after it."""
    cut = min((i for i in (text.find(s) for s in STOP_SEQUENCES) if i >= 0), default=len(text))
    return text[:cut]


def humaneval_passes(prompt: str, completion: str, test: str, entry_point: str, timeout_s: float = 10.0,
                     memory_mb: int = MEMORY_MB) -> bool:
    """Whether ``prompt + completion`` passes the task's tests within ``timeout_s`` seconds, run confined."""
    program = f"{prompt}{completion}\n\n{test}\n\ncheck({entry_point})\n"
    return run_confined(program, timeout_s, memory_mb) == 0


def run_confined(source: str, timeout_s: float, memory_mb: int = MEMORY_MB, namespaces: bool = True) -> int | None:
    """Exit status of the Python program ``source`` run confined (see the module docstring); None on timeout.

    ``namespaces=False`` leaves out the namespaces even where they work (what grading falls back to).
    """
    return _run(source, timeout_s, memory_mb, _namespace_prefix() if namespaces else ())[0]


def _run(source: str, timeout_s: float, memory_mb: int, prefix: tuple[str, ...]) -> tuple[int | None, str]:
    """(exit status or None on timeout, what the confining wrapper wrote to stderr)."""
    with tempfile.TemporaryDirectory(prefix="ppd-grading-") as folder, tempfile.TemporaryFile() as log:
        folder = os.path.realpath(folder)
        with open(os.path.join(folder, "task.py"), "w", encoding="utf-8") as handle:
            handle.write(source)
        command = [*prefix, sys.executable, "-I", "-S", "-B", "-c", _INSIDE, folder,
                   str(math.ceil(timeout_s) + 1), str(memory_mb << 20), "1" if prefix else "0"]
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=log,
                                   env={"PATH": os.environ.get("PATH", os.defpath)}, start_new_session=True)
        try:
            finished = _exits_within(process, timeout_s)
        finally:
            # The whole group, after a normal exit too: what the program started dies with it. While a member
            # lives (the unreaped leader too), no new process gets the group's id, so this cannot hit a stranger.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        log.seek(0)
        return (process.returncode if finished else None), log.read().decode(errors="replace")


def _exits_within(process: subprocess.Popen, timeout_s: float) -> bool:
    """Whether ``process`` exits within ``timeout_s``. On Linux it waits on a pidfd: no polling delay, and the
    process is left for the caller to reap."""
    try:
        pidfd = os.pidfd_open(process.pid)
    except (AttributeError, OSError):
        try:
            process.wait(timeout_s)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        return bool(poller.poll(max(timeout_s, 0.0) * 1000))
    finally:
        os.close(pidfd)


def _namespace_prefix() -> tuple[str, ...]:
    with _PROBE_LOCK:
        return _probe_namespaces()


@functools.cache
def _probe_namespaces() -> tuple[str, ...]:
    """The ``unshare`` command line when it confines an empty program here, else () after a warning."""
    unshare = shutil.which("unshare")
    if unshare is None:
        problem = "the `unshare` program (util-linux) is not on PATH"
    else:
        prefix = (unshare, *_NAMESPACES)
        status, log = _run("", 30.0, MEMORY_MB, prefix)
        if status == 0:
            return prefix
        said = log.strip().splitlines()[-1:] or [f"exit status {status}"]
        problem = f"`{' '.join(prefix)} python` failed here ({said[0]})"
    logger.warning("HumanEval grading runs without namespaces: %s. Programs keep their process group, limits and "
                   "private folder, but can write wherever this user can, use the network, and leave behind a "
                   "process that called setsid().", problem)
    return ()


def gsm8k_reference(answer: str) -> str:
    """The number after ``####`` in a GSM8K reference answer, without thousands separators."""
    return answer.split("####")[-1].strip().replace(",", "")


def gsm8k_prediction(text: str) -> str | None:
    """The model's final number: after '####' or 'answer is' when present, else the last number."""
    for marker in ("####", "answer is", "Answer:"):
        if marker in text:
            found = _NUMBER.findall(text.split(marker)[-1])
            if found:
                return _normalise(found[0])
    found = _NUMBER.findall(text)
    return _normalise(found[-1]) if found else None


def _normalise(number: str) -> str:
    number = number.replace(",", "")
    if "." in number:
        number = number.rstrip("0").rstrip(".")
    return number


def gsm8k_correct(text: str, answer: str) -> bool:
    return gsm8k_prediction(text) == _normalise(gsm8k_reference(answer))

