"""The test harness's fork server (harness/forkserver.py): a forked child behaves like a
fresh ``python`` process (argv, environment, working directory, exit code, its own
session and log file), and the client sees ``subprocess.Popen``'s contract."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from harness.forkserver import ForkServer, _server_env

pytestmark = pytest.mark.slow  # child processes


@pytest.fixture(scope="module")
def server():
    srv = ForkServer(_server_env(), preload=("json",))
    yield srv
    srv.close()


def spawn(server: ForkServer, tmp_path: Path, argv: list[str], **env: str):
    log = tmp_path / "log.txt"
    child = server.spawn([sys.executable, *argv], {**os.environ, **env}, str(tmp_path), str(log))
    assert child is not None and child.pid > 0
    return child, log


def test_code_sees_its_own_argv_env_cwd_and_exit_code(server, tmp_path):
    code = "import os, sys; print(sys.argv[1:], os.environ['PROBE'], os.getcwd()); sys.exit(3)"
    child, log = spawn(server, tmp_path, ["-c", code, "a", "b"], PROBE="x1")
    assert child.wait(timeout=60) == 3 and child.poll() == 3
    assert log.read_text().strip() == f"['a', 'b'] x1 {tmp_path}"


def test_script_and_module_run_as_main(server, tmp_path):
    (tmp_path / "prog.py").write_text("import sys\nif __name__ == '__main__':\n    print('script', sys.argv)\n")
    child, log = spawn(server, tmp_path, [str(tmp_path / "prog.py"), "--flag"])
    assert child.wait(timeout=60) == 0
    assert log.read_text().strip() == f"script [{str(tmp_path / 'prog.py')!r}, '--flag']"
    (tmp_path / "log.txt").unlink()
    (tmp_path / "in.json").write_text('{"k": 1}')
    child, log = spawn(server, tmp_path, ["-m", "json.tool", str(tmp_path / "in.json")])
    assert child.wait(timeout=60) == 0 and '"k": 1' in log.read_text()


def test_uncaught_exception_is_rc_1_with_traceback(server, tmp_path):
    child, log = spawn(server, tmp_path, ["-c", "raise KeyError('boom')"])
    assert child.wait(timeout=60) == 1
    assert "KeyError: 'boom'" in log.read_text()


def test_child_leads_its_own_session_and_can_be_killed(server, tmp_path):
    child, _ = spawn(server, tmp_path, ["-c", "import os, time; print(os.getsid(0)); time.sleep(600)"])
    with pytest.raises(subprocess.TimeoutExpired):
        child.wait(timeout=0.2)
    assert os.getsid(child.pid) == child.pid
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL


def test_children_run_concurrently(server, tmp_path):
    """Two children at once (PD tests start a prefiller and a decoder together)."""
    fifo = tmp_path / "gate"
    os.mkfifo(fifo)
    reader, _ = spawn(server, tmp_path, ["-c", f"print(open({str(fifo)!r}).read())"])
    writer, _ = spawn(server, tmp_path, ["-c", f"open({str(fifo)!r}, 'w').write('hi')"])
    assert writer.wait(timeout=60) == 0 and reader.wait(timeout=60) == 0


def test_a_dead_server_ends_its_waiters(tmp_path):
    srv = ForkServer(_server_env(), preload=())
    child, _ = spawn(srv, tmp_path, ["-c", "import time; time.sleep(600)"])
    done = threading.Event()
    threading.Thread(target=lambda: (child.wait(), done.set()), daemon=True).start()
    srv._proc.kill()
    assert done.wait(60) and child.returncode == -1
    os.killpg(child.pid, signal.SIGKILL)
    assert srv.spawn([sys.executable, "-c", "pass"], dict(os.environ), str(tmp_path), str(tmp_path / "l")) is None


def test_interpreter_start_variables_get_a_fresh_interpreter(monkeypatch):
    from harness.forkserver import _enabled

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    monkeypatch.delenv("LMCACHE_TEST_FORKSERVER", raising=False)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    assert _enabled(argv, dict(os.environ))
    assert not _enabled(argv, {**os.environ, "PYTHONHASHSEED": "3"})  # read when the interpreter starts
    assert not _enabled(["/usr/bin/env", "python"], dict(os.environ))
    monkeypatch.setenv("LMCACHE_TEST_FORKSERVER", "0")
    assert not _enabled(argv, dict(os.environ))


def test_import_time_variables_get_a_fork_server_of_their_own(tmp_path, monkeypatch):
    """prometheus_client picks its multiprocess mode when it is imported (by vLLM, preloaded):
    a child with ``PROMETHEUS_MULTIPROC_DIR`` is forked from a server that imported it so."""
    from harness import forkserver

    servers: dict = {}
    monkeypatch.setattr(forkserver, "_servers", servers)
    monkeypatch.setattr(forkserver, "ForkServer", lambda env: ForkServer(env, preload=("prometheus_client",)))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("LMCACHE_TEST_FORKSERVER", raising=False)
    code = "import sys; from prometheus_client import values; print(values.ValueClass.__name__, 'prometheus_client' in sys.modules)"
    try:
        plain = forkserver.run([sys.executable, "-c", code], env=dict(os.environ), cwd=tmp_path, timeout=120)
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(tmp_path)}
        multi = forkserver.run([sys.executable, "-c", code], env=env, cwd=tmp_path, timeout=120)
    finally:
        for srv in servers.values():
            srv.close()
    assert len(servers) == 2
    assert plain.returncode == 0 and multi.returncode == 0, (plain.stdout, multi.stdout)
    assert plain.stdout.split()[-2:] == ["MutexValue", "True"] and multi.stdout.split()[-2:] == ["MmapedValue", "True"]
