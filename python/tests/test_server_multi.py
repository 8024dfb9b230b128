"""Several models behind one port: a router process and one model process per model, every
model a tenant of one vmem pool. Requests are routed by ``model`` (each model's greedy answers
are its own ``generate()``'s); the pool shows both tenants with their limits; a model process
killed with SIGKILL is started again while the other model serves, requests to it meanwhile get
503 with Retry-After (never a hang), and its memory comes back to the pool; an idle model
sleeps and wakes; SIGTERM stops the router and its model processes, exit status 0.

Needs torch, a transformers vmem serves and the server's dependencies (scripts/test.sh's serving
stage); skipped, saying why, elsewhere."""

import os
import signal
import time

import pytest

import server_util as su

su.require()

import httpx  # noqa: E402
import openai  # noqa: E402

from vmem import pool  # noqa: E402

KEY = "router-key"
PROMPT = "w1 w2 w3"
NEW = 8
POOL = 32 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {"a": su.make_model_dir(str(root / "a"), seed=0), "b": su.make_model_dir(str(root / "b"), seed=1)}


@pytest.fixture(scope="module")
def router(models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("router")
    ledger = str(tmp / "pool")
    args = ["--model", f"a={models['a']}", "--model", f"b={models['b']}", *su.TINY_ARGS, "--memory", str(POOL),
            "--pool-ledger", ledger, "--limit", "a=50%", "--floor", "b=1M", "--idle-sleep", "2", "--api-key", KEY]
    s = su.Server(args, str(tmp / "log")).wait_ready()
    s.ledger = ledger
    yield s
    code = s.stop()
    assert code == 0, s.output()[-4000:]
    assert not os.path.exists(ledger), "the router did not remove the pool it created"


def expected(models, name):
    tok = su.tokenizer(models[name])
    return tok.decode(su.generate(models[name], tok(PROMPT)["input_ids"], NEW), skip_special_tokens=True)


def api(router, timeout=30.0):
    return su.client(router.url, KEY, timeout=timeout)


def ask(router, name, **kw):
    return api(router).completions.create(model=name, prompt=PROMPT, max_tokens=NEW, temperature=0, **kw)


def health(router):
    return httpx.get(router.url + "/health", timeout=5).json()["models"]


def test_requests_are_routed_by_model(router, models):
    assert ask(router, "a").choices[0].text.strip() == expected(models, "a")
    assert ask(router, "b").choices[0].text.strip() == expected(models, "b")
    assert expected(models, "a") != expected(models, "b")
    chunks = list(api(router).chat.completions.create(
        model="b", messages=[{"role": "user", "content": PROMPT}], max_tokens=NEW, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and len(chunks) > 2
    assert sorted(m.id for m in api(router).models.list().data) == ["a", "b"]
    with pytest.raises(openai.AuthenticationError):  # the router checks the key before forwarding
        su.client(router.url, "wrong").completions.create(model="a", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        ask(router, "c")
    status, _, body = su.post_json(router.url + "/v1/completions", None, raw=b"{nope",
                                   headers={"Authorization": f"Bearer {KEY}"})
    assert status == 400 and body["error"]["code"] == "invalid_json"
    with pytest.raises(openai.BadRequestError) as e:  # the model process's own checks, passed on
        ask(router, "a", top_p=0)
    assert e.value.body["param"] == "top_p"


def test_the_pool_holds_both_models_as_tenants_with_their_limits(router):
    st = pool.open(router.ledger).status()
    assert st.total == POOL
    assert {t.name for t in st.tenants} == {"a", "b"}
    assert st.tenant("a").limit == POOL // 2 and st.tenant("b").floor == 1 << 20
    m = router.metrics()
    assert m["vmem:pool_total_bytes"] == POOL
    assert m['vmem:pool_tenant_limit_bytes{tenant="a"}'] == POOL // 2
    assert 'vmem:kv_cache_budget_bytes{model_name="a"}' in m and 'vmem:kv_cache_budget_bytes{model_name="b"}' in m


def test_a_killed_model_is_started_again_while_the_other_serves(router, models):
    a_pid = health(router)["a"]["pid"]
    stream = api(router).completions.create(model="a", prompt=PROMPT, max_tokens=200, stream=True,
                                        extra_body={"ignore_eos": True})
    next(iter(stream))
    os.kill(a_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError, match="stopped during the stream"):  # its stream ends with an error event
        for _ in stream:
            pass
    t0 = time.monotonic()
    saw_503 = False
    while time.monotonic() - t0 < 90:
        try:
            r = ask(router, "a")
            if saw_503 or health(router)["a"]["pid"] != a_pid:
                break
        except openai.APIStatusError as e:  # while it starts again: 503 with Retry-After, at once
            assert e.status_code == 503 and int(e.response.headers["retry-after"]) >= 1, e
            saw_503 = True
            # The other model serves meanwhile, its own answer.
            assert ask(router, "b").choices[0].text.strip() == expected(models, "b")
        time.sleep(0.2)
    else:
        raise AssertionError(f"model a did not come back:\n{router.output()[-4000:]}")
    assert saw_503, "no request saw model a down"
    assert r.choices[0].text.strip() == expected(models, "a")
    h = health(router)
    assert h["a"]["state"] == "ready" and h["a"]["restarts"] == 1 and h["a"]["last_exit"] == -signal.SIGKILL
    st = pool.open(router.ledger).status()
    live = st.tenant("a")
    assert live is not None and live.pid == h["a"]["pid"] != a_pid, "the dead tenant was not reaped"
    assert router.metrics()['vmem:model_restarts_total{model_name="a"}'] == 1


def test_an_idle_model_sleeps_its_tenant_usage_to_zero_and_wakes(router, models):
    ask(router, "b")
    deadline = time.monotonic() + 30
    while router.metrics().get('vmem:asleep{model_name="b"}') != 1:
        assert time.monotonic() < deadline, "model b did not sleep"
        time.sleep(0.2)
    assert pool.open(router.ledger).status().tenant("b").usage == 0
    assert ask(router, "b").choices[0].text.strip() == expected(models, "b")
    assert pool.open(router.ledger).status().tenant("b").usage > 0
