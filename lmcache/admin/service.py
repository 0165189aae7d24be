"""The admin operations behind the routes: lookup, clear, pin, unpin (and the instance list).

Each call lists the instances anew (:class:`~lmcache.admin.directory.InstanceDirectory`),
asks the local ones over their lookup sockets (:class:`LookupClient`, every rank; a
rank that does not answer makes that instance's answer an error, never a guess) and
probes or cleans the remote store directly. Results are plain JSON-ready dicts; no KV
bytes are ever read. Thread-safe (every request builds its own socket clients).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from typing import Any

from lmcache.admin.directory import Instance, InstanceDirectory
from lmcache.admin.schemas import MAX_TOKENS, ClearBody, LookupBody, PinBody, UnpinBody
from lmcache.integration.vllm.lookup_service import LookupClient
from lmcache.v1.storage_backend.connector import RemoteError
from lmcache.v1.tiers import Tier

logger = logging.getLogger(__name__)


class NotFound(LookupError):
    """The request names something that does not exist (404)."""


class BadRequest(ValueError):
    """The request is well-formed but cannot be served as asked (400)."""


class LimitReached(RuntimeError):
    """A worker refused the request at one of its limits (429): e.g. too many admin pins."""


MAX_TOKENIZERS = 8
"""Tokenizers kept loaded (least recently used dropped first)."""


class Tokenizers:
    """Hugging Face tokenizers by model path, loaded offline (``local_files_only``, no remote
    code) and only from existing local directories named by an absolute path; at most
    :data:`MAX_TOKENIZERS` kept (LRU). Called on request threads; a load blocks the others."""

    def __init__(self, capacity: int = MAX_TOKENIZERS) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity={capacity!r}: expected an int >= 1")
        self.capacity = capacity
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def _load(self, path: str) -> Any:
        if not os.path.isabs(path) or not os.path.isdir(path):
            raise BadRequest(f"prompt: the instance's tokenizer {path[:200]!r} is not a local directory (absolute "
                             "path) on this host; send tokens instead")
        try:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        except (ImportError, OSError, ValueError) as exc:
            raise BadRequest(f"prompt: cannot load the tokenizer {path!r} ({type(exc).__name__}: {exc}); "
                             "send tokens instead") from None

    def encode(self, path: str, prompt: str) -> list[int]:
        """``prompt``'s token ids as vLLM's completions API computes them (special tokens added)."""
        with self._lock:
            tok = self._cache.get(path)
            if tok is None:
                tok = self._load(path)
                self._cache[path] = tok
                while len(self._cache) > self.capacity:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(path)
            ids = list(tok(prompt)["input_ids"])  # under the lock: a tokenizer is not re-entrant
        if len(ids) > MAX_TOKENS:
            raise BadRequest(f"prompt: {len(ids)} tokens; expected at most {MAX_TOKENS}")
        return ids

    def __len__(self) -> int:
        with self._lock:
            return len(self._cache)


class AdminService:
    """Lookup, clear and pin across the instances of ``directory``; ``timeout``: seconds per rank."""

    def __init__(self, directory: InstanceDirectory, *, tokenizers: Tokenizers | None = None,
                 timeout: float = 5.0) -> None:
        self.directory = directory
        self.tokenizers = tokenizers or Tokenizers()
        self.timeout = timeout

    # ------------------------------------------------------------------ helpers
    def _ask(self, inst: Instance, header: dict[str, Any], tokens: list[int] | None = None) -> list[dict[str, Any]]:
        """Every rank's reply; RuntimeError naming the rank when one cannot answer."""
        client = LookupClient(inst.sockets, timeout=self.timeout)
        try:
            replies = client.each_rank(header, tokens)
        finally:
            client.close()
        if any(r is None for r in replies):
            raise RuntimeError(client.last_error or "a rank did not answer")
        return replies  # type: ignore[return-value]

    def _tokens(self, inst: Instance, body: LookupBody | PinBody) -> list[int]:
        if body.tokens is not None:
            return list(body.tokens)
        assert body.prompt is not None
        if inst.record is None:
            raise BadRequest(f"prompt: instance {inst.id} is not registered (no model to tokenize with); send tokens")
        return self.tokenizers.encode(inst.record.tokenizer, body.prompt)

    def _instance(self, instance_id: str) -> Instance:
        inst = self.directory.get(instance_id)
        if inst is None:
            raise NotFound(f"instance: no instance {instance_id!r} (see GET /instances)")
        return inst

    # ------------------------------------------------------------------ routes
    def instances(self) -> dict[str, Any]:
        found = self.directory.instances()
        return {"instances": [i.describe() for i in found], "errors": list(self.directory.errors)}

    def lookup(self, body: LookupBody) -> dict[str, Any]:
        found = self.directory.instances()
        if body.instance is not None:
            found = [i for i in found if i.id == body.instance]
            if not found:
                raise NotFound(f"instance: no instance {body.instance!r} (see GET /instances)")
        if body.model is not None:
            found = [i for i in found if i.serves(body.model)]
        return {"instances": [self._lookup_one(i, body) for i in found], "errors": list(self.directory.errors)}

    def _lookup_one(self, inst: Instance, body: LookupBody) -> dict[str, Any]:
        out: dict[str, Any] = {"instance": inst.id, "tiers": {}}
        try:
            tokens = self._tokens(inst, body)
        except BadRequest as exc:
            out["error"] = str(exc)
            return out
        out["num_tokens"] = len(tokens)
        errors = []
        if inst.sockets:
            try:
                replies = self._ask(inst, {"op": "tiers", "extras": {}}, tokens)
                for tier in replies[0]["tiers"]:
                    out["tiers"][tier] = min(int(r["tiers"].get(tier, 0)) for r in replies)
            except RuntimeError as exc:
                errors.append(f"local tiers: {exc}")
        remote = self.directory.remote
        if inst.record is not None and remote is not None and Tier.REMOTE in inst.record.tiers:
            try:
                out["tiers"][str(Tier.REMOTE)] = remote.cached_tokens(inst.record, tokens)
            except (RemoteError, ValueError, TypeError, KeyError) as exc:
                errors.append(f"remote tier: {type(exc).__name__}: {exc}")
        if out["tiers"]:
            out["cached_tokens"] = max(out["tiers"].values())
        if errors:
            out["error"] = "; ".join(errors)
        return out

    def clear(self, body: ClearBody) -> dict[str, Any]:
        targets = [self._instance(body.instance)] if body.instance is not None else self.directory.instances()
        out: dict[str, Any] = {"instances": [], "errors": []}
        if body.local:
            for inst in targets:
                if not inst.sockets:
                    if body.instance is not None:
                        raise BadRequest(f"instance: {inst.id} runs on another host; its local tiers cannot be "
                                         "cleared from here (local: false clears only the remote entries)")
                    continue
                try:
                    replies = self._ask(inst, {"op": "clear", "unpin": body.unpin})
                    out["instances"].append({"instance": inst.id, "ranks": [r["cleared"] for r in replies]})
                except RuntimeError as exc:
                    out["errors"].append(f"{inst.id}: {exc}")
        if body.remote:
            out["remote_deleted"] = self._clear_remote(targets[0] if body.instance is not None else None)
        return out

    def _clear_remote(self, inst: Instance | None) -> int:
        remote = self.directory.remote
        if remote is None:
            raise BadRequest("remote: this admin service has no remote store (start it with --remote-url)")
        if inst is not None and inst.record is None:
            raise BadRequest(f"remote: instance {inst.id} is not registered; its remote namespace is unknown")
        try:
            return remote.delete_matching(remote.namespace_pattern(inst.record if inst else None))
        except RemoteError as exc:
            raise RuntimeError(f"remote store {remote.url}: {type(exc).__name__}: {exc}") from None

    def _local(self, instance_id: str, what: str) -> Instance:
        inst = self._instance(instance_id)
        if not inst.sockets:
            raise BadRequest(f"instance: {inst.id} has no lookup socket reachable from here (another host?); "
                             f"cannot {what} it")
        return inst

    def pin(self, body: PinBody) -> dict[str, Any]:
        """Pin on every rank; if a rank fails or refuses, the ranks that pinned are released again."""
        inst = self._local(body.instance, "pin")
        tokens = self._tokens(inst, body)
        client = LookupClient(inst.sockets, timeout=self.timeout)
        try:
            replies = client.each_rank({"op": "pin", "ttl": float(body.ttl), "extras": {}}, tokens)
            refused = next((str(r["refused"]) for r in replies if r is not None and r.get("refused")), None)
            if refused is not None or any(r is None for r in replies):
                pinned = [r["pin_id"] for r in replies if r is not None and r.get("pin_id")]
                if pinned:
                    client.each_rank({"op": "unpin", "pin_ids": pinned})
                if refused is not None:
                    raise LimitReached(refused)
                raise RuntimeError(client.last_error or "a rank did not answer")
        finally:
            client.close()
        return {
            "instance": inst.id,
            "num_tokens": len(tokens),
            "pinned_tokens": min(int(r["pinned_tokens"]) for r in replies if r is not None),
            "ttl": float(body.ttl),
            "pin_ids": [r["pin_id"] for r in replies if r is not None],
        }

    def unpin(self, body: UnpinBody) -> dict[str, Any]:
        """Release admin pins on every rank: those named (each rank releases the ones it
        holds), or all of them. ``unknown``: named pins no rank held (expired or released)."""
        inst = self._local(body.instance, "unpin")
        replies = self._ask(inst, {"op": "unpin", "pin_ids": list(body.pin_ids) if body.pin_ids else None})
        released = [pid for r in replies for pid in r["unpinned"]]
        held = set(released)
        unknown = [pid for pid in (body.pin_ids or ()) if pid not in held]
        return {"instance": inst.id, "unpinned": released, "unknown": list(dict.fromkeys(unknown))}
