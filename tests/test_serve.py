"""`lmforge serve`: the OpenAI-compatible API driven by the official `openai` client, on a
tiny checkpoint made here, served on a free loopback port.

Covers chat and completions (plain and streamed), models, health, stop ids / stop strings /
token limits, usage counted with the real tokenizer, seeds, every 400 naming its field, the
429 of a full queue, the 504 of a timeout, a client leaving mid-stream, and 16 concurrent
greedy clients each getting exactly the reply it gets alone (batch invariance)."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from lmforge.cli import main  # noqa: E402
from lmforge.generate import SamplingConfig, generate  # noqa: E402
from lmforge.model import Transformer, resolve_model_config  # noqa: E402
from lmforge.serve import build_server  # noqa: E402
from serve_harness import Running  # noqa: E402
from lmforge.serve.api import Server  # noqa: E402
from lmforge.serve.engine import Engine, QueueFull, Request  # noqa: E402
from lmforge.loading import load_checkpoint  # noqa: E402
from lmforge.train.checkpoint import save_checkpoint  # noqa: E402

USER = [{"role": "user", "content": "def value(self):"}]


@pytest.fixture(scope="module")
def ckpt(tiny_run, tmp_path_factory):
    """A tiny checkpoint (random weights, output scaled so greedy choices are rarely near ties)."""
    cfg, tok = tiny_run
    model = Transformer(resolve_model_config(cfg.model, tok.contract))
    model.reset_parameters(seed=0)
    with torch.no_grad():
        model.output.weight.mul_(20)
    return save_checkpoint(tmp_path_factory.mktemp("serve") / "run", 1, model, cfg, tok.folder)


@pytest.fixture(scope="module")
def loaded(ckpt):
    model, tok, _, _ = load_checkpoint(ckpt)
    return model, tok


@pytest.fixture(scope="module")
def served(loaded):
    model, tok = loaded
    run = Running(build_server(model, tok, "tiny", max_batch=16, max_queue=64, max_tokens=64))
    yield run
    run.stop()


@pytest.fixture(scope="module")
def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="unused", max_retries=0, timeout=60,
                         default_headers={"Connection": "close"})  # no pooled connection cut as it is reused


def greedy_alone(model, tok, prompt_ids, n):
    """What `generate` gives for one prompt (the reference the server must match)."""
    ids = generate(model, [prompt_ids], [tok.im_end_id, tok.eos_id], SamplingConfig(max_new_tokens=n, greedy=True),
                   tok.pad_id)[0]
    stopped = bool(ids) and ids[-1] in (tok.im_end_id, tok.eos_id)
    return tok.decode(ids[:-1] if stopped else ids), len(ids), "stop" if stopped else "length"


def post(url: str, data: bytes | str, timeout: float = 30) -> tuple[int, dict]:
    body = data.encode() if isinstance(data, str) else data
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# -- the happy paths ------------------------------------------------------------------------------
def test_models_and_health(client, served):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    with urllib.request.urlopen(served.url + "/health", timeout=10) as r:
        health = json.loads(r.read())
    assert health["status"] == "ok" and health["max_batch"] == 16


def test_chat_matches_generate_and_counts_usage(client, loaded):
    model, tok = loaded
    prompt = tok.render_chat(USER, add_generation_prompt=True).ids
    want, n_new, reason = greedy_alone(model, tok, prompt, 20)
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=20, temperature=0)
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content == want
    assert c.finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n_new)
    assert r.usage.total_tokens == len(prompt) + n_new


def test_chat_stream_equals_non_stream(client):
    kw = dict(model="tiny", messages=USER, max_tokens=20, temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == full.choices[0].message.content
    finals = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_stream_ends_with_done(served):
    req = urllib.request.Request(served.url + "/v1/chat/completions",
                                 json.dumps({"messages": USER, "max_tokens": 5, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        events = [e for e in r.read().decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[0][6:])["object"] == "chat.completion.chunk"


def test_completions_plain_and_streamed(client, loaded):
    model, tok = loaded
    prompt = [tok.bos_id, *tok.encode("def ")]
    want, n_new, reason = greedy_alone(model, tok, prompt, 12)
    r = client.completions.create(model="tiny", prompt="def ", max_tokens=12, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt), n_new)
    streamed = "".join(ch.choices[0].text for ch in
                       client.completions.create(model="tiny", prompt="def ", max_tokens=12, temperature=0,
                                                 stream=True))
    assert streamed == want


def test_length_and_stop_strings(client):
    r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=3, temperature=0)
    if r.choices[0].finish_reason == "length":
        assert r.usage.completion_tokens == 3
    full = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=0)
    text = full.choices[0].message.content
    if len(text) < 4:
        pytest.skip("the tiny model's greedy reply is too short to cut")
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = text[:text.find(stop)]
    for stream in (False, True):
        r = client.chat.completions.create(model="tiny", messages=USER, max_tokens=30, temperature=0, stop=[stop],
                                           stream=stream)
        if stream:
            chunks = list(r)
            got = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            reason = [ch.choices[0].finish_reason for ch in chunks if ch.choices[0].finish_reason][0]
        else:
            got, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert (got, reason) == (cut, "stop")


def test_seeded_sampling_repeats(client):
    kw = dict(model="tiny", messages=USER, max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


# -- errors ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(messages=[{"role": "robot", "content": "hi"}]), "messages"),
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": 3}]), "messages"),
    (dict(messages=USER, max_tokens=0), "max_tokens"),
    (dict(messages=USER, max_tokens=65), "max_tokens"),  # above the server's --max-tokens 64
    (dict(messages=USER, max_tokens=-1), "max_tokens"),
    (dict(messages=[{"role": "user", "content": "x " * 400}]), "messages"),  # longer than the context
    (dict(messages=USER, temperature="hot"), "temperature"),
    (dict(messages=USER, temperature=-0.5), "temperature"),  # the limits of SamplingConfig.validate
    (dict(messages=USER, temperature=5000), "temperature"),  # its upper bound (config.BOUNDS)
    (dict(messages=USER, top_p=0), "top_p"),
    (dict(messages=USER, n=2), "n"),
    (dict(messages=USER, stop=[1]), "stop"),
    (dict(messages=USER, seed=1.5), "seed"),
])
def test_bad_chat_requests_get_400_naming_the_field(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", **kw)
    err = info.value.response.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error"
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


def test_prompt_plus_max_tokens_beyond_context(client, loaded):
    model, tok = loaded
    context = model.config.max_seq_len
    text = "def"
    while len(tok.encode(text)) + 1 <= context - 64:  # a prompt that fits, but not with 64 new tokens
        text += " value"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt=text, max_tokens=64)
    err = info.value.response.json()["error"]
    assert err["param"] == "max_tokens" and err["code"] == "context_length_exceeded"
    assert str(context) in err["message"]


@pytest.mark.parametrize("data, param", [
    ("{not json", None), ("[1, 2]", None), ('{"prompt": 5}', "prompt"), ('{"messages": "hi"}', "messages"),
    ('{"prompt": "x", "stream": "yes"}', "stream"),
])
def test_malformed_bodies(served, data, param):
    path = "/v1/chat/completions" if "messages" in data else "/v1/completions"
    status, body = post(served.url + path, data)
    assert status == 400 and body["error"]["param"] == param and body["error"]["message"]


def test_unknown_route_and_method(served):
    status, body = post(served.url + "/v1/nothing", "{}")
    assert status == 404 and body["error"]["code"] == "not_found"
    status, body = post(served.url + "/v1/models", "{}")
    assert status == 405


def test_full_queue_gets_429(loaded):
    model, tok = loaded
    engine = Engine(model, tok, max_batch=1, max_queue=1)  # not started: nothing leaves the queue
    engine.submit(Request([tok.bos_id], 1, lambda *e: None))
    with pytest.raises(QueueFull):
        engine.submit(Request([tok.bos_id], 1, lambda *e: None))
    run = Running(Server(engine, "tiny"))
    try:
        status, body = post(run.url + "/v1/completions", json.dumps({"prompt": "def", "max_tokens": 2}))
        assert status == 429 and body["error"]["type"] == "rate_limit_error" and "queue is full" in body["error"]["message"]
    finally:
        run.stop()


def test_timeout_gets_504_and_the_server_lives_on(loaded):
    model, tok = loaded
    run = Running(build_server(model, tok, "tiny", timeout_s=1e-6))
    try:
        status, body = post(run.url + "/v1/completions", json.dumps({"prompt": "def", "max_tokens": 30}))
        assert status == 504 and body["error"]["type"] == "timeout"
        assert run.server.engine.stats()["running"] == 0
    finally:
        run.stop()


def test_client_leaving_mid_stream_frees_its_row(loaded):
    model, tok = loaded
    engine = Engine(model, tok, max_batch=2, stop_ids=())  # never stops by itself
    real = model.decode_step

    def slow(*a, **k):  # 100 tokens take about 2 s: long enough to leave in the middle
        time.sleep(0.02)
        return real(*a, **k)

    engine.model = type("Slow", (), {"decode_step": staticmethod(slow), "hidden": model.hidden,
                                     "logits": model.logits})()
    run = Running(Server(engine.start(), "tiny"))
    try:
        c = openai.OpenAI(base_url=run.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        stream = c.completions.create(model="tiny", prompt="def", max_tokens=100, stream=True, temperature=0)
        next(iter(stream))
        assert engine.stats()["running"] == 1
        stream.close()
        for _ in range(100):  # bounded: up to 5 s
            if engine.stats()["running"] == 0:
                break
            time.sleep(0.05)
        assert engine.stats()["running"] == 0
        assert engine.steps < 90  # it left long before its 100 tokens
    finally:
        run.stop()


# -- batching ---------------------------------------------------------------------------------------
def test_16_concurrent_greedy_clients_get_their_alone_replies(client, served, loaded):
    """Each of 16 different chats gets, when all are sent at once, exactly the reply it gets
    alone: the engine is batch-invariant (see serve/engine.py), so no near-tie excuse is needed."""
    model, tok = loaded
    asks = []
    for i in range(16):  # prompts of 10 to ~100 tokens: rows of the batch attend over different spans
        reps = (i % 8) * 8
        while len(tok.render_chat(msgs := [{"role": "user", "content": f"def f{i}(x):" + " return x" * reps}],
                                  add_generation_prompt=True).ids) > model.config.max_seq_len - 24:
            reps -= 1
        asks.append(msgs)
    assert max(len(tok.render_chat(a, add_generation_prompt=True).ids) for a in asks) > 64

    def ask(msgs):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=24, temperature=0)
        return r.choices[0].message.content, r.usage.completion_tokens

    alone = [ask(m) for m in asks]
    together: list = [None] * 16
    peak = {"n": 0}
    stop = threading.Event()

    def watch():  # the engine's batch size while the clients run
        while not stop.is_set():
            peak["n"] = max(peak["n"], served.server.engine.stats()["running"])
            time.sleep(0.002)

    def run(i):
        together[i] = ask(asks[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    stop.set()
    watcher.join()
    assert together == alone
    assert peak["n"] > 1  # requests really shared decode steps
    assert len({a for a, _ in alone}) > 1  # and the replies differ from one another


# -- the command line -------------------------------------------------------------------------------
def test_serve_cli_refuses_bad_input(ckpt, capsys):
    assert main(["serve", "--checkpoint", str(ckpt), "--port", "70000"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --port = 70000")
    assert main(["serve", "--checkpoint", str(ckpt), "--port", "0", "--max-batch", "0"]) == 2
    assert "--max-batch = 0" in capsys.readouterr().err


def test_engine_survives_a_failing_prefill(loaded):
    """An exception inside the engine fails that request with an error event; the next one runs."""
    model, tok = loaded
    engine = Engine(model, tok, max_batch=2)
    calls = {"n": 0}

    def hidden(*a, **k):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return model.hidden(*a, **k)

    engine.model = type("Flaky", (), {"decode_step": model.decode_step, "hidden": staticmethod(hidden),
                                      "logits": model.logits})()
    engine.start()
    try:
        events: list = []
        done = threading.Event()

        def emit(*e):
            events.append(e)
            if e[0] != "delta":
                done.set()

        for expect in ("error", "done"):
            events.clear()
            done.clear()
            engine.submit(Request([tok.bos_id, *tok.encode("def")], 4, emit, temperature=0))
            assert done.wait(timeout=30)
            assert events[-1][0] == expect
    finally:
        engine.close()
