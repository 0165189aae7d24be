"""Re-exports of the vLLM adapter's helpers under their former import path
(``from lmcache.integration.vllm.utils import collect_stats`` is documented for users).

Each helper lives in the module of its job: :mod:`.naming` (registry names, socket
paths), :mod:`.request_inputs` (key extras, slot mappings), :mod:`.layer_order`,
:mod:`.stats_registry` (the process's stats registry, ``collect_stats``) and
:mod:`.failure_log`. New code imports from those.
"""

from __future__ import annotations

from lmcache.integration.vllm.failure_log import failure_logger
from lmcache.integration.vllm.layer_order import layer_index, ordered_layers
from lmcache.integration.vllm.naming import default_socket_dir, engine_for, instance_id, socket_path
from lmcache.integration.vllm.request_inputs import blocks_of_tokens, request_key_extras, slot_mapping
from lmcache.integration.vllm.stats_registry import (
    collect_stats,
    process_snapshot,
    register_scheduler_stats,
    sum_stats,
    unregister_scheduler_stats,
)

__all__ = [
    "blocks_of_tokens",
    "collect_stats",
    "default_socket_dir",
    "engine_for",
    "failure_logger",
    "instance_id",
    "layer_index",
    "ordered_layers",
    "process_snapshot",
    "register_scheduler_stats",
    "request_key_extras",
    "slot_mapping",
    "socket_path",
    "sum_stats",
    "unregister_scheduler_stats",
]
