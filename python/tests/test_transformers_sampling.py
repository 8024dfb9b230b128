"""Greedy decoding's argmax in two reductions (:mod:`vmem.transformers.sampling`): the same
tokens as ``torch.argmax`` (ties to the first index, NaN as the largest, ``-inf`` rows, a
vocabulary that is not whole runs, none or one row), eager and compiled; put in the engine's
``_sample`` for a vmem cache decoding greedily under the compiled forward, the engine's own path
run eagerly, or for sampling, log-probabilities or another cache. Under the engine:
``test_transformers_compile.py``.

CPU; needs torch and a transformers vmem serves (skipped otherwise, saying why)."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng  # noqa: E402

eng.skip_unless_served()

from vmem.transformers import hooks, sampling  # noqa: E402
from vmem.transformers.cache import VmemCBCache  # noqa: E402


def _scores(rows: int, words: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, words, generator=g).to(dtype)
    if rows and words > 1:
        x[0, words // 3] = x[0, -1] = x[0].max() + 1  # a tie: the first index wins
        if rows > 1:
            x[1, 5 % words] = float("nan")  # NaN is the largest
        if rows > 2:
            x[2] = float("-inf")
        if rows > 3:
            x[3, -1] = x[3].max() + 1  # the maximum in the padded last run
    return x


@pytest.mark.parametrize("words", [1, 7, sampling.RUN - 1, sampling.RUN, sampling.RUN + 1, 128256, 151936])
@pytest.mark.parametrize("rows", [0, 1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tokens_equal_argmax(words, rows, dtype):
    x = _scores(rows, words, seed=words * 7 + rows, dtype=dtype)
    got = sampling.greedy_tokens(x)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, x.argmax(-1))


@pytest.mark.parametrize("words", [sampling.RUN * 2, 5000])
def test_strided_scores_give_argmax_too(words):
    x = _scores(words, 6, seed=3).t()  # [6, words], not contiguous
    assert not x.is_contiguous() and torch.equal(sampling.greedy_tokens(x), x.argmax(-1))
    y = _scores(6, 2 * words, seed=4)[:, ::2]
    assert torch.equal(sampling.greedy_tokens(y), y.argmax(-1))


def test_compiled_the_tokens_equal_argmax():
    """As in the engine's compiled forward (Inductor; on the CPU its C++ code)."""
    fn = torch.compile(sampling.greedy_tokens, dynamic=True)
    for rows, words in ((3, 128256), (17, 5000), (1, 2048)):
        x = _scores(rows, words, seed=rows)
        assert torch.equal(fn(x), x.argmax(-1)), (rows, words)


class _Runner:
    def __init__(self, cache, do_sample=False, return_logprobs=False):
        self.cache, self.do_sample, self.return_logprobs = cache, do_sample, return_logprobs


@pytest.mark.parametrize("compiling,vmem_cache,do_sample,logprobs,ours", [
    (True, True, False, False, True), (True, True, True, False, False), (True, True, False, True, False),
    (True, False, False, False, False), (False, True, False, False, False)])
def test_the_hook_takes_the_engines_path_but_for_greedy_compiled_tokens_of_a_vmem_cache(
        compiling, vmem_cache, do_sample, logprobs, ours, monkeypatch):
    engine_calls = []

    def engine_sample(self, scores, output_ids):
        engine_calls.append(1)

    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    cache = object.__new__(VmemCBCache) if vmem_cache else object()
    runner = _Runner(cache, do_sample, logprobs)
    scores = _scores(4, 3000, seed=1).unsqueeze(0)
    out = torch.full((2, 8), -1, dtype=torch.int32)
    hooks.two_step_greedy(engine_sample)(runner, scores, out)
    assert bool(engine_calls) != ours
    if ours:
        assert out[0, :4].tolist() == scores[0].argmax(-1).tolist() and out[0, 4:].tolist() == [-1] * 4
        assert out[1].tolist() == [-1] * 8  # log-probabilities' row untouched
    else:
        assert out.tolist() == [[-1] * 8] * 2


def test_traced_the_hook_is_one_graph_writing_the_tokens():
    """Under ``torch.compile`` (fullgraph: no break, no host sync), for rows of any count."""
    cache = object.__new__(VmemCBCache)

    def sample(scores, out):
        hooks.two_step_greedy(lambda *a: None)(_Runner(cache), scores, out)
        return out

    fn = torch.compile(sample, fullgraph=True, dynamic=True, backend="eager")
    for rows in (3, 9):
        scores = _scores(rows, 5000, seed=rows).unsqueeze(0)
        out = fn(scores, torch.full((2, 16), -1, dtype=torch.int64))
        assert out[0, :rows].tolist() == scores[0].argmax(-1).tolist()
