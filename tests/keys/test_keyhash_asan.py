"""csrc/keyhash.c built with AddressSanitizer and UBSan and driven through every entry point
with random inputs, each result checked against a plain-Python reference (hashlib's BLAKE2b,
struct packing, dict probes). The child interpreter imports neither torch nor lmcache: only
the sanitized module, the standard library and the driver below."""

from __future__ import annotations

import pytest

_DRIVER = r"""
import array, hashlib, importlib.util, random, struct, sys
spec = importlib.util.spec_from_file_location("_keyhash", sys.argv[1])
kh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kh)
rnd = random.Random(int(sys.argv[2]))
I32 = (-2**31, 2**31 - 1)

def ref_hash(tokens, seed, chunk, partial):
    n = len(tokens)
    count = n // chunk + (1 if partial and n % chunk else 0)
    prev, out = seed, b""
    for c in range(count):
        part = tokens[c * chunk : (c + 1) * chunk]
        prev = hashlib.blake2b(prev + struct.pack(f"<{len(part)}i", *part), digest_size=16).digest()
        out += prev
    return n, out

def token(big=False):
    r = rnd.random()
    if big and r < 0.1:
        return rnd.choice([2**31, -2**31 - 1, 2**40, -2**63, 2**64])  # outside int32: declined
    if r < 0.3:
        return rnd.choice([0, 1, -1, 2**30 - 1, 2**30, -2**30, -2**30 - 1, I32[0], I32[1]])
    return rnd.randrange(-50_000, 200_000)

for _ in range(int(sys.argv[3])):
    n = rnd.choice([0, 1, 5, 16, 17, rnd.randrange(0, 3000)])
    chunk = rnd.choice([1, 3, 16, 256, rnd.randrange(1, 600)])
    partial = rnd.random() < 0.5
    seed = rnd.randbytes(16)
    big = rnd.random() < 0.2
    tokens = [token(big) for _ in range(n)]
    fits = all(I32[0] <= t <= I32[1] for t in tokens)
    want = ref_hash(tokens, seed, chunk, partial) if fits else None
    for form in (tokens, tuple(tokens)):
        assert kh.hash_chunks(form, seed, chunk, partial) == want, (n, chunk, partial)
    if fits:
        arr = array.array("i", tokens)
        assert kh.hash_chunks(arr, seed, chunk, partial) == want
        assert kh.hash_chunks(memoryview(arr.tobytes()).cast("i"), seed, chunk, partial) == want
        packed = struct.pack(f"<{n}i", *tokens)
        assert kh.tokens_int32(tokens) == bytearray(packed)
        assert kh.tokens_int32(array.array("q", tokens)) == bytearray(packed)
        if n:
            a4, a8 = array.array("i", tokens), array.array("q", tokens)
            assert kh.tokens_int32_at(a4.buffer_info()[0], n, 4) == bytearray(packed)
            assert kh.tokens_int32_at(a8.buffer_info()[0], n, 8) == bytearray(packed)
            neg = next((i for i, t in enumerate(tokens) if t < 0), n)
            assert kh.int_stats(a4.buffer_info()[0], n, 4) == (max(tokens), neg)
            assert kh.int_stats(a8.buffer_info()[0], n, 8) == (max(tokens), neg)
        other = list(tokens)
        cut = rnd.randrange(0, n + 1)
        if cut < n:
            other[cut] = other[cut] + 1 if other[cut] < I32[1] else 0
        other = other[: rnd.randrange(cut, n + 1)] if rnd.random() < 0.3 else other
        b1, b2 = struct.pack(f"<{n}i", *tokens), struct.pack(f"<{len(other)}i", *other)
        common = next((i for i, (x, y) in enumerate(zip(tokens, other)) if x != y), min(n, len(other)))
        assert kh.common_prefix(b1, b2) == common
    else:
        assert kh.tokens_int32(tokens) is None
        q = [t if -2**63 <= t < 2**63 else 0 for t in tokens]
        narrowed = kh.tokens_int32(array.array("q", q))
        if all(I32[0] <= t <= I32[1] for t in q):
            assert narrowed == bytearray(struct.pack(f"<{n}i", *q))
        else:
            assert narrowed is None
    assert kh.tokens_int32([1.5]) is None and kh.hash_chunks(["x"], seed, 4, True) is None

for bad in [(b"short", 4), (bytes(16), 0)]:
    try:
        kh.hash_chunks([1, 2], bad[0], bad[1], True)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)
for bad in [(0, 4, 4), (1, -1, 4), (1, 4, 2)]:
    try:
        kh.tokens_int32_at(*bad)
    except ValueError:
        pass
    else:
        raise AssertionError(bad)

class Key(kh.KeyBase):
    __slots__ = ("model", "chunk_hash", "extra")

kh.register_key_type(Key, (Key.model, Key.chunk_hash, Key.extra), (Key.model, Key.chunk_hash))
digests = rnd.randbytes(16 * 40)
for first in (0, 3, 39, 40, 55):
    keys = kh.make_keys(Key, ((Key.model, "m"), (Key.extra, None)), Key.chunk_hash, digests, first)
    assert len(keys) == max(0, 40 - first)
    for i, k in enumerate(keys):
        h = int.from_bytes(digests[16 * (first + i) : 16 * (first + i + 1)], "little")
        assert (k.model, k.chunk_hash, k.extra) == ("m", h, None)
        assert hash(k) == hash(("m", h))
    index = {k: i for i, k in enumerate(keys)}
    probe = list(keys)
    if probe:
        gone = rnd.randrange(len(probe))
        del index[probe[gone]]
        start = rnd.randrange(0, len(probe) + 1)
        want = gone if start <= gone else len(probe)
        assert kh.prefix_in(index, probe, start) == want
        assert kh.prefix_in(index, tuple(probe), start) == want
twin = kh.make_keys(Key, ((Key.model, "m"), (Key.extra, None)), Key.chunk_hash, digests, 0)
assert twin == kh.make_keys(Key, ((Key.model, "m"), (Key.extra, None)), Key.chunk_hash, digests, 0)
try:
    kh.make_keys(Key, ((Key.model, "m"),), Key.chunk_hash, b"x" * 15, 0)
except ValueError:
    pass
else:
    raise AssertionError("a digest buffer that is not whole 16-byte digests")
print("ok")
"""


@pytest.mark.slow
def test_asan_ubsan_build_of_the_key_helpers(tmp_path):
    """Every entry point of csrc/keyhash.c (chunk hashing from lists, tuples and int32
    buffers; token and slot scans at raw addresses; prefix and key helpers) under ASan and
    UBSan gives the plain-Python reference's answers, including tokens outside int32 (the
    module declines) and malformed arguments (ValueError)."""
    from tests.native_build import run_sanitized_extension

    run_sanitized_extension(tmp_path, "keyhash.c", "_keyhash", _DRIVER, "7", "300")
