"""vmem-serve's per-request sampling, in process: the seeded Gumbel noise makes the argmax a sample
of the softmax; inside the engine, a seeded request's tokens are the same whether it runs with
room or is preempted and recomputed, and greedy requests beside sampling ones keep the argmax."""

import pytest

import server_util as su

su.require()

import torch  # noqa: E402

import vmem.transformers as vt  # noqa: E402
from vmem.server.engine import Engine  # noqa: E402
from vmem.server.options import ModelSpec, ServerOptions  # noqa: E402
from vmem.server.sampling import gumbel_noise, row_key  # noqa: E402


def test_the_argmax_of_scores_plus_the_noise_samples_their_softmax():
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    keys = torch.tensor([row_key(7, i) for i in range(100_000)], dtype=torch.int32)
    picked = (logits + gumbel_noise(keys, 5)).argmax(-1)
    freq = torch.bincount(picked, minlength=5).float() / len(picked)
    assert torch.allclose(freq, logits.softmax(-1), atol=0.006), (freq, logits.softmax(-1))
    noise = gumbel_noise(keys[:500], 1000)
    assert abs(noise.mean().item() - 0.5772) < 0.01 and abs(noise.var().item() - 1.6449) < 0.03
    assert torch.equal(gumbel_noise(keys[:3], 7), gumbel_noise(keys[:3], 7))  # a pure function of the keys


def test_row_keys_are_nonzero_int32_and_differ_by_seed_and_position():
    keys = {row_key(s, p) for s in (-5, 0, 1, 2**63 - 1) for p in range(50)}
    assert len(keys) == 200 and 0 not in keys and all(-(2**31) <= k < 2**31 for k in keys)


def run(model_dir, memory, requests):
    """Serves ``requests`` ((prompt, kwargs) pairs) on an engine with ``memory`` bytes of KV,
    directly through its manager; their tokens and the preemptions."""
    opts = ServerOptions(models=(ModelSpec("tiny", model_dir),), page_size="64K", memory=memory, max_requests=4,
                         max_context=256, max_batch_tokens=64)
    engine = Engine(opts, opts.models[0])
    try:
        engine.load(engine.prepare())
        ids = [engine.manager.add_request(p, max_new_tokens=150, eos_token_id=-1, **kw) for p, kw in requests]
        out = {}
        while len(out) < len(ids):
            r = engine.manager.get_result(timeout=120)
            assert r is not None and r.error is None, r
            out[r.request_id] = list(r.generated_tokens)
        preempted = vt.stats(engine.manager).preemptions
        return [out[i] for i in ids], preempted
    finally:
        engine.close(30)
        vt.uninstall()


def test_seeded_and_greedy_requests_keep_their_tokens_when_preempted(tmp_path):
    model = su.make_model_dir(str(tmp_path / "tiny"))
    requests = [([10 + i, 20, 30], {"temperature": 1.0, "top_p": 0.9, "seed": 100 + i}) for i in range(3)]
    requests.append(([11, 21, 31], {}))  # greedy beside them
    roomy, none = run(model, 8 << 20, requests)
    # 4 requests of 153 tokens need 2 blocks of 128 tokens each; 6 blocks (one the trash row's) hold 2.5.
    tight, preempted = run(model, 6 * 65536, requests)
    assert none == 0 and preempted > 0, (none, preempted)
    assert tight == roomy
    greedy = su.generate(model, [11, 21, 31], 150)  # generate() stops at EOS, the engine here does not
    assert roomy[3][:len(greedy)] == greedy and (len(greedy) == 150 or greedy[-1] == 2)
    assert len({tuple(t) for t in roomy[:3]}) == 3
