"""Disaggregated prefill/decode through the remote tier, with the adapter driven like vLLM
drives it (both roles in one process per instance, a real ``redis-server`` between a
prefiller and a decoder): the prefiller stores whole prompts durably and hands the decoder
its parameters; the decoder waits for announced KV, loads all but the last token with exact
KV, and falls back to computing (counted, logged) when the KV does not come."""

from __future__ import annotations

import logging
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache.integration.vllm import scheduler_side
from lmcache.integration.vllm.request_tracker import PlannerConfig, RequestPlanner
from lmcache.integration.vllm.pd import BadTransferParams, Fingerprint, PDPolicy, PDRequest, read_transfer_params
from lmcache.pd import signing
from lmcache.v1.config import ConfigError
from tests.remote_fixtures import key, random_obj, remote_of
from tests.vllm_adapter.test_vllm_connector_unit import (
    CHUNK,
    FakeRequest,
    MiniVLLM,
    fake_vllm_config,
    prompt,
    sched_output,
)

SEND = {"do_remote_decode": True, "do_remote_prefill": False}
SECRET = "pd-test-secret-0123456789"
DROPPED, WRITTEN = "puts_dropped_inflight_full", "writes_completed"


@pytest.fixture(autouse=True)
def _hermetic_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("LMCACHE_"):
            monkeypatch.delenv(name)


def pd_config(url: str, role: str, tmp: str, **extra):
    cfg = {"lmcache.remote_url": url, "lmcache.enable_pd": True, "lmcache.pd_wait_timeout": 0.5,
           "lmcache.pd_secret": SECRET}
    cfg.update({f"lmcache.{k}": v for k, v in extra.items()})
    return fake_vllm_config(role=role, tmp=tmp, extra=cfg)


class Instance(MiniVLLM):
    """A :class:`MiniVLLM` that keeps what ``request_finished`` returned."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.finished: dict[str, dict | None] = {}
        finish = self.scheduler.request_finished

        def keep(req, blocks):
            delay, params = finish(req, blocks)
            self.finished[req.request_id] = params
            return delay, params

        self.scheduler.request_finished = keep

    def counters(self) -> dict[str, int]:
        return self.scheduler.scheduler.snapshot()


@pytest.fixture
def pair(redis_server, tmp_path):
    (tmp_path / "p").mkdir()
    (tmp_path / "d").mkdir()
    prefiller = Instance(pd_config(redis_server.url, "kv_producer", str(tmp_path / "p")))
    decoder = Instance(pd_config(redis_server.url, "kv_consumer", str(tmp_path / "d")))
    yield prefiller, decoder
    decoder.close()
    prefiller.close()


def decode_params(prefiller: Instance, req_id: str) -> dict:
    """The prefiller's answer for ``req_id``, signed as the proxy signs it."""
    params = prefiller.finished[req_id]
    assert params is not None
    signed = signing.sign(params, SECRET, now=time.time())
    assert signed is not None
    return signed


def announce(decoder: Instance, tokens: list[int], *, fingerprint: dict | None = None, secret: str = SECRET,
             now: float | None = None) -> dict:
    """Signed decoder parameters for ``tokens`` as a prefiller would announce them."""
    params = {"do_remote_prefill": True, "remote_num_tokens": len(tokens),
              signing.DIGEST_KEY: signing.prompt_digest(tokens),
              "lmcache": fingerprint or decoder.worker.settings.fingerprint.as_params()}  # fmt: skip
    signed = signing.sign(params, secret, now=time.time() if now is None else now)
    assert signed is not None
    return signed


@pytest.mark.parametrize("n", [5, 3 * CHUNK + 5, 4 * CHUNK])
def test_decoder_loads_all_but_the_last_token_with_exact_kv(pair, n):
    """Prompts shorter than a block, with a partial last chunk, and chunk-aligned."""
    prefiller, decoder = pair
    tokens = prompt(n, n)
    assert prefiller.serve(FakeRequest("p", tokens, kv_transfer_params=dict(SEND)))["external"] == 0
    params = decode_params(prefiller, "p")
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] == n
    assert params["lmcache"] == decoder.worker.settings.fingerprint.as_params()
    assert prefiller.engine.storage_manager.flush(0)  # durable when the prefiller answered
    req = FakeRequest("d", list(tokens), kv_transfer_params=params)
    got = decoder.serve(req)
    assert got["external"] == n - 1 and not got["errors"]  # one prompt token computed locally
    decoder.assert_kv_correct(req, got["blocks"])
    c = decoder.counters()
    assert (c["scheduler_pd_received_requests"], c["scheduler_pd_fallbacks"]) == (1, 0)
    assert prefiller.counters()["scheduler_pd_sent_requests"] == 1
    assert decoder.engine.stats.hit_tokens_remote == n - 1  # read from the remote store


def test_decoder_waits_for_announced_kv_then_loads_it(pair):
    prefiller, decoder = pair
    tokens = prompt(2 * CHUNK + 3, 41)
    req = FakeRequest("d", list(tokens), kv_transfer_params=announce(decoder, tokens))
    assert decoder.scheduler.get_num_new_matched_tokens(req, 0) is None  # not there yet: ask again later
    assert decoder.counters()["scheduler_pd_waits"] == 1
    prefiller.serve(FakeRequest("p", tokens, kv_transfer_params=dict(SEND)))
    got = None
    while got is None:  # the next lookup comes once PD_POLL_SECONDS have passed
        got = decoder.scheduler.get_num_new_matched_tokens(req, 0)
    assert got == len(tokens) - 1
    assert decoder.counters()["scheduler_pd_fallbacks"] == 0


def test_decoder_falls_back_to_computing_after_the_deadline(pair, caplog):
    _, decoder = pair
    tokens = prompt(3 * CHUNK, 42)
    req = FakeRequest("d", list(tokens), kv_transfer_params=announce(decoder, tokens))
    start = time.monotonic()
    answers = []
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        while (got := decoder.scheduler.get_num_new_matched_tokens(req, 0)) is None:
            answers.append(got)
            assert time.monotonic() - start < 30, "the decoder never gave up waiting"
    assert got == 0 and answers  # waited, then computes the prompt itself
    assert time.monotonic() - start >= 0.5  # pd_wait_timeout
    c = decoder.counters()
    assert c["scheduler_pd_fallbacks"] == 1 and 0 < c["scheduler_pd_waits"] <= len(answers)
    assert any("pd_wait_timeout=0.5" in r.getMessage() for r in caplog.records)


def test_fingerprint_mismatch_is_logged_by_field_and_not_waited_for(pair, caplog):
    _, decoder = pair
    tokens = prompt(3 * CHUNK, 43)
    theirs = dict(decoder.worker.settings.fingerprint.as_params(), chunk_size=CHUNK * 2, kv_dtype="bfloat16")
    req = FakeRequest("d", list(tokens), kv_transfer_params=announce(decoder, tokens, fingerprint=theirs))
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert decoder.scheduler.get_num_new_matched_tokens(req, 0) == 0  # at once, no wait
    (line,) = [r.getMessage() for r in caplog.records if "lmcache PD" in r.getMessage()]
    assert f"chunk_size: prefiller {CHUNK * 2} != decoder {CHUNK}" in line and "kv_dtype" in line
    assert decoder.counters()["scheduler_pd_fingerprint_mismatches"] == 1


def test_malformed_transfer_params_are_a_normal_request(pair, caplog):
    prefiller, _ = pair
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        r = prefiller.serve(FakeRequest("p", prompt(40, 44), kv_transfer_params={"do_remote_decode": "yes"}))
    assert r["external"] == 0 and prefiller.finished["p"] is None
    assert any("do_remote_decode='yes'" in rec.getMessage() for rec in caplog.records)


def test_transfer_params_are_validated():
    def read(params):
        return read_transfer_params(FakeRequest("r", [1], kv_transfer_params=params))

    assert read(None) is None and read({}) is None and read({"do_remote_decode": False}) is None
    assert read(SEND) == PDRequest(send=True, receive=False)
    assert read({"disagg_spec": {"req_id": "x"}}).send  # LMCache's PD spec
    assert read({"do_remote_prefill": True, "remote_num_tokens": 7}) == PDRequest(False, True, 7)
    for bad, field in [([1], "kv_transfer_params"), ({"do_remote_prefill": 1}, "do_remote_prefill"),
                       ({"do_remote_prefill": True, "remote_num_tokens": -1}, "remote_num_tokens"),
                       ({"do_remote_prefill": True, "remote_num_tokens": True}, "remote_num_tokens"),
                       ({"do_remote_prefill": True, "lmcache": "x"}, "lmcache"),
                       ({"do_remote_prefill": True, "do_remote_decode": True}, "both")]:  # fmt: skip
        with pytest.raises(BadTransferParams, match=field):
            read(bad)
    fp = Fingerprint("m", 1, "float32", 256, 1)
    assert fp.differences(fp.as_params()) == [] and fp.differences({}) != []


def test_pd_without_enable_pd_is_a_normal_request(redis_server, tmp_path, caplog):
    inst = Instance(fake_vllm_config(role="kv_producer", tmp=str(tmp_path),
                                     extra={"lmcache.remote_url": redis_server.url}))  # fmt: skip
    try:
        with caplog.at_level(logging.WARNING, logger="lmcache"):
            inst.serve(FakeRequest("p", prompt(40, 45), kv_transfer_params=dict(SEND)))
        assert inst.finished["p"] is None
        assert any("enable_pd is off" in r.getMessage() for r in caplog.records)
    finally:
        inst.close()


def test_pd_settings_are_checked_at_start(redis_server, tmp_path):
    with pytest.raises(ConfigError, match="enable_pd=True: expected remote_url"):
        MiniVLLM(fake_vllm_config(tmp=str(tmp_path), extra={"lmcache.enable_pd": True}))
    with pytest.raises(ConfigError, match="pd_role='sender'.*kv_consumer"):
        MiniVLLM(pd_config(redis_server.url, "kv_consumer", str(tmp_path), pd_role="sender"))
    with pytest.raises(ConfigError, match="transfer_channel='nixl'.*remote tier only"):
        MiniVLLM(pd_config(redis_server.url, "kv_both", str(tmp_path), transfer_channel="nixl"))


def test_prefiller_writes_wait_for_room_instead_of_being_dropped(redis_server, remote_manager):
    """Back-pressure: with a write budget of one entry, writes inside ``waiting_writes`` all
    land; outside it the same burst drops writes (counted)."""
    manager = remote_manager(redis_server.url, extra_config={"remote_max_inflight_mb": 1, "remote_workers": 1})
    remote = remote_of(manager)

    def burst(first: int) -> None:
        objs = [random_obj(manager, (2, 1, 16, 6144), seed=i) for i in range(12)]  # 768 KiB each
        manager.batched_put([key(first + i) for i in range(12)], objs)
        for obj in objs:
            obj.ref_count_down()

    with manager.waiting_writes(timeout=30):
        burst(0)
    assert manager.flush(30)
    stats = remote.stats.snapshot()
    assert stats[DROPPED] == 0 and stats[WRITTEN] == 12 and stats["put_waits"] > 0
    burst(100)
    assert manager.flush(30)
    assert remote.stats.snapshot()[DROPPED] > 0


# ---------------------------------------------------------------------- fuzz: hostile kv_transfer_params
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63) | st.floats(allow_nan=True) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
_KEYS = st.sampled_from(["do_remote_decode", "do_remote_prefill", "remote_num_tokens", "lmcache", "disagg_spec", "x"])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=st.one_of(_JSON, st.dictionaries(_KEYS, _JSON, max_size=5)))
def test_fuzz_transfer_params_are_a_pd_request_none_or_a_named_error(params):
    """Anything a client can send as ``kv_transfer_params``: a valid PD request, None, or
    BadTransferParams naming ``kv_transfer_params``; never another exception."""
    try:
        pd = read_transfer_params(FakeRequest("r", [1], kv_transfer_params=params))
    except BadTransferParams as exc:
        assert "kv_transfer_params" in str(exc)
        return
    assert pd is None or (isinstance(pd, PDRequest) and pd.send != pd.receive)
    if pd is not None and pd.expected_tokens is not None:
        assert isinstance(pd.expected_tokens, int) and pd.expected_tokens >= 0


@settings(max_examples=100, deadline=None)
@given(params=st.dictionaries(_KEYS, _JSON, max_size=5))
def test_fuzz_planner_serves_any_transfer_params(params):
    """The planner tracks a request with any ``kv_transfer_params`` (PD on): a hostile value is
    a normal request, never an exception out of the scheduler side."""
    policy = PDPolicy(send=True, receive=True, secret=SECRET)
    planner = RequestPlanner(PlannerConfig(chunk_size=CHUNK, block_size=8, save_unfull_chunk=True, pd=policy))
    tracker = planner.track(FakeRequest("r", list(range(40)), kv_transfer_params=params))
    assert tracker is not None and (tracker.pd is None or isinstance(tracker.pd, PDRequest))



# ---------------------------------------------------------------------- who may make a decoder wait
class FakeClock:
    """Stands in for the scheduler side's ``time`` module: a clock moved by hand, sleeps counted."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.mark.parametrize("forge", ["unsigned", "wrong_secret", "other_prompt", "expired", "count_raised", "far_future"])
def test_unsigned_or_forged_remote_prefill_is_a_normal_request(pair, forge, caplog):
    """A client of the decoder's own API sending ``do_remote_prefill`` (no valid proxy
    signature) is served at once as a normal request: no wait, counted, one log line."""
    _, decoder = pair
    tokens = prompt(3 * CHUNK, 50)
    if forge == "unsigned":
        params = {"do_remote_prefill": True, "remote_num_tokens": len(tokens)}
    elif forge == "wrong_secret":
        params = announce(decoder, tokens, secret="another-secret-of-enough-length")
    elif forge == "other_prompt":
        params = announce(decoder, prompt(3 * CHUNK, 51))
    elif forge == "expired":
        params = announce(decoder, tokens, now=time.time() - 2 * signing.DEFAULT_TTL_S)
    elif forge == "count_raised":
        params = dict(announce(decoder, tokens), remote_num_tokens=len(tokens) - 1)
    else:
        params = announce(decoder, tokens, now=time.time() + 10 * signing.MAX_TTL_S)
    req = FakeRequest("d", list(tokens), kv_transfer_params=params)
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert decoder.scheduler.get_num_new_matched_tokens(req, 0) == 0  # answered now, not None
    c = decoder.counters()
    assert c["scheduler_pd_refused"] == 1 and c["scheduler_pd_waits"] == 0 and c["scheduler_pd_received_requests"] == 0
    assert any("served as a normal request" in r.getMessage() for r in caplog.records)


def test_many_waiting_requests_pause_the_scheduler_at_most_once_per_step(pair, monkeypatch):
    """200 signed requests whose KV never comes: one scheduler step asks for each; the
    scheduler pauses at most once per idle step, never after a busy one, looks each up at
    most once per PD_POLL_SECONDS, and at most pd_max_waiting of them wait."""
    _, decoder = pair
    clock = FakeClock()
    monkeypatch.setattr(scheduler_side, "time", clock)
    sched = decoder.scheduler.scheduler
    cap = decoder.worker.settings.config.pd_max_waiting
    lookups = []
    for name in ("lookup_keyed", "lookup_again"):  # a first lookup, and a repeated one (memo)
        real = getattr(sched.lookups, name)
        monkeypatch.setattr(sched.lookups, name, lambda *a, _real=real: lookups.append(1) or _real(*a))
    reqs = [FakeRequest(f"d{i}", prompt(2 * CHUNK, 1000 + i)) for i in range(200)]
    for r in reqs:
        r.kv_transfer_params = announce(decoder, r.prompt_token_ids)

    def step(busy: bool) -> list:
        """One scheduler step: a lookup per waiting request, then the step's metadata
        (``busy``: it scheduled tokens for other requests)."""
        answers = [sched.get_num_new_matched_tokens(r, 0) for r in reqs]
        out = sched_output()
        out.total_num_scheduled_tokens = 7 if busy else 0
        sched.build_connector_meta(out)
        return answers

    first = step(busy=False)
    assert first.count(None) == cap and first.count(0) == 200 - cap  # the rest computed at once
    assert len(clock.sleeps) <= 1
    c = decoder.counters()
    assert c["scheduler_pd_wait_refused"] == 200 - cap and c["scheduler_pd_waits"] == cap
    reqs = [r for r, a in zip(reqs, first) if a is None]  # vLLM schedules the others now
    n = len(lookups)
    step(busy=True)  # after an idle step: one pause; within PD_POLL_SECONDS: no lookups again
    assert len(lookups) == n and len(clock.sleeps) == 2
    clock.now += scheduler_side.PD_POLL_SECONDS
    step(busy=True)  # after a busy step: no pause (the step itself took time)
    assert len(clock.sleeps) == 2 and len(lookups) > n  # polled again
    clock.now += 10  # past pd_wait_timeout: every waiter falls back
    assert step(busy=False).count(None) == 0
    assert decoder.counters()["scheduler_pd_fallbacks"] == 200 and not sched._pd_waiting


def test_no_wait_while_the_remote_tier_is_down(pair, redis_server, caplog):
    """With the remote tier's breaker open (Redis killed), a signed request is computed at
    once instead of waiting pd_wait_timeout."""
    _, decoder = pair
    redis_server.kill()
    remote = next(b for b in decoder.engine.storage_manager.backends if b.tier.name == "REMOTE")
    remote.contains(key(1))  # the failed call opens the breaker
    assert not remote.available
    tokens = prompt(2 * CHUNK, 60)
    req = FakeRequest("d", list(tokens), kv_transfer_params=announce(decoder, tokens))
    with caplog.at_level(logging.WARNING, logger="lmcache"):
        assert decoder.scheduler.get_num_new_matched_tokens(req, 0) == 0
    c = decoder.counters()
    assert c["scheduler_pd_remote_down"] == 1 and c["scheduler_pd_waits"] == 0


@pytest.mark.parametrize("kv_role,pd_role,honoured", [
    ("kv_both", None, ()), ("kv_both", "both", ("send", "receive")), ("kv_producer", None, ("send",)),
    ("kv_consumer", None, ("receive",)), ("kv_both", "sender", ("send",)), ("kv_both", "receiver", ("receive",)),
])  # fmt: skip
def test_pd_role_decides_which_parameters_are_honoured(redis_server, tmp_path, kv_role, pd_role, honoured):
    extra = {} if pd_role is None else {"pd_role": pd_role}
    inst = Instance(pd_config(redis_server.url, kv_role, str(tmp_path), **extra))
    try:
        tokens = prompt(2 * CHUNK, 70)
        inst.serve(FakeRequest("p", tokens, kv_transfer_params=dict(SEND)))
        assert (inst.finished["p"] is not None) == ("send" in honoured)
        other = prompt(2 * CHUNK, 71)
        req = FakeRequest("d", other, kv_transfer_params=announce(inst, other))
        answer = inst.scheduler.get_num_new_matched_tokens(req, 0)
        assert (answer is None) == ("receive" in honoured and kv_role != "kv_producer")
    finally:
        inst.close()


def test_decoder_without_a_secret_is_refused_at_start(redis_server, tmp_path):
    cfg = fake_vllm_config(role="kv_consumer", tmp=str(tmp_path), extra={
        "lmcache.remote_url": redis_server.url, "lmcache.enable_pd": True})  # fmt: skip
    with pytest.raises(ConfigError, match="pd_secret: required on a decoder"):
        MiniVLLM(cfg)


@settings(max_examples=200, deadline=None)
@given(params=st.dictionaries(st.sampled_from(["do_remote_prefill", "remote_num_tokens", signing.DIGEST_KEY,
                                               signing.SIGNATURE_KEY, "lmcache"]), _JSON, max_size=5),
       tokens=st.lists(st.integers(0, 2**31 - 1), max_size=20))
def test_fuzz_forged_signatures_never_verify(params, tokens):
    """Any parameters a client can make up (without the secret) are refused, never an exception."""
    params = dict(params, do_remote_prefill=True)
    pd = PDRequest(send=False, receive=True)
    why = PDPolicy(send=False, receive=True, secret=SECRET).refusal(pd, params, tokens)
    assert why is not None
