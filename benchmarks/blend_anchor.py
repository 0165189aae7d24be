"""``bench_blend.py anchor``: where a cached document's KV is computed, measured offline.

Today a document is cached from a request that sends it alone (``doc + separator``, from
position 0): its first tokens are the attention sink of its own KV. In the prompts that
reuse it, the prompt's start (the chat template's header) is the sink. Caching each
document right *after that header* (an "anchor", the shared prefix of the parallel-encoding
literature) lets its KV attend to the same sink it will have in context.

For each question of ``harness/rag_dataset.py`` (three documents of its group in a seeded
order, inside the chat template, as ``bench_blend.py serving`` builds them), in pure torch
on the real model (``lmcache.v1.blend``, no vLLM):

* the full prefill: the gold fact's teacher-forced log-probability (``rag.gold_answer``: the
  question's lead, then the fact; the fact's tokens scored) and a greedy answer;
* a blend at each ``--ratios`` value, check layer 1, with every document's KV cached
  **alone** (from position 0) and cached **anchored** (after the chat header), each
  document's first token recomputed (as the serving path keys documents from their second
  word): the log-probability difference against the full prefill, and the greedy answer.

It prints per-question lines, then per setting: mean and median log P difference with a 95%
interval, greedy accuracy against the full prefill's (paired), and anchored minus alone
(paired). ``--max-tokens`` (24), ``--questions`` and ``--seed`` are the serving mode's flags
(the same answers length, question set and document orders). Run time: ~10 s per question
per ratio on 2 cores.

    python benchmarks/bench_blend.py anchor [--questions 100] [--ratios 0.2] [--max-tokens 24] [--threads 2]
        [--seed 0] [--anchor-docs 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness import rag_dataset as rag  # noqa: E402
from lmcache.v1.blend import BlendConfig, CachedSegmentKV, assemble, blend, full_prefill  # noqa: E402
from lmcache.v1.blend.hf_llama import HFLlamaBlendModel  # noqa: E402

SETTINGS = ("alone", "anchored")


def add_arguments(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--anchor-docs", type=int, default=3, help="anchor: documents per prompt (3)")


@dataclass(slots=True)
class Outcome:
    dlogp: dict[str, float] = field(default_factory=dict)  # setting -> log P(fact) - full prefill's
    right: dict[str, bool] = field(default_factory=dict)  # setting (and "full") -> greedy answer right


class Bench:
    def __init__(self, model_dir: Path, args: argparse.Namespace) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(str(model_dir))
        self.hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
        self.model = HFLlamaBlendModel(self.hf)
        self.before, self.after = rag.chat_wrapper(self.tok)
        self.anchor = self.ids(self.before)
        self.sep = rag.sep_ids(self.tok)
        self.args = args

    def ids(self, text: str) -> list[int]:
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def prompt(self, q: int) -> tuple[list[int], list[int], dict[int, int]]:
        """(prompt ids, document order, each document's start), as ``rag.build_prompt`` joins parts."""
        order = rag.docs_for(q, self.args.anchor_docs, seed=self.args.seed)
        ids = self.ids(self.before + f"Request {q + 1}. " + rag.INSTRUCTION)
        starts = {}
        for d in order:
            ids += self.sep
            starts[d] = len(ids)
            ids += rag.doc_ids(self.tok, d)
        ids += self.sep + self.ids(f"Question: {rag.QUESTIONS[q].text}{self.after}")
        return ids, order, starts

    def cache_of(self, keys: list[torch.Tensor], values: list[torch.Tensor]) -> Any:
        from transformers import DynamicCache

        cache = DynamicCache()
        for li, (k, v) in enumerate(zip(keys, values)):
            cache.update(k.transpose(0, 1)[None].contiguous(), v.transpose(0, 1)[None].contiguous(), li)
        return cache

    def fact_logp(self, keys, values, last_logits: torch.Tensor, answer: list[int], fact_len: int) -> float:
        out = self.hf(torch.tensor([answer[:-1]]), past_key_values=self.cache_of(keys, values), use_cache=True)
        logp = torch.cat([last_logits[None], out.logits[0]], 0).log_softmax(-1)
        return float(logp[torch.arange(len(answer)), torch.tensor(answer)][-fact_len:].sum())

    def greedy(self, keys, values, last_logits: torch.Tensor) -> str:
        cache, tok, out = self.cache_of(keys, values), int(last_logits.argmax()), []
        for _ in range(self.args.max_tokens):
            if tok == self.tok.eos_token_id:
                break
            out.append(tok)
            res = self.hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True)
            cache, tok = res.past_key_values, int(res.logits[0, -1].argmax())
        return self.tok.decode(out)

    def cached_docs(self, order: list[int], starts: dict[int, int], prefix: list[int]) -> list[CachedSegmentKV]:
        """Each document prefilled after ``prefix``, its first token left out (recomputed)."""
        pieces = []
        for d in order:
            kv = full_prefill(self.model, torch.tensor(prefix + rag.doc_ids(self.tok, d)))
            skip = len(prefix) + 1
            pieces.append(CachedSegmentKV(starts[d] + 1, [k[skip:] for k in kv.keys], [v[skip:] for v in kv.values],
                                          old_start=skip, recomputed_before=1))  # fmt: skip
        return pieces

    def question(self, q: int, ratio: float) -> Outcome:
        question = rag.QUESTIONS[q]
        ids, order, starts = self.prompt(q)
        lead, fact = rag.gold_answer(question)
        fact_ids = self.ids(fact)
        answer = self.ids(lead) + fact_ids
        x = torch.tensor(ids)
        full = full_prefill(self.model, x)
        ref = self.fact_logp(full.keys, full.values, full.logits, answer, len(fact_ids))
        out = Outcome(right={"full": rag.judge(self.greedy(full.keys, full.values, full.logits), question)})
        for name, prefix in (("alone", []), ("anchored", self.anchor)):
            reused = assemble(len(ids), self.cached_docs(order, starts, prefix), self.model)
            b = blend(self.model, x, reused, BlendConfig((ratio,), (1,)))
            out.dlogp[name] = self.fact_logp(b.keys, b.values, b.logits, answer, len(fact_ids)) - ref
            out.right[name] = rag.judge(self.greedy(b.keys, b.values, b.logits), question)
        return out


def interval(xs: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% interval over the questions (the serving mode's bootstrap)."""
    from benchmarks.blend_serving import bootstrap_mean_ci

    return (statistics.fmean(xs), *bootstrap_mean_ci(xs))


def report(ratio: float, rows: list[Outcome]) -> None:
    n = len(rows)
    full = sum(r.right["full"] for r in rows)
    print(f"\nratio {ratio}: {n} questions; full prefill right {full}/{n} ({100 * full / n:.0f}%)")
    print("| documents cached | log P(fact) - full: mean (95% CI) | median | right | points vs full (95% CI) |")
    print("|---|---|---|---|---|")
    for name in SETTINGS:
        m, lo, hi = interval([r.dlogp[name] for r in rows])
        med = statistics.median(r.dlogp[name] for r in rows)
        right = sum(r.right[name] for r in rows)
        pm, plo, phi = interval([100.0 * (r.right[name] - r.right["full"]) for r in rows])
        print(f"| {name} | {m:+.3f} ({lo:+.3f} to {hi:+.3f}) | {med:+.3f} | {right}/{n} ({100 * right / n:.0f}%) | "
              f"{pm:+.0f} ({plo:+.0f} to {phi:+.0f}) |")  # fmt: skip
    d = [r.dlogp["anchored"] - r.dlogp["alone"] for r in rows]
    m, lo, hi = interval(d)
    print(f"anchored - alone, log P(fact): {m:+.3f} (95% CI {lo:+.3f} to {hi:+.3f}); anchored higher in "
          f"{sum(x > 0 for x in d)}/{n}")  # fmt: skip


def main(args: argparse.Namespace) -> int:
    model_dir = ROOT / "models" / "smollm2-135m"
    if not (model_dir / "config.json").exists():
        print("the real model is not built: python scripts/get_model.py")
        return 2
    torch.set_grad_enabled(False)
    torch.set_num_threads(args.threads)
    bench = Bench(model_dir, args)
    ratios = args.ratios or [0.2]
    questions = min(args.questions, len(rag.QUESTIONS))
    print(f"anchored documents: {questions} questions x ratios {ratios}, {args.anchor_docs} documents per prompt, "
          f"anchor = the chat header ({len(bench.anchor)} tokens), torch threads {args.threads}", flush=True)  # fmt: skip
    t0 = time.perf_counter()
    for ratio in ratios:
        rows = []
        for q in range(questions):
            r = bench.question(q, ratio)
            rows.append(r)
            print(f"  r={ratio} q{q}: " + " ".join(f"{k} {v:+.3f}" for k, v in r.dlogp.items())
                  + " | right " + " ".join(f"{k} {int(v)}" for k, v in r.right.items())
                  + f" ({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
        report(ratio, rows)
    return 0
