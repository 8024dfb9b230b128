"""The serving suite (python/benches/serving_suite.py, issue #32 items 5 and 6): the roofline's
formula on numbers checked by hand, the budgets, the ratios, the merge, the registry lookup
and a ``--tiny`` run on the CPU end to end."""

from __future__ import annotations

import json
import math
import os

import pytest
from harness import roofline as rf

# A shape small enough to add up by hand: qkv 4 x (2 + 2) x 2 = 32, o 2 x 2 x 4 = 16,
# MLP 3 x 4 x 8 = 96 -> 144 per layer; head 4 x 10 = 40.
SHAPE = rf.ModelShape(layers=2, hidden=4, intermediate=8, heads=2, kv_heads=1, head_dim=2, vocab=10, itemsize=2)


def test_shape_sums_its_matmuls_and_kv_by_hand() -> None:
    assert SHAPE.layer_matmul_params == 144
    assert SHAPE.head_params == 40
    assert SHAPE.decode_weight_bytes == (2 * 144 + 40) * 2 == 656
    assert SHAPE.token_kv_bytes == 2 * 2 * 1 * 2 * 2 == 16


def test_shape_of_llama3_8b_config() -> None:
    pytest.importorskip("transformers")
    from harness.models import llama3_8b_config

    s = rf.ModelShape.from_config(llama3_8b_config(8), itemsize=2)
    # q 4096x4096, k and v 4096x1024 each, o 4096x4096, MLP 3 x 4096x14336: Llama-3-8B's 218M a layer
    assert s.layer_matmul_params == 218_103_808
    assert s.token_kv_bytes == 32_768  # 2 x 8 layers x 8 heads x 128 x 2 bytes: the engine's token_bytes
    assert s.head_params == 4096 * 128256


def test_prefill_flops_by_hand() -> None:
    # n = 3: matmuls 2 x 3 x 2 x 144 = 1728, logits 2 x 40 = 80, attention 2 x 2 x 2 x 2 x 3 x 4 = 192
    assert rf.prefill_flops(SHAPE, [3]) == 2000
    # n = 1: 576 + 80 + 2 x 2 x 2 x 2 x 1 x 2 = 32
    assert rf.prefill_flops(SHAPE, [1, 3]) == 688 + 2000


def test_decode_reads_and_steps_by_hand() -> None:
    w = rf.Workload(prompt_lens=(3, 5), new_tokens=4, budget_tokens=100, max_batch_tokens=100)
    assert rf.decode_tokens(w) == 6
    assert rf.kv_token_reads(w) == (4 + 5 + 6) + (6 + 7 + 8) == 36
    assert rf.decode_steps(w) == 3  # the longest request's 3 decode tokens
    # max_batch_tokens binds: 6 decode tokens, 1 a step
    assert rf.decode_steps(rf.Workload((3, 5), 4, 100, 1)) == 6
    # the budget binds: 36 token-steps of KV, 5 tokens held a step -> 8 steps
    assert rf.decode_steps(rf.Workload((3, 5), 4, 5, 100)) == 8
    assert rf.decode_steps(rf.Workload((3, 5), 1, 5, 100)) == 0  # the prefill makes the only token
    assert rf.kv_token_reads(rf.Workload((3, 5), 1, 5, 100)) == 0


def test_lower_bound_by_hand() -> None:
    w = rf.Workload(prompt_lens=(3, 5), new_tokens=4, budget_tokens=100, max_batch_tokens=100)
    b = rf.lower_bound(SHAPE, w, rf.Peaks(matmul_flops=1000.0, copy_bytes=100.0))
    # prefill: 2000 + (2880 + 80 + 480) = 5440 FLOPs at 1000/s; decode: 3 x 656 + 36 x 16 = 2544 B at 100/s
    assert b["prefill_flops"] == 5440
    assert b["weight_bytes"] == 1968 and b["kv_read_bytes"] == 576
    assert b["prefill_s"] == pytest.approx(5.44)
    assert b["decode_s"] == pytest.approx(25.44)
    assert b["bound_s"] == pytest.approx(30.88)
    # a smaller budget only adds steps (weight reads), never KV bytes
    tight = rf.lower_bound(SHAPE, rf.Workload((3, 5), 4, 5, 100), rf.Peaks(1000.0, 100.0))
    assert tight["kv_read_bytes"] == 576 and tight["weight_bytes"] == 8 * 656


@pytest.mark.parametrize("kw", [{"layers": 0}, {"vocab": -1}, {"heads": True}, {"hidden": 4.0}])
def test_shape_refuses_what_is_no_count(kw) -> None:
    args = {**vars(SHAPE), **kw}
    with pytest.raises(ValueError, match=f"ModelShape.{next(iter(kw))}"):
        rf.ModelShape(**args)


@pytest.mark.parametrize("args, match", [
    (((), 4, 10, 10), "prompts of at least 1"), (((3, 0), 4, 10, 10), "prompts of at least 1"),
    (((3,), 0, 10, 10), "new_tokens"), (((3,), 4, 0, 10), "budget_tokens"), (((3,), 4, 10, "8"), "max_batch_tokens"),
])
def test_workload_refuses_what_cannot_be_served(args, match) -> None:
    with pytest.raises(ValueError, match=match):
        rf.Workload(*args)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf, "1e12"])
def test_peaks_refuse_what_is_no_rate(bad) -> None:
    with pytest.raises(ValueError, match="Peaks.matmul_flops"):
        rf.Peaks(matmul_flops=bad, copy_bytes=1.0)


def test_measure_peaks_on_the_cpu_gives_rates() -> None:
    torch = pytest.importorskip("torch")
    p = rf.measure_peaks("cpu", torch.float32, n=64, copy_mib=1, reps=2)
    assert math.isfinite(p.matmul_flops) and p.matmul_flops > 0
    assert math.isfinite(p.copy_bytes) and p.copy_bytes > 0
