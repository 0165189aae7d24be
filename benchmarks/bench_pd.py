"""Disaggregated prefill/decode against one server, on the project's real model.

Starts a ``redis-server``, a plain vLLM server (no connector: the single-server
baseline), a prefiller and a decoder (our connector, ``kv_producer`` / ``kv_consumer``,
``enable_pd``) and ``lmcache proxy`` in front of the pair.
For each prompt size (``--prompt-tokens``, default 1k and 4k tokens of real text, a
distinct prompt per measurement so no cache helps) it measures, streamed, greedy:

* ``single``: TTFT of the plain server (the machine's own limit for this prompt);
* ``prefill leg``: the prefiller's answer to the ``max_tokens`` 1 request (prefill, store,
  writes durable in Redis);
* ``decoder TTFT``: the decoder's time to first token once the prefill leg has answered
  (lookup, load from Redis, one token computed);
* ``two legs``: prefill leg + decoder TTFT, sent by this script as a proxy would;
* ``proxy``: TTFT through ``lmcache proxy`` (both legs and its own overhead).

Prints the medians and the ratios against ``single`` measured in the same run. The
decoder's TTFT is what a decode instance's users see on top of a prefill farm; the end-to-end
figures show what disaggregation costs one request on one machine (where prefiller and
decoder share the same cores, so nothing runs in parallel).

    .venv/bin/python benchmarks/bench_pd.py                       # 1k and 4k tokens, 3 prompts each
    .venv/bin/python benchmarks/bench_pd.py --prompt-tokens 1000 --reps 2 --json pd.json
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from harness.openai_server import DYNAMIC, OpenAIServer, free_port  # noqa: E402
from harness.real_model import APACHE_TEXT, RealModelUnavailable, real_model_dir  # noqa: E402
from lmcache.pd import signing  # noqa: E402
from lmcache.v1.testing_redis import RedisServer, RedisUnavailable  # noqa: E402

SEND = {"do_remote_decode": True, "do_remote_prefill": False}
SECRET = secrets.token_urlsafe(32)
"""The run's pd_secret: the servers and the proxy get it through LMCACHE_PD_SECRET."""


def corpus() -> str:
    parts = [APACHE_TEXT.read_text()] + [p.read_text() for p in sorted((REPO / "docs").glob("*.md"))]
    return "\n\n".join(parts)


def make_prompts(model_dir: Path, sizes: list[int], reps: int) -> dict[int, list[str]]:
    """``reps`` distinct prompts of about each size: real text from different offsets."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(corpus(), add_special_tokens=False)["input_ids"]
    out: dict[int, list[str]] = {}
    for n in sizes:
        if n + 3 * reps * 97 > len(ids):
            raise SystemExit(f"--prompt-tokens {n}: the corpus has only {len(ids)} tokens")
        out[n] = [f"Request {n}-{r}. " + tok.decode(ids[r * 97 * 3 : r * 97 * 3 + n]) for r in range(3 * reps)]
    return out


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def first_token_seconds(url: str, body: dict[str, Any]) -> float:
    """Seconds from sending a streamed completion to its first non-empty text chunk."""
    req = urllib.request.Request(url, json.dumps(dict(body, stream=True)).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first = None
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if first is None and line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("text"):
                first = time.perf_counter() - t0
    assert first is not None, "no text came back"
    return first


def start_servers(model_dir: Path, redis_url: str, workdir: Path, args: argparse.Namespace) -> dict[str, OpenAIServer]:
    extra = ["--max-model-len", str(max(args.prompt_tokens) + 256), "--served-model-name", "m",
             "--max-num-batched-tokens", "512"]  # fmt: skip
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", signing.SECRET_ENV: SECRET}
    servers = {"single": OpenAIServer(str(model_dir), None, workdir / "single.log", env=env, extra_args=extra)}
    for name, role in (("prefiller", "kv_producer"), ("decoder", "kv_consumer")):
        cfg = workdir / f"{name}.yaml"
        cfg.write_text(f"chunk_size: 256\nmax_local_cpu_size: 1\nremote_url: {redis_url}\nenable_pd: true\n"
                       "pd_wait_timeout: 10\nlog_summary_interval: 0\n")  # fmt: skip
        servers[name] = OpenAIServer(str(model_dir), dict(DYNAMIC, kv_role=role), workdir / f"{name}.log",
                                     env=dict(env, LMCACHE_CONFIG_FILE=str(cfg)), extra_args=extra)  # fmt: skip
    for server in servers.values():  # one at a time: three starts at once starve two cores
        server.start(args.start_timeout)
    return servers


def start_proxy(servers: dict[str, OpenAIServer], workdir: Path) -> tuple[subprocess.Popen, str] | None:
    port = free_port()
    log = open(workdir / "proxy.log", "w")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen([sys.executable, "-m", "lmcache", "proxy", "--prefill", servers["prefiller"].url,
                             "--decode", servers["decoder"].url, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO),
                            env=dict(os.environ, **{signing.SECRET_ENV: SECRET}))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)  # polling the proxy's health endpoint while it starts
    proc.kill()
    print("lmcache proxy did not become healthy: the proxy column is skipped")
    return None


def measure(servers: dict[str, OpenAIServer], proxy_url: str | None, prompts: list[str], reps: int,
            max_tokens: int) -> dict[str, list[float]]:  # fmt: skip
    res: dict[str, list[float]] = {"single": [], "prefill leg": [], "decoder TTFT": [], "two legs": [], "proxy": []}
    path = "/v1/completions"
    for r in range(reps):
        single, pd, via_proxy = prompts[3 * r : 3 * r + 3]
        body = {"model": "m", "max_tokens": max_tokens, "temperature": 0}
        res["single"].append(first_token_seconds(servers["single"].url + path, dict(body, prompt=single)))
        t0 = time.perf_counter()
        params = post(servers["prefiller"].url + path,
                      dict(body, prompt=pd, max_tokens=1, kv_transfer_params=SEND))["kv_transfer_params"]  # fmt: skip
        leg = time.perf_counter() - t0
        params = signing.sign(params, SECRET, now=time.time())  # as the proxy does
        ttft = first_token_seconds(servers["decoder"].url + path, dict(body, prompt=pd, kv_transfer_params=params))
        res["prefill leg"].append(leg)
        res["decoder TTFT"].append(ttft)
        res["two legs"].append(leg + ttft)
        if proxy_url is not None:
            res["proxy"].append(first_token_seconds(proxy_url + path, dict(body, prompt=via_proxy)))
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", default="1000,4000", help="comma-separated prompt sizes (tokens)")
    ap.add_argument("--reps", type=int, default=3, help="prompts measured per size")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, help="write the raw timings here")
    args = ap.parse_args()
    args.prompt_tokens = [int(x) for x in args.prompt_tokens.split(",")]
    try:
        model_dir = real_model_dir()
        redis = RedisServer().start()
    except (RealModelUnavailable, RedisUnavailable) as exc:
        print(f"cannot run: {exc}")
        return 1
    workdir = Path(tempfile.mkdtemp(prefix="lmcache-bench-pd-"))
    servers: dict[str, OpenAIServer] = {}
    proxy = None
    try:
        prompts = make_prompts(model_dir, args.prompt_tokens, args.reps)
        servers = start_servers(model_dir, redis.url, workdir, args)
        proxy = start_proxy(servers, workdir)
        results = {}
        for n in args.prompt_tokens:
            results[n] = measure(servers, proxy[1] if proxy else None, prompts[n], args.reps, args.max_tokens)
            print(f"{n} tokens: " + ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in results[n].items() if v))
        print("\n| prompt tokens | single TTFT (s) | prefill leg (s) | decoder TTFT (s) | two legs (s) | proxy TTFT (s) |"
              " decoder / single | two legs / single | proxy / single |")
        print("|---|---|---|---|---|---|---|---|---|")
        for n, res in results.items():
            med = {k: statistics.median(v) if v else float("nan") for k, v in res.items()}
            s = med["single"]
            print(f"| {n} | {s:.3f} | {med['prefill leg']:.3f} | {med['decoder TTFT']:.3f} | {med['two legs']:.3f} | "
                  f"{med['proxy']:.3f} | {med['decoder TTFT'] / s:.3f} | {med['two legs'] / s:.3f} | "
                  f"{med['proxy'] / s:.3f} |")  # fmt: skip
        if args.json:
            args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
        return 0
    finally:
        if proxy is not None:
            proxy[0].terminate()
            proxy[0].wait(10)
        for server in servers.values():
            server.stop()
        redis.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
