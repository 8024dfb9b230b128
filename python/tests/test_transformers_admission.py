"""A request longer than a vmem row is refused alone, when it arrives, saying which option to
raise; the requests beside it are served as if it had not come. And the engine's warmup is not
counted as preemptions.

Before: on transformers 5.17 and 5.23 such a request stopped the engine's loop (``No requests can
be scheduled and no requests can be offloaded`` when its prefill filled the row in chunks, ``bad
round entry`` when it came in one round), failing every request in flight; and ``readmissions``
counted the warmup's fake requests, whose ids recur run after run, as preemptions (hundreds a
run in the serving suite's tables).

CPU, fp32, tiny models; needs torch and a transformers vmem serves (skipped otherwise, saying why)."""

import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng  # noqa: E402
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from harness import check as h  # noqa: E402

import vmem  # noqa: E402
import vmem.transformers as vt  # noqa: E402
from vmem.transformers import admission  # noqa: E402
from vmem.transformers import hooks  # noqa: E402

MAX_CONTEXT = eng.TINY_OPTS["max_context"]  # 1,024


def _generate(lengths: list[int], new: int, max_batch_tokens: int) -> tuple[dict, dict]:
    """generate_batch of prompts of ``lengths`` through vmem and through the engine's own paged
    cache: (vmem's results, possibly partial when it raised; the engine's)."""
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(lengths), lengths, model.config.vocab_size)
    gen = transformers.GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = dict(max_batch_tokens=max_batch_tokens)
    vt.install(**eng.TINY_OPTS)
    model.set_attn_implementation(vt.VMEM_ATTENTION)
    try:
        ours = model.generate_batch(prompts, generation_config=gen,
                                    continuous_batching_config=transformers.ContinuousBatchingConfig(**cb))
    except vmem.VmemError as e:
        ours = e.results
    vt.uninstall()
    model.set_attn_implementation(eng.ENGINE_SDPA)
    fits = [i for i, n in enumerate(lengths) if n + new - 1 <= MAX_CONTEXT]
    theirs = model.generate_batch([prompts[i] for i in fits], generation_config=gen,
                                  continuous_batching_config=transformers.ContinuousBatchingConfig(**cb))
    return ours, {f"req_{i}": r for i, r in zip(fits, theirs.values())}


def _by_prompt(results: dict) -> dict[int, object]:
    return {i: r for i, r in enumerate(sorted(results.values(), key=lambda r: int(str(r.request_id).split("_")[-1])))}


# Prompt past the row, in one round (5.17: 'bad round entry') or in chunks ('No requests can be
# scheduled'); prompt within the row but prompt + max_new_tokens - 1 past it; exactly at the row.
@pytest.mark.parametrize("lengths,new,max_batch_tokens,refused", [
    ([100, 1100, 60], 8, 2048, {1}),
    ([100, 1100, 60], 8, 64, {1}),
    ([100, 1000, 60], 26, 64, {1}),   # 1,000 + 26 - 1 = 1,025 tokens
    ([100, 1000, 60], 25, 64, set()),  # 1,024: the whole row, served
], ids=["prompt-past-row-one-round", "prompt-past-row-chunked", "generation-past-row", "exactly-a-row"])
def test_a_request_past_the_row_is_refused_alone(lengths, new, max_batch_tokens, refused):
    ours, theirs = _generate(lengths, new, max_batch_tokens)
    got = _by_prompt(ours)
    assert len(got) == len(lengths)
    for i, r in got.items():
        if i in refused:
            assert r.error is not None and "max_context=1024" in r.error and "raise max_context" in r.error, r.error
            assert not r.generated_tokens
        else:  # served, and exactly as the engine's own cache serves it
            assert r.error is None, r.error
            assert list(r.generated_tokens) == list(theirs[f"req_{i}"].generated_tokens)


def test_tokens_to_store_and_the_check():
    state = types.SimpleNamespace(request_id="r", initial_tokens=[1] * 10, max_new_tokens=5)
    assert admission.tokens_to_store(state) == 14  # the last generated token is never stored
    admission.check_fits(state, 14)
    with pytest.raises(vmem.InvalidArgument, match="'r' needs 14 tokens .*max_context=13"):
        admission.check_fits(state, 13)
    state.max_new_tokens = None  # no limit: only the prompt can be checked up front
    assert admission.tokens_to_store(state) == 10
    with pytest.raises(vmem.InvalidArgument, match="needs 10 tokens"):
        admission.check_fits(state, 9)


def test_other_caches_are_not_checked():
    added = []
    hook = hooks.refuse_past_a_row(lambda self, state: added.append(state))
    engine_scheduler = types.SimpleNamespace(cache=types.SimpleNamespace(max_context=10))  # not vmem's: the engine's
    long = types.SimpleNamespace(request_id="r", initial_tokens=[1] * 10**6, max_new_tokens=5)
    hook(engine_scheduler, long)
    assert added == [long]


def test_warmup_rounds_are_not_counted_as_preemptions():
    """The engine's warmup admits fake requests whose ids recur; readmissions counted them."""
    cache = eng.tiny_cache(eng.TINY_OPTS)
    for _ in range(3):  # what a warmup does: the same fake ids, admitted and freed, round after round
        assert cache.allocate_blocks(1, "__warmup_DECODING_0__", 0) == 1
        cache.free_blocks("__warmup_DECODING_0__")
    assert cache.readmissions == 2
    runner = types.SimpleNamespace(cache=cache)
    hooks.capture_vmem_graphs(lambda self, model: None)(runner, None)  # no graphs (no padding): no round
    assert cache.readmissions == 0
    assert cache.allocate_blocks(1, "__warmup_DECODING_0__", 0) == 1  # seen before the warmup ended: not counted
    assert cache.readmissions == 0
    cache.free_blocks("__warmup_DECODING_0__")
    assert cache.allocate_blocks(1, "__warmup_DECODING_0__", 0) == 1  # a real readmission after it: counted
    assert cache.readmissions == 1
