"""Disaggregated prefill/decode (PD) through the remote tier: what a request's
``kv_transfer_params`` ask for, and the fingerprint that ties a prefiller's entries to
the decoders that may read them.

The flow (docs/disaggregated.md): a proxy sends a request to a prefiller with
``{"do_remote_decode": true}``; the prefiller computes the prompt, stores all of it
(partial last chunk included) and answers only once those writes are durable in the
remote store; its response carries :meth:`Fingerprint.transfer_params`. The proxy
passes them to a decoder (``{"do_remote_prefill": true, "remote_num_tokens": N,
"lmcache": {...}}``), which waits (bounded by ``pd_wait_timeout``) until the announced
tokens are found, loads them and computes only the last prompt token.

Who is honoured (:class:`PDPolicy`): a node acts on ``do_remote_decode`` only in the
``sender`` role and on ``do_remote_prefill`` only in the ``receiver`` role (``pd_role``,
default from vLLM's ``kv_role``: ``kv_producer`` sends, ``kv_consumer`` receives,
``kv_both`` does neither unless ``pd_role: both``), and a receiver only with parameters
the proxy signed (:mod:`lmcache.pd.signing`, the shared ``pd_secret``): a client of the
decoder's own API cannot make it wait. Anything refused is served as a normal request.

Stateless: pure functions and frozen dataclasses. ``kv_transfer_params`` come from HTTP
clients, so they are validated here, once; anything malformed is "not a PD request".
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lmcache.pd import signing

FINGERPRINT_KEY = "lmcache"
"""Key of the fingerprint in ``kv_transfer_params``."""
MAX_TOKENS = 1 << 31


class BadTransferParams(ValueError):
    """``kv_transfer_params`` present but malformed (the message names the field)."""


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """What must agree between a prefiller and a decoder for entries to be shared: the
    chunk keys already fold in model namespace, world size and dtype, so a mismatch
    would only ever miss; the fingerprint turns that silent miss into one clear log line
    (and skips the wait)."""

    namespace: str
    world_size: int
    kv_dtype: str
    chunk_size: int
    entry_format: int

    def as_params(self) -> dict[str, Any]:
        return asdict(self)

    def differences(self, theirs: Mapping[str, Any]) -> list[str]:
        """``field: prefiller's value != ours`` for every field that differs (or is missing)."""
        out = []
        for f in fields(self):
            mine = getattr(self, f.name)
            other = theirs.get(f.name)
            if other != mine:
                out.append(f"{f.name}: prefiller {other!r} != decoder {mine!r}")
        return out

    def transfer_params(self, prompt: Sequence[int]) -> dict[str, Any]:
        """What a prefiller's ``request_finished`` returns for the decoder leg of ``prompt``
        (its token ids): the proxy signs these before passing them on."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_num_tokens": len(prompt),
            signing.DIGEST_KEY: signing.prompt_digest(prompt),
            FINGERPRINT_KEY: self.as_params(),
        }


@dataclass(frozen=True, slots=True)
class PDRequest:
    """The PD part of one request's ``kv_transfer_params``."""

    send: bool
    """Prefill for a decoder (``do_remote_decode``, or LMCache's ``disagg_spec``)."""
    receive: bool
    """A prefiller computed this prompt (``do_remote_prefill``): wait for its KV."""
    expected_tokens: int | None = None
    """``remote_num_tokens``: how many prompt tokens the prefiller stored."""
    fingerprint: Mapping[str, Any] | None = None


def _flag(params: Mapping[str, Any], name: str) -> bool:
    value = params.get(name, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadTransferParams(f"kv_transfer_params.{name}={value!r}: expected true or false")
    return value


def read_transfer_params(request: Any) -> PDRequest | None:
    """The PD request of ``request`` (vLLM's ``Request.kv_transfer_params``), or None when it
    carries none. Raises :class:`BadTransferParams` for malformed values."""
    params = getattr(request, "kv_transfer_params", None)
    if params is None:
        return None
    if not isinstance(params, Mapping):
        raise BadTransferParams(f"kv_transfer_params={type(params).__name__}: expected a JSON object")
    send = _flag(params, "do_remote_decode") or params.get("disagg_spec") is not None
    receive = _flag(params, "do_remote_prefill")
    if send and receive:
        raise BadTransferParams("kv_transfer_params: do_remote_decode and do_remote_prefill are both true")
    if not (send or receive):
        return None
    expected = params.get("remote_num_tokens")
    if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int)
                                 or not 0 <= expected < MAX_TOKENS):  # fmt: skip
        raise BadTransferParams(f"kv_transfer_params.remote_num_tokens={expected!r}: expected an integer >= 0")
    fingerprint = params.get(FINGERPRINT_KEY)
    if fingerprint is not None and not isinstance(fingerprint, Mapping):
        raise BadTransferParams(f"kv_transfer_params.{FINGERPRINT_KEY}={fingerprint!r}: expected a JSON object")
    return PDRequest(send, receive, expected, fingerprint)


ROLES_OF_KV_ROLE = {"kv_producer": "sender", "kv_consumer": "receiver", "kv_both": None}
"""Default ``pd_role`` by vLLM's ``kv_role`` (None: honour no PD parameters)."""


@dataclass(frozen=True, slots=True)
class PDPolicy:
    """Which PD requests this node honours (see the module docstring)."""

    send: bool
    """Act on ``do_remote_decode`` (store the prompt durably, answer with decoder parameters)."""
    receive: bool
    """Act on ``do_remote_prefill`` (wait for the announced KV), when signed with ``secret``."""
    secret: str | None = field(default=None, repr=False)

    @classmethod
    def of(cls, pd_role: str | None, kv_role: str, secret: str | None) -> PDPolicy:
        role = pd_role if pd_role is not None else ROLES_OF_KV_ROLE.get(kv_role)
        return cls(send=role in ("sender", "both"), receive=role in ("receiver", "both"), secret=secret)

    def refusal(self, pd: PDRequest, params: Mapping[str, Any], prompt: Sequence[int],
                now: float | None = None) -> str | None:
        """Why ``pd`` (read from ``params``, for the prompt ``prompt``) is not honoured here; None to honour it."""
        if pd.send and not self.send:
            return "do_remote_decode on a node whose pd_role is not sender or both"
        if pd.receive:
            if not self.receive:
                return "do_remote_prefill on a node whose pd_role is not receiver or both"
            if self.secret is None:
                return "do_remote_prefill without a pd_secret on this decoder"
            verdict = signing.verify(params, self.secret, prompt, now=time.time() if now is None else now)
            if not verdict.ok:
                return f"do_remote_prefill {verdict.reason}"
        return None
