"""vmem-serve as its clients use it: the official ``openai`` client over loopback against a
server started as a subprocess (a tiny random Llama and a tokenizer made here, on the CPU):
plain, streaming and chat requests whose greedy outputs are ``generate()``'s tokens, stop
strings, seeded sampling, several choices, the API key, the models list and the metrics' names.

Needs torch, a transformers vmem serves and the server's dependencies (scripts/test.sh's serving
stage); skipped, saying why, elsewhere."""

import concurrent.futures
import os

import pytest

import server_util as su

su.require()

import openai  # noqa: E402

KEY = "test-key-123"
PROMPTS = ["w1 w2 w3", "w7 w7 w7 w7 w7 w7 w7 w7", "w40 w3 w199 w0 w12"]
NEW = 12


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return su.make_model_dir(str(tmp_path_factory.mktemp("model") / "tiny"))


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = str(tmp_path_factory.mktemp("log") / "server.log")
    s = su.Server(["--model", f"tiny={model_dir}", "--api-key", KEY, *su.TINY_ARGS], log).wait_ready()
    yield s
    assert s.stop() == 0, s.output()[-3000:]


@pytest.fixture(scope="module")
def api(server):
    return su.client(server.url, KEY)


def expected(model_dir, text, new=NEW):
    tok = su.tokenizer(model_dir)
    ids = tok(text)["input_ids"]
    out = su.generate(model_dir, ids, new)
    return tok.decode(out, skip_special_tokens=True), len(out)


def test_the_models_list_names_the_model_and_health_answers(server, api):
    assert [m.id for m in api.models.list().data] == ["tiny"]
    assert api.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("other")
    status, body = server.get("/health")
    assert status == 200 and '"ok"' in body


def test_greedy_completions_are_generates_tokens(model_dir, api):
    for prompt in PROMPTS:
        want, count = expected(model_dir, prompt)
        r = api.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=0)
        assert r.choices[0].text.strip() == want, prompt
        assert r.usage.completion_tokens == count and r.usage.prompt_tokens == len(prompt.split())
        assert r.choices[0].finish_reason == ("length" if count == NEW else "stop")


def test_a_batch_of_prompts_and_token_id_prompts_give_the_same_greedy_tokens(model_dir, api):
    tok = su.tokenizer(model_dir)
    r = api.completions.create(model="tiny", prompt=PROMPTS, max_tokens=NEW, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    ids = api.completions.create(model="tiny", prompt=tok(PROMPTS[1])["input_ids"], max_tokens=NEW, temperature=0)
    for c, prompt in zip(r.choices, PROMPTS):
        assert c.text.strip() == expected(model_dir, prompt)[0]
    assert ids.choices[0].text == r.choices[1].text


def test_a_stream_carries_the_same_text_then_usage_then_done(server, model_dir, api):
    want, count = expected(model_dir, PROMPTS[0])
    chunks = list(api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.strip() == want
    assert len([c for c in chunks if c.choices]) >= 2, "tokens came in one piece: not streamed"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == count
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("length", "stop")
    # On the wire: server-sent events ending with data: [DONE].
    import httpx

    with httpx.stream("POST", server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "stream": True},
                      timeout=30) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_chat_applies_the_template_and_is_generates_tokens(model_dir, api):
    tok = su.tokenizer(model_dir)
    messages = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": "w1 w2 w3"}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = su.generate(model_dir, ids, NEW)
    r = api.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content.strip() == tok.decode(out, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(out)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=NEW, temperature=0,
                                              stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    # Text parts are content too.
    parts = [{"role": "system", "content": "w9 w8"}, {"role": "user", "content": [{"type": "text", "text": "w1 w2 w3"}]}]
    assert api.chat.completions.create(model="tiny", messages=parts, max_tokens=NEW,
                                       temperature=0).choices[0].message.content == r.choices[0].message.content


def test_a_stop_string_ends_the_text_before_it(model_dir, api):
    want, _ = expected(model_dir, PROMPTS[2])
    words = want.split()
    stop = " ".join(words[3:5])  # two words in the middle of the greedy text
    r = api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW, temperature=0, stop=[stop, "zzz"])
    assert r.choices[0].text == " " + want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < NEW
    streamed = list(api.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=NEW, temperature=0,
                                           stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_a_seed_gives_the_same_sample_whatever_runs_beside_it(api):
    def sample(seed, prompt=PROMPTS[0]):
        r = api.completions.create(model="tiny", prompt=prompt, max_tokens=NEW, temperature=1.5, top_p=0.95, seed=seed)
        return r.choices[0].text

    alone = sample(7)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(sample, 7)] + [pool.submit(sample, s, PROMPTS[1]) for s in (1, 2, 3)]
        beside = crowd[0].result()
    assert beside == alone
    assert len({alone, sample(8), sample(9), sample(10)}) > 1, "different seeds sampled the same text"
    greedy = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0).choices[0].text
    assert sample(11) != greedy or sample(12) != greedy
    # A temperature too small to divide by (the scores would overflow) is greedy.
    tiny = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=1e-38, seed=5)
    assert tiny.choices[0].text == greedy


def test_n_choices(api):
    r = api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=NEW, temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2] and len({c.text for c in r.choices}) == 1
    r = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "w5"}], max_tokens=NEW,
                                    temperature=1.5, n=4, seed=3)
    assert len({c.message.content for c in r.choices}) > 1 and r.usage.completion_tokens > 0


def test_the_api_key_is_required_on_v1(server):
    with pytest.raises(openai.AuthenticationError):
        su.client(server.url, "wrong").models.list()
    status, _, body = su.post_json(server.url + "/v1/completions", {"model": "tiny", "prompt": "w1"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert server.get("/health")[0] == 200 and server.get("/metrics")[0] == 200  # open, as vLLM's


def test_metrics_carry_vllms_names_under_vmem(server, api):
    api.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=4, temperature=0, stream=False)
    m = server.metrics()
    names = {k.split("{")[0] for k in m}
    for name in ("vmem:num_requests_running", "vmem:num_requests_waiting", "vmem:kv_cache_bytes",
                 "vmem:kv_cache_budget_bytes", "vmem:kv_cache_usage_perc", "vmem:num_preemptions_total",
                 "vmem:time_to_first_token_seconds_bucket", "vmem:inter_token_latency_seconds_bucket",
                 "vmem:e2e_request_latency_seconds_bucket", "vmem:prompt_tokens_total",
                 "vmem:generation_tokens_total", "vmem:request_success_total"):
        assert name in names, name
    assert server.metric("vmem:kv_cache_budget_bytes") == 8 << 20
    assert server.metric("vmem:e2e_request_latency_seconds_count") >= 1
    assert server.metric("vmem:time_to_first_token_seconds_count") >= 1
