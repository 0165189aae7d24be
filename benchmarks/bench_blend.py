"""CacheBlend: the pure-torch core (``core``, the default) or blending through vLLM's server (``serving``).

``core``: lmcache.v1.blend on the CPU, quality and time of a blend. A RAG-like prompt (a
short uncached prefix, documents prefilled on their own and joined by a separator, a
question) is blended at several recompute ratios and compared with a
full prefill of the same prompt:

* the largest K/V difference between this implementation's full prefill and the
  transformers model's own forward pass;
* KV deviation (mean squared K/V difference over all layers) per ratio, and the largest
  absolute K/V difference at ratio 1 (which must be a full prefill);
* whether the last token's argmax matches the full prefill;
* wall time of a blend against a full prefill (median of ``--reps``; informative only:
  this is the reference implementation, not the serving path).

Models: a tiny random Llama (always) and ``models/smollm2-135m`` when present.

``anchor``: documents cached alone (from position 0) against cached after the chat header,
blended offline on the real model (``blend_anchor.py`` says more).

``serving``: the real model in vLLM's OpenAI server, a full-prefill baseline against one server
per recompute ratio with lmcache blending, on the question set of ``harness/rag_dataset.py``: accuracy
paired with the baseline's (with a 95% interval), the teacher-forced log-probability of the gold
answer against the baseline's, agreement with the baseline's answers, TTFT at ~1.5k and ~3k tokens,
reused tokens (``blend_serving.py`` says more).

Usage::

    python benchmarks/bench_blend.py [core] [--tokens 1000] [--reps 3] [--threads 1] [--ratios 0,0.05,0.15,0.3,0.6,1]
    python benchmarks/bench_blend.py serving [--ratios 0,0.1,0.2,0.3,0.5,1] [--questions 117] [--speed-prompts 3]
        [--parallel 2] [--no-score] [--json out.json]
    python benchmarks/bench_blend.py anchor [--questions 100] [--ratios 0.2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from lmcache.v1.blend import BlendConfig, CachedSegmentKV, assemble, blend, deviation, full_prefill  # noqa: E402
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel  # noqa: E402

SEP = [7, 8, 7]


def prompt_of(model: HFLlamaBlendModel, vocab: int, tokens: int, docs: int = 4, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    doc_len = (tokens - 20) // docs - len(SEP)
    prefix = torch.randint(10, vocab, (5,), generator=gen).tolist()
    ids, cached = list(prefix), []
    for _ in range(docs):
        doc = torch.randint(10, vocab, (doc_len,), generator=gen).tolist()
        kv = full_prefill(model, torch.tensor(doc))
        cached.append(CachedSegmentKV(len(ids), kv.keys, kv.values))
        ids += doc + SEP
    ids += torch.randint(10, vocab, (15,), generator=gen).tolist()
    return torch.tensor(ids), assemble(len(ids), cached, model.rope)


def run(name: str, hf_model, vocab: int, args) -> None:
    model = HFLlamaBlendModel(hf_model)
    ids, reused = prompt_of(model, vocab, args.tokens)
    full_prefill(model, ids[:32])  # warm-up
    ref = full_prefill(model, ids)
    hf = hf_model(ids[None], use_cache=True).past_key_values.layers
    hf_err = max(
        float((ours - theirs[0].transpose(0, 1)).abs().max())
        for li, layer in enumerate(hf)
        for ours, theirs in ((ref.keys[li], layer.keys), (ref.values[li], layer.values))
    )
    runs = {"full": lambda: full_prefill(model, ids)}
    for ratio in args.ratios:
        runs[ratio] = lambda r=ratio: blend(model, ids, reused, BlendConfig((r,), (1,)))
    times: dict[object, list[float]] = {name: [] for name in runs}
    results = {}
    for _ in range(args.reps):  # interleaved, so that a busy machine slows every variant alike
        for key, fn in runs.items():
            t = time.perf_counter()
            results[key] = fn()
            times[key].append(time.perf_counter() - t)
    t_full = statistics.median(times["full"])
    print(
        f"{name}: {ids.shape[0]} tokens, {int(reused.mask.sum())} cached, full prefill {t_full * 1e3:.0f} ms, "
        f"max |dKV| against transformers' own prefill {hf_err:.2e}"
    )
    for ratio in args.ratios:
        res, t = results[ratio], statistics.median(times[ratio])
        err = max(float((a - b).abs().max()) for a, b in zip(res.keys + res.values, ref.keys + ref.values))
        same = int(res.logits.argmax()) == int(ref.logits.argmax())
        print(
            f"  ratio {ratio:<5} deviation {deviation(res, ref):.3e}  max |dKV| {err:.2e}  "
            f"argmax same {same!s:5}  {t * 1e3:6.0f} ms ({t / t_full:.2f} x full)"
        )
        if args.layers:
            print("    " + layer_breakdown(res.layer_seconds, results["full"].layer_seconds, int(res.recomputed.sum())))


def layer_breakdown(blend_s: tuple[float, ...], full_s: tuple[float, ...], recomputed: int) -> str:
    """Per-layer time of a blend against the full prefill's: the layers up to the check layer
    (every token), then the selective layers (``recomputed`` tokens)."""
    check = 2  # layers 0 and 1 (check layer 1) run every token
    head, tail = blend_s[:check], blend_s[check:]
    f_head, f_tail = full_s[:check], full_s[check:]
    per = ", ".join(f"{x * 1e3:.0f}" for x in blend_s)
    return (
        f"layers 0-{check - 1} (all tokens): {sum(head) * 1e3:.0f} ms ({sum(head) / sum(f_head):.2f} x full's); "
        f"layers {check}-{len(blend_s) - 1} ({recomputed} tokens): {sum(tail) * 1e3:.0f} ms "
        f"({sum(tail) / max(sum(f_tail), 1e-9):.2f} x full's); per layer ms: {per}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", choices=("core", "serving", "anchor"), default="core")
    parser.add_argument(
        "--ratios",
        type=lambda s: [float(x) for x in s.split(",") if x.strip()],
        default=None,
        help="recompute ratios (core: 0,0.05,0.15,0.3,0.6,1; serving: 0,0.1,0.2,0.3,0.5,1)",
    )
    core = parser.add_argument_group("core")
    core.add_argument("--tokens", type=int, default=1000)
    core.add_argument("--reps", type=int, default=3)
    core.add_argument("--layers", action="store_true", help="print each blend's per-layer times against the full prefill's")
    core.add_argument("--threads", type=int, default=1, help="torch CPU threads (1: steadier timings)")
    from benchmarks import blend_serving

    blend_serving.add_arguments(parser.add_argument_group("serving"))
    from benchmarks import blend_anchor

    blend_anchor.add_arguments(parser.add_argument_group("anchor"))
    args = parser.parse_args()
    if args.mode == "serving":
        sys.exit(blend_serving.main(args))
    if args.mode == "anchor":
        sys.exit(blend_anchor.main(args))
    if args.ratios is None:
        args.ratios = [0, 0.05, 0.15, 0.3, 0.6, 1]
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT))
    from tests.blend.helpers import tiny_llama

    run("tiny random Llama (4 layers)", tiny_llama(), 256, args)
    real = ROOT / "models" / "smollm2-135m"
    if (real / "config.json").exists():
        hf_model = AutoModelForCausalLM.from_pretrained(str(real), dtype=torch.float32).eval()
        run("smollm2-135m", hf_model, min(hf_model.config.vocab_size, 20000), args)


if __name__ == "__main__":
    main()
