"""Signed disaggregated-prefill parameters: a decoder honours ``do_remote_prefill`` only
when the proxy vouched for it.

Why: ``do_remote_prefill`` makes a decoder wait (up to ``pd_wait_timeout``) for KV a
prefiller announced. Any client of the decoder's own OpenAI API could send it, so an
unsigned flag would let anyone hold requests in the decoder's scheduler. Prefillers,
decoders and the proxy share one secret (``pd_secret`` / ``$LMCACHE_PD_SECRET``):

1. the prefiller's answer carries ``prompt_digest`` (:func:`prompt_digest` of the prompt
   token ids it computed) beside ``remote_num_tokens``;
2. the proxy adds ``lmcache_sig = {"expires": <unix time>, "mac": <hex>}``, an HMAC-SHA256
   over the digest, the token count and the expiry (:func:`sign`);
3. the decoder recomputes the digest of its own prompt and checks the MAC and the
   expiry (:func:`verify`); anything else is served as a normal request.

A signature binds one prompt for ``ttl`` seconds: replaying it on the same prompt makes
the decoder load KV that the prefiller really stored, nothing more.

Stateless, standard library only (the proxy imports it without the engine).
"""

from __future__ import annotations

import hashlib
import hmac
import math
import os
import stat
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SECRET_ENV = "LMCACHE_PD_SECRET"
MIN_SECRET_CHARS = 16
SIGNATURE_KEY = "lmcache_sig"
"""Key of the proxy's signature in ``kv_transfer_params``."""
DIGEST_KEY = "prompt_digest"
"""Key of the prefiller's prompt digest in ``kv_transfer_params``."""
DEFAULT_TTL_S = 300.0
"""Seconds a signature stays valid (the decoder may queue the request for a while)."""
MAX_TTL_S = 3600.0
CLOCK_SKEW_S = 30.0
"""Expiries further than ``MAX_TTL_S + CLOCK_SKEW_S`` in the future are refused (forged or a wrong clock)."""
_DOMAIN = b"lmcache-pd-v1"
_DIGEST_CHARS = 64


def prompt_digest(tokens: Sequence[int]) -> str:
    """SHA-256 (hex) of ``tokens`` as little-endian int32: the same on every host."""
    arr = array("i", tokens)
    if sys.byteorder != "little":
        arr.byteswap()
    return hashlib.sha256(arr.tobytes()).hexdigest()


def _mac(secret: str, digest: str, num_tokens: int, expires: float) -> str:
    msg = b"\n".join((_DOMAIN, digest.encode(), str(int(num_tokens)).encode(), repr(float(expires)).encode()))
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == _DIGEST_CHARS and all(c in "0123456789abcdef" for c in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def sign(params: Mapping[str, Any], secret: str, *, now: float, ttl: float = DEFAULT_TTL_S) -> dict[str, Any] | None:
    """``params`` (a prefiller's answer) with the proxy's signature added, as a new dict;
    None when ``params`` lacks a well-formed ``prompt_digest`` or ``remote_num_tokens``
    (nothing to vouch for)."""
    digest, count = params.get(DIGEST_KEY), params.get("remote_num_tokens")
    if not _is_digest(digest) or not _is_count(count):
        return None
    expires = round(now + ttl, 3)
    out = dict(params)
    out[SIGNATURE_KEY] = {"expires": expires, "mac": _mac(secret, digest, count, expires)}
    return out


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of :func:`verify`: ``ok``, or ``reason`` (a short phrase for one log line)."""

    ok: bool
    reason: str = ""


def verify(params: Mapping[str, Any], secret: str, tokens: Sequence[int], *, now: float) -> Verdict:
    """Whether ``params`` carry a valid signature for the prompt ``tokens`` at time ``now``."""
    sig = params.get(SIGNATURE_KEY)
    if not isinstance(sig, Mapping):
        return Verdict(False, "not signed by the proxy")
    expires, mac = sig.get("expires"), sig.get("mac")
    digest, count = params.get(DIGEST_KEY), params.get("remote_num_tokens")
    if (isinstance(expires, bool) or not isinstance(expires, (int, float)) or not math.isfinite(expires)
            or not isinstance(mac, str) or not _is_digest(digest) or not _is_count(count)):  # fmt: skip
        return Verdict(False, "malformed signature")
    if not hmac.compare_digest(mac.encode(), _mac(secret, digest, count, float(expires)).encode()):
        return Verdict(False, "bad signature")
    if expires < now:
        return Verdict(False, "signature expired")
    if expires > now + MAX_TTL_S + CLOCK_SKEW_S:
        return Verdict(False, "signature expiry too far ahead")
    if not hmac.compare_digest(digest, prompt_digest(tokens)):
        return Verdict(False, "signed for another prompt")
    return Verdict(True)


def check_secret(secret: str, source: str) -> str:
    """``secret`` stripped; ValueError naming ``source`` when it is too short."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_CHARS:
        raise ValueError(
            f"{source}: the PD secret has {len(secret)} characters; expected at least {MIN_SECRET_CHARS} "
            "(e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
        )
    return secret


def load_secret(secret_file: str | None, env: Mapping[str, str] | None = None) -> str | None:
    """The shared PD secret from ``secret_file`` (first line; the file must not be readable
    by group or others) or else ``$LMCACHE_PD_SECRET``; None when neither is set.
    ValueError naming the source for an unreadable or unsafe file or a short secret."""
    environ = os.environ if env is None else env
    if secret_file is None:
        value = environ.get(SECRET_ENV, "")
        return check_secret(value, f"${SECRET_ENV}") if value.strip() else None
    source = f"--pd-secret-file {secret_file!r}"
    try:
        fd = os.open(secret_file, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        raise ValueError(f"{source}: cannot read it ({exc.strerror})") from None
    with os.fdopen(fd, encoding="utf-8") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ValueError(f"{source}: readable by group or others (mode {stat.S_IMODE(mode):o}); "
                             f"expected 600 (chmod 600 {secret_file})")
        return check_secret(f.readline(), source)
