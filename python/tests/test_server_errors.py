"""Every bad request a client can send gets a 4xx in OpenAI's shape naming what is wrong, the
official client raises the matching error (BadRequestError for a 400), and the server keeps
serving: after each test a good request gets its greedy answer and ``/health`` says ok. These
are the requests that stop ``transformers serve``'s continuous-batching worker (max_tokens 0, -1
or huge, a negative temperature, a prompt past the context).

Needs torch, a transformers vmem serves and the server's dependencies (scripts/test.sh's serving
stage); skipped, saying why, elsewhere."""

import json

import pytest

import server_util as su

su.require()

import openai  # noqa: E402

CONTEXT = 256  # --max-context of su.TINY_ARGS


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = su.make_model_dir(str(tmp_path_factory.mktemp("model") / "tiny"))
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = su.Server(["--model", f"tiny={model}", "--max-body", "65536", *su.TINY_ARGS], log).wait_ready()
    s.good = su.client(s.url).completions.create(model="tiny", prompt="w1 w2", max_tokens=6, temperature=0)
    yield s
    assert s.stop() == 0, s.output()[-3000:]


@pytest.fixture
def api(server):
    yield su.client(server.url)
    # Whatever the test sent, the server still serves, and the same greedy answer.
    again = su.client(server.url).completions.create(model="tiny", prompt="w1 w2", max_tokens=6, temperature=0)
    assert again.choices[0].text == server.good.choices[0].text
    assert server.get("/health")[0] == 200


def refused(server, body, status=400, raw=None, path="/v1/completions"):
    got, headers, answer = su.post_json(server.url + path, body, raw=raw)
    assert got == status, (body, got, answer)
    assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, answer
    return answer["error"]


def test_malformed_json_and_bodies_that_are_not_objects(server, api):
    for raw in (b"{", b'{"model": "tiny", "prompt": "w1",}', b"", b"\xff\xfe", b'{"a": NaN}', b'{"a": Infinity}',
                b"[1, 2]", b'"text"', b"null", b"[" * 20000 + b"]" * 20000):
        e = refused(server, None, raw=raw)
        assert e["type"] == "invalid_request_error" and e["code"] == "invalid_json", (raw[:20], e)


def test_wrong_types_name_the_parameter(server, api):
    base = {"model": "tiny", "prompt": "w1", "max_tokens": 4}
    for field, value in (("max_tokens", "8"), ("max_tokens", 8.0), ("max_tokens", True), ("temperature", "0.5"),
                         ("top_p", "1"), ("stream", "true"), ("stream", 1), ("n", 1.5), ("seed", "7"),
                         ("stop", 3), ("stop", ["w1", 2]), ("prompt", {"a": 1}), ("prompt", [1, "w1"]),
                         ("prompt", [[1], "w1"]), ("model", 3), ("ignore_eos", "yes")):
        e = refused(server, dict(base, **{field: value}))
        assert e["param"] == field, (field, value, e)
    e = refused(server, {"model": "tiny", "messages": "w1"}, path="/v1/chat/completions")
    assert e["param"] == "messages"
    e = refused(server, {"model": "tiny", "messages": [{"role": "user", "content": 5}]}, path="/v1/chat/completions")
    assert e["param"].startswith("messages.0.content"), e


def test_unknown_and_missing_fields(server, api):
    e = refused(server, {"model": "tiny", "prompt": "w1", "frobnicate": 1})
    assert e["param"] == "frobnicate" and "Unrecognized request argument" in e["message"]
    assert refused(server, {"prompt": "w1"})["param"] == "model"
    assert refused(server, {"model": "tiny"})["param"] == "prompt"
    assert refused(server, {"model": "tiny"}, path="/v1/chat/completions")["param"] == "messages"


def test_an_unknown_model_is_404(api):
    with pytest.raises(openai.NotFoundError) as e:
        api.completions.create(model="gpt-5", prompt="w1", max_tokens=2)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        api.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "w1"}])


@pytest.mark.parametrize("max_tokens", [0, -1, -(2**63), CONTEXT, CONTEXT + 1, 10**9, 2**64, 10**30])
def test_max_tokens_zero_negative_or_past_the_context(api, max_tokens):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt="w1 w2", max_tokens=max_tokens)
    assert e.value.body["param"] == "max_tokens"
    if max_tokens > 0:
        assert str(CONTEXT) in e.value.body["message"] and e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}],
                                    max_completion_tokens=max_tokens)
    assert e.value.body["param"] in ("max_tokens", "max_completion_tokens")


def test_a_prompt_past_the_context_names_the_limit(api):
    long = " ".join(["w5"] * (CONTEXT + 10))
    for call in (lambda: api.completions.create(model="tiny", prompt=long, max_tokens=1),
                 lambda: api.completions.create(model="tiny", prompt=[5] * CONTEXT, max_tokens=1),
                 lambda: api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": long}])):
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert e.value.body["code"] == "context_length_exceeded" and str(CONTEXT) in e.value.body["message"]
    # The longest prompt that fits still runs: 255 tokens and one to generate.
    r = api.completions.create(model="tiny", prompt=[5] * (CONTEXT - 1), max_tokens=1, temperature=0)
    assert r.usage.completion_tokens == 1


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("temperature", -1e30), ("temperature", 2.5),
                                         ("top_p", 0), ("top_p", 0.0), ("top_p", 1.5), ("top_p", -1),
                                         ("n", 0), ("n", -3), ("n", 17), ("n", 10**6), ("n", 10**20),
                                         ("seed", 2**64), ("stop", [""]), ("stop", ["a"] * 9), ("stop", "x" * 300)])
def test_values_out_of_range(api, field, value):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt="w1", max_tokens=2, **{field: value})
    assert e.value.body["param"] == field


@pytest.mark.parametrize("extra", [{"logprobs": 2}, {"echo": True}, {"best_of": 3}, {"suffix": "w1"},
                                   {"presence_penalty": 0.5}, {"frequency_penalty": -1.0},
                                   {"logit_bias": {"5": 10}}, {"stream_options": {"include_usage": True}}])
def test_what_cannot_be_honoured_is_refused_by_name(api, extra):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt="w1", max_tokens=2, **extra)
    assert e.value.body["param"] == next(iter(extra))


@pytest.mark.parametrize("extra", [{"logprobs": True}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                                   {"tool_choice": "required"}, {"response_format": {"type": "json_object"}},
                                   {"max_tokens": 2, "max_completion_tokens": 2}])
def test_chat_features_not_served_are_refused_by_name(api, extra):
    with pytest.raises(openai.BadRequestError) as e:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w1"}], **extra)
    assert e.value.body["param"] == next(iter(extra))


def test_bad_prompts_and_messages(server, api):
    for prompt in ("", [], [[]], [-1], [10**6], [2**40], [[1, 2], [5, 10**6]]):
        e = refused(server, {"model": "tiny", "prompt": prompt, "max_tokens": 2})
        assert e["param"] == "prompt", (prompt, e)
    for messages, param in (([], "messages"), ([{"role": "tool", "content": "w1"}], "messages.0.role"),
                            ([{"role": "user"}], "messages.0.content"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                             "messages.0.content.0")):
        e = refused(server, {"model": "tiny", "messages": messages}, path="/v1/chat/completions")
        assert e["param"] == param, (messages, e)


def test_a_body_past_the_limit_is_413_unread(server, api):
    e = refused(server, {"model": "tiny", "prompt": "w1 " * 30000}, status=413)
    assert "65536" in e["message"]


def test_routes_and_methods_the_server_lacks(server, api):
    status, text = server.get("/v1/nothing")
    assert status == 404 and "error" in json.loads(text)
    status, text = server.get("/v1/completions")
    assert status == 405 and "error" in json.loads(text)
