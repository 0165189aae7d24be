"""Start vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``) for tests and benchmarks.

The server runs under vLLM's default multiprocessing (API server, engine core and
worker are separate processes), in a session of its own so that every process it
starts is ended by :meth:`OpenAIServer.stop`. Its output goes to a log file the tests
read (``[lmcache]`` lines come from the worker process).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import forkserver
from harness.vllm_utils import REPO_ROOT

DYNAMIC = {
    "kv_connector": "LMCacheConnectorV1Dynamic",
    "kv_connector_module_path": "lmcache.integration.vllm.lmcache_connector_v1",
    "kv_role": "kv_both",
}
BUILTIN = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}


def short_socket_dir(tag: str) -> Path:
    """A new directory for a server's lookup sockets directly under the system temp dir,
    removed when this process exits: pytest's per-test paths (longer under pytest-xdist)
    can exceed what a Unix socket path allows (107 bytes)."""
    path = Path(tempfile.mkdtemp(prefix=f"lmc-{tag}-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class OpenAIServer:
    model: str
    kv_transfer_config: dict[str, Any] | None
    """None: a plain vLLM server, no KV connector."""
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | forkserver.ForkedProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 420.0) -> OpenAIServer:
        """Launch the server and wait until it is healthy."""
        return self.launch().wait_ready(timeout)

    def launch(self) -> OpenAIServer:
        """Start the server process without waiting (several servers then start at once)."""
        env = dict(os.environ)
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
            }
        )
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vLLM's default: multiprocessing on
        env.update(self.env)
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model, "--dtype", "float32", "--enforce-eager",
            "--max-model-len", "1024", "--block-size", "32", "--max-num-batched-tokens", "256",
            "--no-enable-prefix-caching", "--enable-prompt-tokens-details",
            "--host", "127.0.0.1", "--port", str(self.port),
            *(["--kv-transfer-config", json.dumps(self.kv_transfer_config)] if self.kv_transfer_config else []),
            *self.extra_args,
        ]  # fmt: skip
        self.log_path.write_text("")
        self.proc = forkserver.popen(cmd, env=env, cwd=str(REPO_ROOT), log_path=self.log_path)
        return self

    def wait_ready(self, timeout: float = 420.0) -> OpenAIServer:
        """Wait until the launched server answers ``/health`` (raises with its log if it exits)."""
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                self.stop()
                raise RuntimeError(f"vLLM server exited (rc={rc}):\n{self.log()[-12000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(1.0)  # polling the server's health endpoint while it starts
        self.stop()
        raise RuntimeError(f"vLLM server did not become healthy in {timeout}s:\n{self.log()[-12000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def print_log_tail(self, what: str, chars: int = 6000) -> None:
        """Print the last ``chars`` characters of the server's log after ``what`` failed (benchmarks)."""
        print(f"  [{what}] failed; server log tail:\n{self.log()[-chars:]}", flush=True)

    def metrics(self) -> str:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=30)
            except (ProcessLookupError, PermissionError):
                pass
            except subprocess.TimeoutExpired:
                pass
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc = None


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total
