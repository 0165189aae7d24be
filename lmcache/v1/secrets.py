"""Keeping secrets out of messages: URL credential masking (no other lmcache imports).

Rule (docs/security.md): no error message, log line, ``repr()`` or ``str()`` contains a
password or URL credential, whatever characters it holds. Every place that prints a
URL prints :func:`mask_url` of it; secret config values are never echoed.
"""

from __future__ import annotations

import re

_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def mask_url(url: str) -> str:
    """``url`` with the password of its userinfo replaced by ``***`` (safe to log).

    The userinfo ends at the *last* ``@`` (hosts and paths never hold one, passwords
    may: ``redis://u:p@ss@host`` -> ``redis://u:***@host``), which is also where the
    URL parser splits it. Anything that is not a string is shown as ``'<type>'``.
    """
    if not isinstance(url, str):
        return f"<{type(url).__name__}>"
    m = _SCHEME.match(url)
    start = m.end() if m else 0
    at = url.rfind("@", start)
    if at < 0:
        return url
    userinfo = url[start:at]
    user, has_pw, _ = userinfo.partition(":")
    if not has_pw:
        return url
    return f"{url[:start]}{user}:***@{url[at + 1:]}"
