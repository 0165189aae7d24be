"""The ``lmcache`` command line on real data: a disk directory written by the disk tier,
a real redis-server, a real lookup server, the real benchmark script; error exits too."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmcache.cli import main
from lmcache.integration.vllm.lookup_service import LookupServer
from lmcache.observability.snapshot import engine_snapshot
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

REPO = Path(__file__).resolve().parents[2]
SPEC = KVSpec(num_layers=2, num_heads=2, head_size=8, num_blocks=64, block_size=16)
CHUNK = 16
TOKENS = 5 * CHUNK


def _store(config: dict, model_name: str = "cli-model") -> dict:
    """Store TOKENS tokens through a real engine with ``config``; its snapshot after a flush."""
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05, **config})
    engine = make_engine(SPEC, cfg, model_name=model_name)
    try:
        kv = random_kv_caches(SPEC)
        engine.store(list(range(TOKENS)), kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS))
        assert engine.storage_manager.flush(30)
        return engine_snapshot(engine)
    finally:
        engine.close()


@pytest.fixture
def disk_dir(tmp_path) -> Path:
    root = tmp_path / "cache"
    snap = _store({"local_disk": str(root), "max_local_disk_size": 0.01})
    assert snap["disk_writes_completed"] == TOKENS // CHUNK
    return root


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ------------------------------------------------------------------------ help
def test_python_dash_m_and_help_on_every_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    top = subprocess.run([sys.executable, "-m", "lmcache", "--help"], capture_output=True, text=True, env=env)
    assert top.returncode == 0 and "config" in top.stdout and "bench" in top.stdout
    for cmd in (["config", "check"], ["disk", "inspect"], ["disk", "verify"], ["remote", "ping"], ["stats"], ["bench"],
                ["proxy"]):
        res = subprocess.run([sys.executable, "-m", "lmcache", *cmd, "--help"], capture_output=True, text=True, env=env)
        assert res.returncode == 0 and "usage: lmcache" in res.stdout, cmd
    bad = subprocess.run([sys.executable, "-m", "lmcache", "nope"], capture_output=True, text=True, env=env)
    assert bad.returncode == 2


# ------------------------------------------------------------------------ config check
def test_config_check_prints_effective_config_with_secrets_masked(capsys, tmp_path, monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 128\nremote_url: redis://user:hunter2@127.0.0.1:6379\nremote_password: s3cret\n")
    monkeypatch.setenv("LMCACHE_MAX_LOCAL_CPU_SIZE", "2")
    rc, out, _ = run(capsys, "config", "check", str(path))
    assert rc == 0
    assert "chunk_size: 128" in out and "max_local_cpu_size: 2.0" in out
    assert "hunter2" not in out and "s3cret" not in out and "redis://user:***@127.0.0.1:6379" in out
    assert "LMCACHE_CONFIG_FILE" not in os.environ  # the command left the caller's environment alone


def test_config_check_bad_file_value_exits_2_naming_file_key_value_expectation(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("chunk_size: lots\n")
    rc, out, err = run(capsys, "config", "check", str(path))
    assert rc == 2 and out == ""
    assert str(path) in err and "chunk_size='lots'" in err and "expected an integer" in err


def test_config_check_bad_env_value_names_the_variable(capsys, monkeypatch):
    monkeypatch.delenv("LMCACHE_CONFIG_FILE", raising=False)
    monkeypatch.setenv("LMCACHE_LOCAL_CPU", "maybe")
    rc, _, err = run(capsys, "config", "check")
    assert rc == 2 and "LMCACHE_LOCAL_CPU" in err and "expected a boolean" in err


def test_config_check_cross_field_error_and_unreadable_file(capsys, tmp_path):
    path = tmp_path / "disk.yaml"
    path.write_text("local_disk: /tmp/x\n")
    rc, _, err = run(capsys, "config", "check", str(path))
    assert rc == 2 and str(path) in err and "max_local_disk_size=0.0" in err
    rc, _, err = run(capsys, "config", "check", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "cannot read the file" in err


# ------------------------------------------------------------------------ disk
def test_disk_inspect_counts_entries_bytes_and_namespaces(capsys, disk_dir):
    rc, out, _ = run(capsys, "disk", "inspect", str(disk_dir), "--json")
    assert rc == 0
    report = json.loads(out)
    (ns,) = report["namespaces"]
    assert ns["cache"] == "kv" and ns["model"] == "cli-model" and ns["layout"] == "KV_2LTD"
    assert ns["entries"] == TOKENS // CHUNK
    files = list((disk_dir / "kv").glob("*.lmc"))
    assert ns["bytes"] == sum(f.stat().st_size for f in files)
    rc, text, _ = run(capsys, "disk", "inspect", str(disk_dir / "kv"))
    assert rc == 0 and f"{TOKENS // CHUNK} entries" in text and "model=cli-model" in text


def test_disk_verify_finds_and_deletes_corrupt_entries(capsys, disk_dir, monkeypatch):
    rc, out, _ = run(capsys, "disk", "verify", str(disk_dir))
    assert rc == 0 and f"{TOKENS // CHUNK} good, 0 corrupt" in out
    victim = sorted((disk_dir / "kv").glob("*.lmc"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF  # one payload bit flipped
    victim.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "disk", "verify", str(disk_dir))
    assert rc == 1 and f"CORRUPT {victim}" in out and "1 corrupt, 0 deleted" in out and victim.exists()
    monkeypatch.setenv("LMCACHE_PROGRESS", "1")
    rc, out, err = run(capsys, "disk", "verify", str(disk_dir), "--delete-corrupt")
    assert rc == 1 and "1 corrupt, 1 deleted" in out and not victim.exists()
    assert f"{TOKENS // CHUNK}/{TOKENS // CHUNK} entries verified" in err  # the progress bar
    rc, out, _ = run(capsys, "disk", "verify", str(disk_dir))
    assert rc == 0 and f"{TOKENS // CHUNK - 1} good, 0 corrupt" in out


def test_disk_commands_reject_a_missing_directory(capsys, tmp_path):
    for cmd in ("inspect", "verify"):
        rc, _, err = run(capsys, "disk", cmd, str(tmp_path / "nope"))
        assert rc == 2 and "is not a directory" in err


# ------------------------------------------------------------------------ remote
def test_remote_ping_reports_latency_and_our_entries(capsys, redis_server):  # noqa: F811
    snap = _store({"remote_url": redis_server.url})
    assert snap["remote_writes_completed"] == TOKENS // CHUNK
    redis_server.client().set("someone-else:key", b"x" * 10)  # not ours: not counted
    rc, out, _ = run(capsys, "remote", "ping", redis_server.url, "--json")
    assert rc == 0
    report = json.loads(out)
    assert report["entries"] == TOKENS // CHUNK
    assert report["bytes"] == snap["remote_bytes_written"]
    assert 0 <= report["rtt_ms"]["min"] <= report["rtt_ms"]["median"] <= report["rtt_ms"]["max"]
    rc, out, _ = run(capsys, "remote", "ping", redis_server.url)
    assert rc == 0 and "reachable" in out and f"{TOKENS // CHUNK} lmcache entries" in out


def test_remote_ping_unreachable_and_malformed(capsys, redis_server):  # noqa: F811
    port = redis_server.port
    redis_server.stop()
    rc, out, _ = run(capsys, "remote", "ping", f"redis://user:pw@127.0.0.1:{port}", "--timeout", "0.5")
    assert rc == 1 and "UNREACHABLE" in out and "pw@" not in out
    rc, _, err = run(capsys, "remote", "ping", "localhost:6379")
    assert rc == 2 and "remote_url" in err


# ------------------------------------------------------------------------ stats
def test_stats_reads_a_running_lookup_server(capsys, tmp_path):
    cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 0.05})
    engine = make_engine(SPEC, cfg)
    sock_dir = tmp_path / "socks"
    server = LookupServer(str(sock_dir / "lookup-0123abcd-r0.sock"), lambda t, e: engine.lookup(t), lambda: engine_snapshot(engine))
    try:
        kv = random_kv_caches(SPEC)
        tokens = list(range(TOKENS))
        engine.store(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS))
        engine.retrieve(tokens, kvcaches=kv, slot_mapping=random_slot_mapping(SPEC, TOKENS, seed=1))
        rc, out, _ = run(capsys, "stats", "--socket-dir", str(sock_dir), "--json")
        assert rc == 0
        stats = json.loads(out)["0123abcd"]
        assert stats["hit_tokens_cpu"] == TOKENS and stats["stored_tokens"] == TOKENS
        assert stats == {**engine_snapshot(engine), "workers": 1, "workers_answering": 1}
        rc, out, _ = run(capsys, "stats", "--socket-dir", str(sock_dir))
        assert rc == 0 and "1/1 workers answering" in out and "cpu" in out
    finally:
        server.close()
        engine.close()
    rc, _, err = run(capsys, "stats", "--socket-dir", str(sock_dir))
    assert rc == 1 and "no lookup sockets" in err


# ------------------------------------------------------------------------ bench
@pytest.mark.slow
def test_bench_cpu_runs_the_benchmark_table():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    res = subprocess.run(
        [sys.executable, "-m", "lmcache", "bench", "cpu", "--", "--tokens", "256", "--reps", "1", "--layouts", "vllm_cpu", "--copies-only"],
        capture_output=True, text=True, env=env, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "st/mc" in res.stdout and "vllm_cpu" in res.stdout
    assert "lmcache bench cpu [1/1]" in res.stderr


def test_bench_without_benchmarks_exits_2(capsys, tmp_path):
    rc, _, err = run(capsys, "bench", "--benchmarks-dir", str(tmp_path), "cpu")
    assert rc == 2 and "benchmarks not found" in err


def _installed_copy(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """The ``lmcache`` package alone (no benchmarks/, tests/ or csrc/ beside it), as pip installs
    it, first on PYTHONPATH; and an empty working directory. Returns (env, cwd)."""
    import shutil

    site = tmp_path / "site"
    shutil.copytree(REPO / "lmcache", site / "lmcache", ignore=shutil.ignore_patterns("__pycache__"))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    return dict(os.environ, PYTHONPATH=str(site)), cwd


@pytest.mark.slow
def test_bench_cpu_runs_from_an_installed_package(tmp_path):
    env, cwd = _installed_copy(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "lmcache", "bench", "cpu", "--", "--tokens", "256", "--reps", "1", "--layouts",
         "flash_attn", "--block-sizes", "16", "--copies-only"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "st/mc" in res.stdout and "flash_attn" in res.stdout
    assert "lmcache bench cpu [1/1]: lmcache.bench.cpu_tier" in res.stderr


@pytest.mark.slow
def test_bench_remote_runs_from_an_installed_package(tmp_path):
    import shutil

    pytest.importorskip("redis")
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    env, cwd = _installed_copy(tmp_path)
    res = subprocess.run(
        [sys.executable, "-m", "lmcache", "bench", "remote", "--", "--sizes-mib", "1", "--total-mib", "8", "--reps", "1"],
        capture_output=True, text=True, env=env, cwd=cwd, timeout=600,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    assert "tier/raw" in res.stdout and "1MiB | put" in res.stdout and "1MiB | get" in res.stdout


def test_bench_remote_says_what_it_needs(capsys, monkeypatch):
    pytest.importorskip("redis")
    from lmcache.cli import bench_cmd

    monkeypatch.setattr(bench_cmd.shutil, "which", lambda name: None)
    rc, _, err = run(capsys, "bench", "remote")
    assert rc == 2 and "needs redis-server on PATH" in err and "--url" in err
    assert bench_cmd.missing_requirement("remote", ["--url", "redis://127.0.0.1:1"]) is None  # no local binary needed
