"""The server, exercised through the real ``openai`` client and raw HTTP, on tiny models."""
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch

from fuzzyspec.api import ModelPair
from serve_util import Running

PROMPTS = str(Path(__file__).parents[1] / "fixtures" / "prompts.jsonl")


@pytest.fixture(scope="module")
def server(tiny_dirs):
    running = Running(tiny_dirs)
    yield running
    running.stop()


def test_models_health_and_metrics(server):
    assert server.client.models.list().data[0].id == "tiny"
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    text = httpx.get(server.url + "/metrics").text
    for name in ("requests_total", "generated_tokens_total", "acceptance_rate", "tokens_per_second", "queue_depth",
                 "active_requests"):
        assert f"# TYPE fuzzyspec_{name} " in text


def test_completion_and_chat_equal_the_library(server):
    done = server.client.completions.create(model="tiny", prompt="hello there", max_tokens=9, temperature=0)
    alone = server.pair.generate("hello there", chat=False, max_new_tokens=9, temperature=0)  # the same defaults
    assert done.choices[0].text == alone.text and done.usage.completion_tokens == len(alone.tokens)
    assert done.choices[0].finish_reason == alone.finish_reason and done.object == "text_completion"
    chat = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=7, temperature=0, extra_body={"method": "sd"})
    alone = server.pair.generate("hi", max_new_tokens=7, method="sd", temperature=0)
    assert chat.choices[0].message.content == alone.text and chat.choices[0].message.role == "assistant"


def test_a_chats_next_turn_is_served_from_what_the_last_one_left(server):
    """Each turn of a chat sends the whole conversation: the server computes it from where it differs from what a
    free slot holds (the last turn's prompt and answer), says so in OpenAI's ``cached_tokens``, and answers as
    the library does from scratch."""
    messages = [{"role": "user", "content": "Tell me about rivers and the sea."}]
    options = {"max_tokens": 8, "temperature": 0, "extra_body": {"method": "ar"}}
    first = server.client.chat.completions.create(model="tiny", messages=messages, **options)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And lakes?"}]
    second = server.client.chat.completions.create(model="tiny", messages=messages, **options)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1
    assert second.choices[0].message.content == server.pair.generate(messages, max_new_tokens=8, method="ar",
                                                                     temperature=0).text


def test_streaming_gives_the_same_text(server):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    whole = server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    chunks = list(server.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12,
                                                        temperature=0, stream=True,
                                                        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    streamed = "".join(c.choices[0].text for c in server.client.completions.create(
        model="tiny", prompt="count: 1 2 3", max_tokens=10, temperature=0, stream=True))
    assert streamed == server.client.completions.create(model="tiny", prompt="count: 1 2 3", max_tokens=10,
                                                        temperature=0).choices[0].text


def test_per_request_thresholds(server):
    def acceptance(**extra):  # drafting every step (the cost schedule may not draft with tiny models)
        done = server.client.completions.create(model="tiny", prompt="the cat sat", max_tokens=16, temperature=0,
                                                extra_body={"gamma_schedule": "constant"} | extra)
        return done.model_extra["fuzzyspec"]
    low = acceptance(method="fsd", fsd_threshold=0.0)
    high = acceptance(method="fsd", fsd_threshold=10.0, fsd_divergence="js")
    assert low["threshold"] == 0.0 and high["threshold"] == 10.0
    assert high["acceptance_rate"] == 1.0 and low["acceptance_rate"] < 1.0
    assert acceptance(method="ar")["acceptance_rate"] is None
    assert acceptance(fsd_threshold=0.5)["threshold"] is None  # the default rule, sd, reads no threshold


def test_target_acceptance_is_calibrated(server, tmp_path, monkeypatch):
    from fuzzyspec.eval.tasks import FreeForm
    monkeypatch.setenv("FUZZYSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr("fuzzyspec.eval.tasks.get_task", lambda name, data=None: FreeForm(PROMPTS))
    monkeypatch.setattr("fuzzyspec.eval.calibrate.CALIBRATION_PROMPTS", 3)
    done = server.client.completions.create(model="tiny", prompt="a b c", max_tokens=8, temperature=0,
                                            extra_body={"target_acceptance": 0.5})
    (saved,) = json.loads((tmp_path / "calibrations.json").read_text()).values()
    assert done.model_extra["fuzzyspec"]["threshold"] == saved["threshold"]


def test_32_concurrent_streams_match_single_requests(server):
    requests = [dict(prompt=f"request {i}: " + "word " * (i % 5), max_tokens=4 + i % 13,
                     method=["ar", "sd", "fsd", "fsd-hybrid"][i % 4], threshold=[0.1, 0.3, 0.6][i % 3])
                for i in range(32)]

    def ask(r, stream):
        extra = {"method": r["method"], "fsd_threshold": r["threshold"]}
        if r["method"].startswith("fsd"):
            # A fuzzy rule's text depends on how many tokens are drafted, which the cost schedule decides from
            # timings measured as decoding runs and from the batch: fixed sizes make it the same alone and
            # together (lossless rows keep the cost schedule, whose sizes cannot change their text).
            extra["gamma_schedule"] = "constant"
        if not stream:
            done = server.client.completions.create(model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"],
                                                    temperature=0, extra_body=extra)
            return done.choices[0].text, done.usage.completion_tokens, done.choices[0].finish_reason
        chunks = list(server.client.completions.create(model="tiny", prompt=r["prompt"], max_tokens=r["max_tokens"],
                                                       temperature=0, stream=True, extra_body=extra,
                                                       stream_options={"include_usage": True}))
        return ("".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens,
                [c.choices[0].finish_reason for c in chunks if c.choices][-1])

    alone = [ask(r, stream=False) for r in requests]
    with ThreadPoolExecutor(32) as pool:
        together = list(pool.map(lambda r: ask(r, stream=True), requests))
    assert together == alone
    for r, (_, tokens, reason) in zip(requests, together):
        assert tokens == r["max_tokens"] if reason == "length" else tokens < r["max_tokens"]
    assert server.metric("active_requests") == {"fuzzyspec_active_requests": 0.0}


@pytest.mark.parametrize("body, status, fragment", [
    ({"model": "tiny", "prompt": "x", "max_tokens": "lots"}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "x", "max_tokens": -3}, 400, "max_tokens must be >= 1"),
    ({"model": "gpt-9", "prompt": "x"}, 404, "does not exist"),
    ({"model": "tiny"}, 400, "prompt"),
    ({"model": "tiny", "prompt": "x", "n": 99}, 400, "n must be in"),
    ({"model": "tiny", "prompt": "x", "method": "beam"}, 400, "method must be one of"),
    ({"model": "tiny", "prompt": "x", "fsd_threshold": -1}, 400, "fsd_threshold must be"),
    ({"model": "tiny", "prompt": "x", "fsd_divergence": "cosine"}, 400, "fsd_divergence 'cosine' is unknown"),
    ({"model": "tiny", "prompt": "x", "target_acceptance": 2}, 400, "target_acceptance must be in (0, 1)"),
    ({"model": "tiny", "prompt": "x", "temperature": 5}, 400, "temperature"),
    ({"model": "tiny", "prompt": "word " * 600}, 400, "exceeds the model's context"),
    ({"model": "tiny", "prompt": ""}, 400, "empty"),
])
def test_bad_requests_get_4xx_and_the_server_keeps_serving(server, body, status, fragment):
    reply = httpx.post(server.url + "/v1/completions", json=body)
    assert reply.status_code == status
    error = reply.json()["error"]
    assert fragment in error["message"] and error["type"]
    assert server.client.completions.create(model="tiny", prompt="still here?", max_tokens=2).choices


def test_malformed_json_and_chat_shapes(server):
    reply = httpx.post(server.url + "/v1/chat/completions", content=b"{not json",
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "JSON" in reply.json()["error"]["message"]
    reply = httpx.post(server.url + "/v1/chat/completions", json={"model": "tiny", "messages": []})
    assert reply.status_code == 400
    reply = httpx.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert reply.status_code == 400
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    for path, body in (("chat/completions", b'{"model": "tiny", "messages": [{"role": "user", "content": "a \\udc80"}]}'),
                       ("completions", b'{"model": "tiny", "prompt": "half a pair: \\ud800"}')):
        reply = httpx.post(f"{server.url}/v1/{path}", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400 and "not valid UTF-8" in reply.json()["error"]["message"], reply.text


def test_a_client_leaving_mid_stream_frees_its_row(server):
    before = server.metric("requests_total").get('fuzzyspec_requests_total{outcome="cancelled"}', 0)
    server.slow_down(0.02)
    try:
        with httpx.stream("POST", server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "go on", "max_tokens": 400, "stream": True}) as reply:
            lines = reply.iter_lines()
            assert next(lines).startswith("data: ")
        deadline = time.time() + 20
        while server.metric("active_requests")["fuzzyspec_active_requests"] > 0:
            assert time.time() < deadline, "the abandoned request kept its row"
            time.sleep(0.1)
    finally:
        server.server.scheduler.engine.step = type(server.server.scheduler.engine).step.__get__(
            server.server.scheduler.engine)
    after = server.metric("requests_total")['fuzzyspec_requests_total{outcome="cancelled"}']
    assert after == before + 1
    assert server.client.completions.create(model="tiny", prompt="next", max_tokens=3).usage.completion_tokens


def test_a_full_queue_answers_429_and_slow_requests_504(tiny_dirs):
    running = Running(tiny_dirs, max_batch=1, max_queue=1, request_timeout=1.5)
    try:
        running.slow_down(0.1)
        first = httpx.stream("POST", running.url + "/v1/completions",
                             json={"model": "tiny", "prompt": "a", "max_tokens": 40, "stream": True}, timeout=30)
        reply = first.__enter__()
        lines = reply.iter_lines()
        next(lines)  # the first request holds the only row
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(httpx.post, running.url + "/v1/completions",
                                 json={"model": "tiny", "prompt": "b", "max_tokens": 40}, timeout=30)
            time.sleep(0.3)
            with pytest.raises(openai.RateLimitError):
                running.client.completions.create(model="tiny", prompt="c", max_tokens=2)
            assert queued.result().status_code == 504
        rest = "\n".join(lines)
        first.__exit__(None, None, None)
        assert '"code": "timeout"' in rest and rest.rstrip().endswith("data: [DONE]")
        counts = running.metric("requests_total")
        assert counts['fuzzyspec_requests_total{outcome="rejected"}'] == 1
        assert counts['fuzzyspec_requests_total{outcome="timeout"}'] == 2
    finally:
        running.stop()


@pytest.mark.parametrize("method", ["fsd", "ar", "sd", "fsd-hybrid"])
def test_an_infinite_threshold_is_served_and_reported(server, method):
    """fsd at T = inf runs the drafter alone; every method answers 200, the fuzzy ones reporting the threshold
    as "inf" (JSON has no infinity), the others none (they read no threshold)."""
    reply = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": "x", "max_tokens": 5, '
                       b'"method": "' + method.encode() + b'", "fsd_threshold": Infinity}',
                       headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["fuzzyspec"]["threshold"] == ("inf" if method in ("fsd", "fsd-hybrid") else None)
    assert body["usage"]["completion_tokens"] >= 1
    if method == "fsd":
        assert body["fuzzyspec"]["target_forwards"] == 0


def test_a_client_leaving_a_plain_request_frees_its_row(tiny_dirs):
    running = Running(tiny_dirs, max_batch=1, max_queue=1)
    try:
        running.slow_down(0.05)
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 0.5 s and closes the connection
            httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 400},
                       timeout=0.5)
        deadline = time.time() + 20
        while running.metric("requests_total").get('fuzzyspec_requests_total{outcome="cancelled"}', 0) < 1:
            assert time.time() < deadline, "the abandoned request kept its row"
            time.sleep(0.1)
        assert running.metric("active_requests")["fuzzyspec_active_requests"] == 0
    finally:
        running.stop()


@pytest.mark.parametrize("body, param", [
    ({"logprobs": 9}, "logprobs"), ({"best_of": 3}, "best_of"), ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"logit_bias": {"5": 1}}, "logit_bias"), ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"frobnicate": 1}, "frobnicate"),
])
def test_unsupported_fields_are_refused_by_name_never_ignored(server, body, param):
    reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


def test_fields_at_their_off_values_and_labels_are_accepted(server):
    reply = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": "x", "max_tokens": 2, "logprobs": None, "echo": False, "presence_penalty": 0,
        "frequency_penalty": 0.0, "n": 1, "user": "someone", "metadata": {"a": "b"}})
    assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("body, param", [
    ({"stream": "yes"}, "stream"), ({"method": ""}, "method"), ({"fsd_divergence": ""}, "fsd_divergence"),
    ({"gamma": 2.5}, "gamma"), ({"tree": "on"}, "tree"), ({"max_tokens": -3}, "max_tokens"),
    ({"fsd_threshold": -1}, "fsd_threshold"),
])
def test_wrong_types_and_empty_names_are_refused_with_their_field(server, body, param):
    reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", **body})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == param


@pytest.mark.parametrize("method, path, content, status", [
    ("GET", "/v1/nothing", None, 404), ("GET", "/v1/completions", None, 405),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe"}', 400),
    ("POST", "/v1/completions", b'{"a":' * 5000 + b"1" + b"}" * 5000, 400),
    ("POST", "/v1/completions", b'{"model": "tiny", "prompt": "' + b"x" * 1_100_000 + b'"}', 413),
])
def test_every_error_has_openais_shape(server, method, path, content, status):
    reply = httpx.request(method, server.url + path, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == status
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert server.client.completions.create(model="tiny", prompt="still here?", max_tokens=2).choices


def test_eagle_heads_trees_and_prompt_lookup_are_served(tiny_dirs, tmp_path):
    from fuzzyspec.drafters.eagle3 import make_eagle3
    from fuzzyspec.core.vocab import DraftVocab
    pair = ModelPair.load(tiny_dirs["target"], None, "float32")
    make_eagle3(pair.target, DraftVocab(torch.arange(0, pair.vocab_size, 2), pair.vocab_size)).save(tmp_path / "head")
    for draft, extra in [(f"eagle:{tmp_path / 'head'}", {"tree": True}), (f"eagle:{tmp_path / 'head'}", {}),
                         ("lookup", {})]:
        running = Running(tiny_dirs, draft=draft)
        try:
            for options in ({"method": "sd", **extra}, {"method": "fsd", "fsd_threshold": 0.5, **extra}):
                done = httpx.post(running.url + "/v1/completions", json={
                    "model": "tiny", "prompt": "w1 w2 w1 w2", "max_tokens": 8, "temperature": 0, **options})
                assert done.status_code == 200, done.text
                if options["method"] == "sd":
                    alone = running.pair.generate("w1 w2 w1 w2", chat=False, method="ar", max_new_tokens=8)
                    assert done.json()["choices"][0]["text"] == alone.text
        finally:
            running.stop()


def test_metrics_have_histograms_and_process_series(server):
    server.client.completions.create(model="tiny", prompt="measure me", max_tokens=4)
    text = httpx.get(server.url + "/metrics").text
    for series in ("fuzzyspec_request_latency_seconds_bucket", "fuzzyspec_time_to_first_token_seconds_count",
                   "fuzzyspec_tokens_per_target_pass_sum", "fuzzyspec_batch_size_bucket",
                   "fuzzyspec_requests_total", "fuzzyspec_queue_depth", "process_cpu_seconds_total"):
        assert series in text, series
    assert server.metric("request_latency_seconds_count")["fuzzyspec_request_latency_seconds_count"] >= 1


def test_a_failing_step_is_logged_and_fails_only_its_requests(tiny_dirs, caplog):
    running = Running(tiny_dirs)
    try:
        engine = running.server.scheduler

        def broken():
            raise RuntimeError("step exploded")
        engine.engine.step = broken
        with caplog.at_level("ERROR", logger="fuzzyspec"):
            reply = httpx.post(running.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3})
        assert reply.status_code == 500 and "step exploded" in reply.json()["error"]["message"]
        assert any("decoding step failed" in r.message and r.exc_info for r in caplog.records)
        assert httpx.get(running.url + "/health").status_code == 200
    finally:
        running.stop()


def target_logprobs(pair, prompt_ids, tokens):
    """The target's own log-probabilities of ``tokens`` after ``prompt_ids`` (one plain forward)."""
    with torch.no_grad():
        sequence = torch.tensor([list(prompt_ids) + list(tokens)])
        log_p = pair.target(sequence).logits[0].float().log_softmax(-1)
    return [float(log_p[len(prompt_ids) - 1 + i, token]) for i, token in enumerate(tokens)]


def test_completion_logprobs_are_the_targets_and_echo_adds_the_prompt(server):
    ids = server.pair.tokenizer("w1 w2 w3", return_tensors=None)["input_ids"]
    done = httpx.post(server.url + "/v1/completions", json={
        "model": "tiny", "prompt": ids, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}).json()
    choice = done["choices"][0]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + done["usage"]["completion_tokens"]
    assert lp["token_logprobs"][0] is None and len(lp["top_logprobs"][1]) == 2
    generated = server.pair.tokenizer(choice["text"], return_tensors=None)["input_ids"][len(ids):]
    expected = target_logprobs(server.pair, ids, generated)
    assert lp["token_logprobs"][len(ids):] == pytest.approx(expected, abs=1e-3)
    assert lp["token_logprobs"][1:len(ids)] == pytest.approx(target_logprobs(server.pair, ids[:1], ids[1:]), abs=1e-3)
    assert choice["text"].startswith(server.pair.tokenizer.decode(ids))


def test_chat_logprobs_have_openais_shape(server):
    done = server.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=5, temperature=0, logprobs=True, top_logprobs=3)
    content = done.choices[0].logprobs.content
    assert len(content) == done.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob <= 0 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    streamed = list(server.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0, logprobs=True,
        stream=True))
    tokens = [c.token for chunk in streamed for choice in chunk.choices if choice.logprobs
              for c in choice.logprobs.content]
    assert tokens == [c.token for c in content]


def test_lists_of_prompts_token_ids_and_n_choices(server):
    # Constant draft sizes: under the cost schedule a row's sizes (so its random draws) follow the measured costs,
    # and a batch's rows are planned together (README, "Guarantees and limits").
    constant = {"gamma_schedule": "constant"}
    done = server.client.completions.create(model="tiny", prompt=["w1 w2", "w3 w4 w5"], max_tokens=4, n=2,
                                            temperature=0.9, seed=5, extra_body=constant)
    assert [c.index for c in done.choices] == [0, 1, 2, 3]
    alone = server.client.completions.create(model="tiny", prompt="w3 w4 w5", max_tokens=4, temperature=0.9, seed=5,
                                             extra_body=constant)
    assert done.choices[2].text == alone.choices[0].text  # the first draw of the second prompt, same seed
    greedy = server.client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, temperature=0)
    assert len(greedy.choices) == 2 and greedy.usage.prompt_tokens == 5
    streamed = list(server.client.completions.create(model="tiny", prompt=["w1", "w2"], max_tokens=3, temperature=0,
                                                     stream=True))
    assert {c.index for chunk in streamed for c in chunk.choices} == {0, 1}
    bad = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [5, 10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"


def test_a_model_can_be_read_by_id(server):
    assert httpx.get(server.url + "/v1/models/tiny").json()["id"] == "tiny"
    missing = httpx.get(server.url + "/v1/models/gpt-9")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_a_compiled_server_compiles_before_its_first_request(tiny_dirs):
    """`serve --compile` warms up: the shapes of a default request are compiled before a client waits."""
    from fuzzyspec.serve.app import ServeConfig, Server

    pair = ModelPair.load(tiny_dirs["target"], tiny_dirs["draft"], "float32", compile=True)
    pair.step.widths = (8,)  # one compiled shape: every step pads to 8 tokens
    compiled: list[tuple[int, int]] = []
    pair.step.on_compile = lambda rows, width: compiled.append((rows, width))
    server = Server(pair, ServeConfig(model_name="tiny", defaults={"temperature": 0.0, "method": "sd", "gamma": 4,
                                                                   "gamma_schedule": "constant"}))
    server.warm_up()
    assert (1, 8) in compiled  # a verification of 4 drafts, padded to width 8


def test_a_compiled_servers_new_batch_size_runs_eagerly_and_its_graphs_compile_while_idle(tiny_dirs, tmp_path,
                                                                                          monkeypatch):
    """After the warm-up, a batch whose graphs no process has kept does not wait for them: it decodes eagerly (the
    same tokens), and the server compiles those graphs once it is idle."""
    from fuzzyspec.core import kept
    from fuzzyspec.serve.app import ServeConfig, Server
    from fuzzyspec.serve.scheduler import Request

    monkeypatch.setattr(kept, "folder", lambda: tmp_path)
    pair = ModelPair.load(tiny_dirs["target"], None, "float32", compile=True)
    server = Server(pair, ServeConfig(model_name="tiny", defaults={"temperature": 0.0, "method": "ar"}))
    compiled: list[tuple[int, int, int]] = []  # (rows, width, requests running meanwhile)
    pair.step.on_compile = lambda rows, width: compiled.append((rows, width, len(server.scheduler.running)))
    server.warm_up()
    assert pair.step.defer and compiled and all(rows == 1 for rows, _, _ in compiled)
    scheduler = server.scheduler
    config = pair.config(method="ar", temperature=0.0, max_new_tokens=6, eos_token_ids=())
    texts = ("hello there", "one two three")
    admit = scheduler._admit  # (the two join as one batch: none is admitted before both wait)
    monkeypatch.setattr(scheduler, "_admit", lambda: admit() if len(scheduler.waiting) == 2 or scheduler.running
                        else None)
    scheduler.start()
    try:
        requests = [scheduler.submit(Request(pair.encode(text, chat=False), config)) for text in texts]
        for request in requests:
            while request.events.get(timeout=60)[0] != "done":
                pass
        deadline = time.time() + 120
        while pair.step.deferred and time.time() < deadline:
            time.sleep(0.05)
    finally:
        scheduler.stop()
    for request, text in zip(requests, texts):
        assert request.tokens == pair.generate(text, chat=False, config=config).tokens
    assert not pair.step.deferred and (2, 1, 0) in compiled  # (compiled once idle, not while the two waited)
    assert all(running == 0 for _, _, running in compiled)


def test_a_deferred_graph_that_fails_to_compile_ends_deferring_and_the_server_goes_on(tiny_dirs, monkeypatch, caplog):
    """The idle compilation failing logs one warning and turns deferring off (later shapes then compile as they
    occur); the server still answers."""
    from fuzzyspec.serve.app import ServeConfig, Server
    from fuzzyspec.serve.scheduler import Request

    pair = ModelPair.load(tiny_dirs["target"], None, "float32")
    server = Server(pair, ServeConfig(model_name="tiny", defaults={"temperature": 0.0, "method": "ar"}))
    pair.step.defer, pair.step.deferred = True, {("a call",): ()}

    def fail() -> bool:
        raise RuntimeError("no compiler")

    monkeypatch.setattr(pair.step, "compile_deferred", fail)
    scheduler = server.scheduler
    config = pair.config(method="ar", temperature=0.0, max_new_tokens=4, eos_token_ids=())
    scheduler.start()
    try:
        deadline = time.time() + 30
        while pair.step.deferred and time.time() < deadline:
            time.sleep(0.02)
        request = scheduler.submit(Request(pair.encode("hello there", chat=False), config))
        while request.events.get(timeout=60)[0] != "done":
            pass
    finally:
        scheduler.stop()
    assert not pair.step.defer and not pair.step.deferred
    assert [r.message for r in caplog.records].count("compiling a deferred step failed; later shapes compile as they "
                                                     "occur") == 1
    assert request.tokens == pair.generate("hello there", chat=False, config=config).tokens
