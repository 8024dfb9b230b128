"""Async batching's carry-over ids (:mod:`vmem.transformers.carry_over`): the same tensor as the
engine's own ``infer_carry_over_ids``, built without a Python list of ``max_batch_tokens``
entries, and in place only while vmem is installed.

CPU; needs torch and a transformers vmem serves (skipped otherwise, saying why)."""

import random
import types

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng  # noqa: E402
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from transformers.generation.continuous_batching import input_outputs as io  # noqa: E402

import vmem.transformers as vt  # noqa: E402
from vmem.transformers.carry_over import infer_carry_over_ids  # noqa: E402

ENGINES = io.ContinuousBatchingAsyncIOs.infer_carry_over_ids  # the engine's own (vmem not installed yet)


def _ios(prev: dict[str, int], nxt: dict[str, int], max_batch_tokens: int, current: int) -> object:
    pairs = [None, None]
    pairs[current] = types.SimpleNamespace(host_io=types.SimpleNamespace(req_id_to_new_token_position=nxt))
    pairs[1 - current] = types.SimpleNamespace(host_io=types.SimpleNamespace(req_id_to_new_token_position=prev))
    return types.SimpleNamespace(io_pairs=pairs, current_pair=current, max_batch_tokens=max_batch_tokens)


@pytest.mark.parametrize("seed", range(40))
def test_the_same_ids_as_the_engines(seed):
    rng = random.Random(seed)
    mbt = rng.choice([1, 7, 64, 512, 8192])
    ids = [f"r{i}" for i in range(rng.randint(0, min(mbt, 300)))]
    prev_ids = rng.sample(ids, rng.randint(0, len(ids)))  # round N's requests, some finished since
    next_ids = rng.sample(ids, rng.randint(0, len(ids)))  # round N+1's, some new
    prev = {r: p for p, r in enumerate(prev_ids)}
    positions = sorted(rng.sample(range(mbt), len(next_ids)))  # where each request's new token lands
    nxt = dict(zip(next_ids, positions))
    ios = _ios(prev, nxt, mbt, seed % 2)
    want, got = ENGINES(ios), infer_carry_over_ids(ios)
    assert got.dtype == want.dtype == torch.int32 and got.shape == want.shape == (mbt,)
    assert torch.equal(got, want)
    carried = {r for r in prev if r in nxt}
    assert int((got >= 0).sum()) == len(carried)  # the check can fail: each carried request once


def test_in_place_only_while_installed_and_only_for_a_vmem_cache(monkeypatch):
    """Installed, the engine's member is vmem's hook over the engine's own; the hook gives vmem's
    ids for a vmem cache and the engine's for any other (the engine's baseline runs as shipped)."""
    from vmem.transformers import carry_over
    from vmem.transformers.cache import VmemCBCache

    cls = io.ContinuousBatchingAsyncIOs
    assert cls.infer_carry_over_ids is ENGINES
    vt.install(**eng.TINY_OPTS)
    hooked = cls.__dict__["infer_carry_over_ids"]
    assert hooked is not ENGINES and hooked.__wrapped__ is ENGINES
    vmems = torch.full((4,), 7, dtype=torch.int32)
    monkeypatch.setattr(carry_over, "infer_carry_over_ids", lambda self: vmems)
    ios = _ios({"a": 0, "b": 1}, {"b": 0, "c": 1}, 4, 0)
    for pair in ios.io_pairs:
        pair.host_io.cache = object.__new__(VmemCBCache)
    assert hooked(ios) is vmems
    for pair in ios.io_pairs:
        pair.host_io.cache = object()  # the engine's own cache
    assert torch.equal(hooked(ios), ENGINES(ios)) and torch.equal(hooked(ios), torch.tensor([1, -1, -1, -1],
                                                                                             dtype=torch.int32))
    vt.uninstall()
    assert cls.infer_carry_over_ids is ENGINES
