"""Fuzzing ``lmcache proxy``'s request bodies (hypothesis) against fake servers that answer normally.

Whatever the body (any JSON value, random bytes, any size up to the limit and just over
it, sent whole or chunked): the proxy answers a 4xx with an OpenAI-style error object or
the fake decoder's answer, never a 5xx of its own, and never hangs (the client's timeout
would fail the test).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from lmcache.pd.proxy import ProxyConfig
from tests.pd.fakes import DEADLINE, SECRET, Fake, serve_proxy, stop_all

LIMIT = 16 << 10
PATHS = ("/v1/completions", "/v1/chat/completions")
SIZES = (0, 1, 2, 100, LIMIT - 1, LIMIT, LIMIT + 1, 2 * LIMIT)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=30,
)
request_like = st.fixed_dictionaries(
    {},
    optional={
        "model": json_values, "prompt": json_values, "messages": json_values, "stream": json_values,
        "max_tokens": json_values, "max_completion_tokens": json_values, "min_tokens": json_values,
        "stream_options": json_values, "kv_transfer_params": json_values, "n": json_values,
    },
)


@pytest.fixture(scope="module")
def proxied() -> Iterator[httpx.Client]:
    p1, d1 = Fake("p1").start(), Fake("d1").start()
    _, served = serve_proxy(ProxyConfig((p1.url,), (d1.url,), health_interval=3600.0, timeout=DEADLINE,
                                        max_body_bytes=LIMIT, secret=SECRET))
    with httpx.Client(base_url=served.url, timeout=DEADLINE) as client:
        yield client
    stop_all([served, p1.served, d1.served])  # type: ignore[list-item]


def check(resp: httpx.Response, body: Any) -> None:
    """A correct answer for ``body`` (the decoder's, as it would answer it), or a 4xx error object."""
    assert resp.status_code < 500, resp.text[:500]
    if resp.status_code != 200:
        assert 400 <= resp.status_code < 500
        err = resp.json()["error"]
        assert err["code"] == resp.status_code and isinstance(err["message"], str)
        return
    assert isinstance(body, dict), "only a JSON object is served"
    if body.get("stream"):
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert resp.content.endswith(b"data: [DONE]\n\n") and b"kv_transfer_params" not in resp.content
    else:
        answer = resp.json()
        assert answer["choices"][0] and "kv_transfer_params" not in answer


def _parsed(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        return None


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(value=json_values | request_like, path=st.sampled_from(PATHS))
@example(value={"prompt": "\ud800", "stream": True}, path=PATHS[0])  # a lone surrogate
@example(value={"prompt": "x", "n": 10**4000, "temperature": 1e308}, path=PATHS[0])
def test_any_json_value(proxied, value, path):
    raw = json.dumps(value).encode()
    if len(raw) > LIMIT:
        resp = proxied.post(path, content=raw)
        assert resp.status_code == 413
        return
    resp = proxied.post(path, content=raw, headers={"content-type": "application/json"})
    check(resp, _parsed(raw))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(raw=st.binary(max_size=2048), path=st.sampled_from(PATHS), chunked=st.booleans())
@example(raw=b"[" * 100_000, path=PATHS[0], chunked=False)  # nested deeper than json can parse
@example(raw=b'{"prompt": NaN}', path=PATHS[0], chunked=False)
@example(raw=b'{"prompt": "a", "max_tokens": Infinity}', path=PATHS[1], chunked=True)
@example(raw=b'{"prompt": "\xff\xfe"}', path=PATHS[0], chunked=False)  # not UTF-8
@example(raw=b'{"n": 1' + b"0" * 5000 + b"}", path=PATHS[0], chunked=False)  # an int too long to parse
def test_random_bytes(proxied, raw, path, chunked):
    content: Any = iter([raw[: len(raw) // 2], raw[len(raw) // 2:]]) if chunked else raw
    check(proxied.post(path, content=content), _parsed(raw))


@settings(max_examples=len(SIZES) * 4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(size=st.sampled_from(SIZES), stream=st.booleans(), chunked=st.booleans())
def test_sizes_up_to_the_limit_and_just_over(proxied, size, stream, chunked):
    head = json.dumps({"model": "tiny", "stream": stream, "prompt": ""}).encode()[:-2]  # ... "prompt": "
    if size < len(head) + 2:
        raw = b" " * size  # whitespace only: not a JSON value
    else:
        raw = head + b"y" * (size - len(head) - 2) + b'"}'
    assert len(raw) == size
    content: Any = iter([raw[i:i + 4096] for i in range(0, size, 4096)]) if chunked else raw
    resp = proxied.post(PATHS[0], content=content)
    if size > LIMIT:
        assert resp.status_code == 413 and resp.json()["error"]["code"] == 413
    elif size < len(head) + 2:
        assert resp.status_code == 400
    else:
        assert resp.status_code == 200
        check(resp, json.loads(raw))
