"""The gateway's parts that need no server: usage taps and rate limits (in this process,
and in Redis shared by several processes)."""

import asyncio
import json

from capyctl.gateway.usage import LocalLimiter, RedisRateLimiter, UsageTap


def test_the_tap_finds_usage_in_json_streams_and_responses():
    answer = json.dumps({"id": "chatcmpl-1", "choices": [], "usage": {
        "prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}).encode()  # fmt: skip
    tap = UsageTap()
    for i in range(0, len(answer), 9):  # split anywhere, even inside a number
        tap.feed(answer[i : i + 9])
    assert tap.tokens() == (5, 7)

    stream = UsageTap()
    for n in range(2000):  # a long stream: only its tail is kept, and it is enough
        stream.feed(b'data: {"choices":[{"delta":{"content":"tok%d"}}],"usage":null}\n\n' % n)
    stream.feed(b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2000}}\n\n')
    stream.feed(b"data: [DONE]\n\n")
    assert stream.tokens() == (3, 2000)

    responses = UsageTap(want_response_id=True)
    created = {"type": "response.created", "response": {"id": "resp_abc123", "usage": None}}
    responses.feed(b"event: response.created\ndata: " + json.dumps(created).encode() + b"\n\n")
    assert responses.response_id == "resp_abc123"
    done = {"type": "response.completed", "response": {"id": "resp_abc123", "output": [
        {"id": "msg_1", "content": [{"text": "x" * 20000}]}], "usage": {
        "input_tokens": 4, "output_tokens": 9, "total_tokens": 13}}}  # fmt: skip
    responses.feed(b"event: response.completed\ndata: " + json.dumps(done).encode() + b"\n\n")
    assert responses.tokens() == (4, 9)
    assert UsageTap().tokens() == (0, 0)
    no_usage = UsageTap()
    no_usage.feed(b'data: {"choices":[],"usage":null}\n\n')
    assert no_usage.tokens() == (0, 0)


async def test_limits_in_this_process():
    limiter = LocalLimiter()
    assert await limiter.retry_after(1, None) is None
    assert await limiter.retry_after(1, 2) is None
    assert await limiter.retry_after(1, 2) is None
    wait = await limiter.retry_after(1, 2)
    assert wait is not None
    assert 58 < wait <= 60
    assert await limiter.retry_after(2, 2) is None  # per key


async def test_limits_in_redis_are_shared_by_every_process(redis_url):
    first = RedisRateLimiter(redis_url)
    second = RedisRateLimiter(redis_url)  # another API process
    try:
        results = await asyncio.gather(
            *(limiter.retry_after(41, 5) for limiter in (first, second) * 4)
        )
        assert sum(r is None for r in results) == 5  # 8 tries, 5 allowed between the two
        refused = [r for r in results if r is not None]
        assert all(58 < r <= 60 for r in refused)
        assert await second.retry_after(42, 5) is None
    finally:
        await first.close()
        await second.close()


async def test_limits_hold_in_this_process_while_redis_is_down(own_redis):
    """Redis stopped: every limited key's request failed (ConnectionError, a bare 500).
    Now the process counts alone until Redis is back: limits still hold, per process.
    (Once a call did not answer, none is made until the process's in-flight check-in,
    which keeps trying, finds Redis back.)"""
    from capyctl.scheduler import redislink, requests_in_progress

    limiter = RedisRateLimiter(own_redis.url)
    checking_in = requests_in_progress.RedisInFlight(own_redis.url)  # as in every API process
    busy: list[tuple[tuple[str, int], int | None]] = [(("key", 43), 1)]
    try:
        assert await limiter.retry_after(43, 2) is None
        own_redis.stop()
        assert await limiter.retry_after(43, 2) is None  # this process's own window
        assert await limiter.retry_after(43, 2) is None
        assert await limiter.retry_after(43, 2) is not None  # the third in a minute here
        since = limiter.down_since
        assert since is not None
        assert await limiter.enter(busy, "m1") is None
        assert await limiter.enter(busy, "m2") == 0  # one at a time holds too
        await limiter.leave(busy, "m1")
        assert await limiter.enter(busy, "m3") is None
        own_redis.start()
        while not redislink.link(own_redis.url).answers():
            await asyncio.sleep(0.05)
        await limiter.leave(busy, "m3")  # entered here: left here
        assert await limiter.enter(busy, "m4") is None  # Redis counts again
        assert limiter.down_since is None
        assert await limiter.enter(busy, "m5") == 0
    finally:
        checking_in.stop()
        await limiter.close()


async def test_the_warm_cache_reads_once_and_keeps_names_in_use_fresh(monkeypatch):
    from capyctl.gateway import cache

    reads: list[list[str]] = []
    values = {"a": 1, "b": 2}

    def fetch_many(names):
        reads.append(sorted(names))
        return {n: values[n] for n in names if n in values}

    warm = cache.WarmCache(fetch_many, soft=0.2, hard=1.0)
    try:
        got = await asyncio.gather(*(warm.get("a") for _ in range(50)))
        assert got == [1] * 50
        assert len(reads) <= 2  # one read for fifty waiters (and perhaps the warmer's)
        assert await warm.get("ghost") is None
        values["a"] = 10
        await asyncio.sleep(0.6)  # the background read sees the change, in one batch
        assert await warm.get("a") == 10
        assert ["a", "ghost"] in reads
        values["a"] = 11
        assert await warm.get("a", fresh=True) == 11  # fresh: a read of its own, now
        monkeypatch.setattr(cache, "KEEP_WARM_SECONDS", 0.0)  # names unused are let go
        await asyncio.sleep(0.6)
        assert warm._used_at == {}
    finally:
        await warm.close()


def test_the_model_of_a_multipart_form_is_its_own_field():
    from capyctl.gateway.admission import _model_of, _rename_model

    boundary = b"------------------------d74496d66958873e"
    audio = b"RIFF\r\n\r\nnot a model\r\n\r\n" + bytes(range(256))
    form = (
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="model"\r\n\r\nchat\r\n'
        b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="a.wav"'
        b"\r\nContent-Type: audio/wav\r\n\r\n" + audio + b"\r\n--" + boundary + b"--\r\n"
    )
    kind = b"multipart/form-data; boundary=" + boundary
    assert _model_of(kind, form) == ("chat", None)
    renamed = _rename_model(form, None, "served-name")
    assert _model_of(kind, renamed) == ("served-name", None)
    assert renamed.endswith(audio + b"\r\n--" + boundary + b"--\r\n")  # the upload untouched
