"""The standing fault suite: property-based fuzzing of the server's request schema and the CLI's arguments.

Server: any JSON body made of the API's fields (and strangers) with values of any type, to both routes,
streamed or not, gives no 5xx; every error is in OpenAI's shape and names a field of the request (or
none), and the server answers normally afterwards with no row or queue entry left behind.
CLI: any `generate` invocation built from its flags with good and bad values ends with exit 0, or exit
2 and one error line, never a traceback. Examples are bounded so the suite stays fast.
"""
from __future__ import annotations

import contextlib
import io
import json

import httpx
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzzyspec.cli import main
from fuzzyspec.options import OPTIONS
from serve_util import Running

ODD_NUMBERS = [0, -1, 1, 2, 3, 16, 40, 2**31, 2**63, 2**70, -2**63, 0.5, -0.5, 1e-9, 1e308, 1.5,
               float("inf"), float("-inf"), float("nan")]
VALUES = st.one_of(st.none(), st.booleans(), st.sampled_from(ODD_NUMBERS), st.integers(-3, 24),
                   st.floats(-3, 3, allow_nan=False), st.text(max_size=8),
                   st.sampled_from(["inf", "Infinity", "", "sd", "fsd", "ar", "fsd-hybrid", "js", "tv", "tiny",
                                    "heuristic", "x" * 40]),
                   st.lists(st.integers(-2, 60000), max_size=3), st.lists(st.text(max_size=3), max_size=3),
                   st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "n", "logprobs",
          "echo", "method", "fsd_threshold", "fsd_divergence", "gamma", "gamma_schedule", "draft_confidence",
          "tree", "tree_total_tokens", "tree_depth", "tree_top_k", "stream_options", "user", "presence_penalty",
          "logit_bias", "response_format", "suffix", "best_of", "max_completion_tokens", "top_logprobs",
          "no_such_field"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard", ""]),
                                 "content": st.one_of(st.text(max_size=12), st.none(), st.integers(),
                                                      st.just([{"type": "text", "text": "hi"}]),
                                                      st.just([{"type": "image_url"}]))})


@st.composite
def bodies(draw) -> tuple[str, dict]:
    chat = draw(st.booleans())
    body = {"model": "tiny"}
    for name in draw(st.lists(st.sampled_from(FIELDS), max_size=6, unique=True)):
        body[name] = draw(VALUES)
    if draw(st.integers(0, 9)):  # mostly a prompt of the route's kind, sometimes anything or nothing
        if chat:
            body["messages"] = draw(st.one_of(st.lists(MESSAGE, min_size=1, max_size=2), VALUES))
        else:
            body["prompt"] = draw(st.one_of(st.text(max_size=20), st.lists(st.integers(-1, 50000), max_size=4),
                                            st.lists(st.text(max_size=5), max_size=3), VALUES))
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 24:  # keep each example quick
        body["max_tokens"] = 24
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@pytest.fixture(scope="module")
def server(tiny_dirs):
    running = Running(tiny_dirs)
    yield running
    running.stop()


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(request=bodies())
def test_no_request_body_gets_a_5xx(server, request):
    route, body = request
    reply = httpx.post(server.url + route, content=json.dumps(body, allow_nan=True),
                       headers={"content-type": "application/json"}, timeout=60)
    assert reply.status_code < 500, (body, reply.text)
    if reply.status_code >= 400:
        error = reply.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, error
        assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
        # The field named is one the request sent, or the route's prompt field when that was missing.
        assert error["param"] is None or error["param"].split(".")[0].split("[")[0] in {*body, "prompt", "messages"}, \
            (body, error)
    elif body.get("stream") is True:
        assert reply.text.rstrip().endswith("data: [DONE]"), reply.text[-200:]


def test_after_the_fuzzing_nothing_is_left_behind(server):
    reply = server.client.completions.create(model="tiny", prompt="still here?", max_tokens=2)
    assert reply.choices[0].text is not None
    assert server.metric("active_requests") == {"fuzzyspec_active_requests": 0.0}
    assert server.metric("queue_depth") == {"fuzzyspec_queue_depth": 0.0}


FLAG_VALUES = st.sampled_from(["0", "1", "3", "-1", "0.5", "-0.5", "inf", "nan", "1e999", "2", "99999999999999999999",
                               "x", "", "sd", "fsd", "ar", "fsd-hybrid", "js", "tv", "heuristic", "cuda", "cpu"])


@st.composite
def generate_argv(draw, dirs: dict[str, str]) -> list[str]:
    argv = draw(st.lists(st.sampled_from(["--threads=1", "--log-level=error", "--threads=0", "--threads=x",
                                          "--log-level=loud"]), max_size=1))
    argv += ["generate", draw(st.sampled_from(["hi", "", " ", "\x00", "é" * 5, "w1 w2"])),
             "--target", dirs["target"], "--draft", draw(st.sampled_from([dirs["draft"], "self:1", "self:9",
                                                                          "lookup", "lookup:0", "nowhere"])),
             "--dtype", "float32", "--max-new-tokens", draw(st.sampled_from(["1", "4", "0", "-2", "x", "inf"]))]
    for option in draw(st.lists(st.sampled_from([o for o in OPTIONS if o.name != "max_new_tokens"]),
                                max_size=4, unique=True)):
        argv += [option.flag] if isinstance(option.default, bool) else [option.flag, draw(FLAG_VALUES)]
    argv += draw(st.lists(st.sampled_from(["--json", "--no-chat", "--device=cuda", "--device=tpu",
                                           "--stop=.", "--bogus"]), max_size=2, unique=True))
    return argv


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_no_cli_invocation_prints_a_traceback(tiny_dirs, data):
    argv = data.draw(generate_argv(tiny_dirs))
    threads = torch.get_num_threads()
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as stop:  # --help and --version only
                code = stop.code
    finally:
        torch.set_num_threads(threads)
    text = err.getvalue()
    assert "Traceback" not in text, (argv, text)
    assert code in (0, 2), (argv, code, text)
    if code == 2:
        assert text.strip().splitlines()[-1].startswith("fuzzyspec: error: "), (argv, text)
        assert len(text.strip().splitlines()) <= 2, (argv, text)
