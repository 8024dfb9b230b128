"""``kernel="flashinfer"`` on the CPU (CI): the optional dependency (imported lazily, a clear error
when missing), the option's validation, the refusals, and the plan arrays. FlashInfer's kernels
need a GPU: here the plan is checked by :func:`paged_reference`, which interprets (qo_indptr,
kv_indptr, kv_indices, kv_last_page_len) over the row caches as FlashInfer's paged attention does,
against FA's CPU reference; in the engine, the reader runs that reference (a stub stands in for
the package). test_gpu.py runs the real kernels against FA on the GPU."""

import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI's lint stage has none)")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")
import tf_engine as eng
from tf_engine import fake_memory_and_uninstall  # noqa: E402,F401  (autouse: memory faked, patch off after)

eng.skip_unless_served()

from harness import check as h

import vmem
import vmem.transformers as vt
from vmem.kernels import fa as vk_fa
from vmem.kernels import flashinfer as vt_fi
from vmem.kernels.fi_reader import FlashInferReader
from vmem.transformers.sizing import Geometry

OPTS = dict(page_size="64K", max_requests=4, max_context=1024, memory="8M")
LENGTHS = [5, 140, 270, 17, 33, 64]
NEW = 4
TOL = 1e-4


@pytest.fixture
def stub_flashinfer(monkeypatch):
    """A stand-in ``flashinfer`` package: importable, with no kernels (on the CPU the reader never
    calls them)."""
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))


@pytest.fixture
def no_flashinfer(monkeypatch):
    """FlashInfer absent: ``import flashinfer`` raises ImportError (whether or not it is installed)."""
    monkeypatch.setitem(sys.modules, "flashinfer", None)


# -- the optional dependency ------------------------------------------------------------------------
def test_importing_vmem_transformers_does_not_import_flashinfer(tmp_path):
    """A fake ``flashinfer`` on the path records being imported: ``import vmem.transformers`` (and
    install() with the default kernel) leaves it alone; install(kernel="flashinfer") imports it."""
    pkg = tmp_path / "flashinfer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import builtins\nbuiltins.FLASHINFER_IMPORTED = True\n")
    code = (
        "import builtins, sys\n"
        "import vmem.transformers as vt\n"
        "vt.install()\n"
        "assert 'flashinfer' not in sys.modules and not hasattr(builtins, 'FLASHINFER_IMPORTED'), 'imported early'\n"
        "vt.install(kernel='flashinfer')\n"
        "assert builtins.FLASHINFER_IMPORTED and vt.options().kernel == 'flashinfer'\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_missing_flashinfer_is_refused_at_install_and_serving(no_flashinfer):
    vt.install(**OPTS)
    with pytest.raises(vmem.InvalidArgument, match=r'pip install "vmem-kv\[flashinfer\]"'):
        vt.install(kernel="flashinfer")
    assert vt.options().kernel == "fa"  # nothing changed
    with pytest.raises(vmem.InvalidArgument, match=r"kernel='fa'"), vt.serving(kernel="flashinfer"):
        pytest.fail("the block ran without FlashInfer")
    assert vt.options().kernel == "fa"
    with pytest.raises(vmem.InvalidArgument, match="flashinfer"):  # a cache built with the Options directly
        _cache(vt.Options(**OPTS, kernel="flashinfer"))


@pytest.mark.parametrize("bad", [dict(kernel="flashinfer"), dict(pool_idle_s="2"), dict(graph_seqlen_k="Bucket")])
def test_a_refused_serving_block_patches_nothing(no_flashinfer, bad):
    """serving() validated its options only after install(): a refused block (FlashInfer missing,
    a bad option) left the engine patched and the attention names registered, though it never ran."""
    from vmem.transformers import patches

    vt.uninstall()
    assert not patches.installed()
    with pytest.raises(vmem.InvalidArgument), vt.serving(**bad):
        pytest.fail("the block ran")
    assert not patches.installed(), "the refused block installed the engine patch"
    assert vt.options() == vt.Options()


def test_the_extra_pins_the_verified_flashinfer():
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert f'flashinfer = ["flashinfer-python{vt_fi.FLASHINFER_RANGE}"]' in pyproject


# -- the option -------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["FlashInfer", "flash_infer", "flashinfer ", b"flashinfer", 1, True, None])
def test_the_kernel_option_is_checked(bad, stub_flashinfer):
    with pytest.raises(vmem.InvalidArgument, match="kernel"):
        vt.install(kernel=bad)
    vt.install(kernel="flashinfer")
    assert vt.options().kernel == "flashinfer" and "flashinfer" in vt.KERNELS


def _config(head_dim=64, heads=4, kv_heads=2, layers=2):
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=heads * head_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       head_dim=head_dim, num_hidden_layers=layers, intermediate_size=64, vocab_size=128,
                       max_position_embeddings=1024)


@pytest.mark.parametrize("dtype,head_dim,ok", [
    (torch.bfloat16, 128, True), (torch.float16, 64, True), (torch.float32, 64, False),
    (torch.bfloat16, 96, False), (torch.float16, 256, False), (torch.float8_e4m3fn, 128, False),
])
def test_dtypes_and_head_dims_flashinfer_does_not_serve_are_refused_on_cuda(dtype, head_dim, ok):
    # Geometry only computes (nothing is allocated), so a CUDA device can be named on the CPU.
    opts = vt.Options(**OPTS, kernel="flashinfer")
    make = lambda: Geometry(_config(head_dim), dtype, torch.device("cuda"), opts, 64 << 20)  # noqa: E731
    if ok:
        assert make().block_size == make().tokens_per_page  # exact lengths: a block is one page
    else:
        with pytest.raises(vmem.InvalidArgument, match="kernel='flashinfer' serves"):
            make()


def test_pages_past_flashinfers_32_bit_strides_are_refused():
    ok = torch.empty_strided((2, 8192, 8, 128), (8192 * 65536, 65536, 128, 1), device="meta")
    vt_fi.check_strides(ok)  # token-major Llama-3-8B rows of 8,192 tokens as one page: 2^29 elements a page
    big = torch.empty_strided((2, 65536, 8, 128), (65536 * 65536, 65536, 128, 1), device="meta")
    vt_fi.check_strides(vt_fi.page_view(big, 256))  # 65,536-token rows read as 256-token pages: 2^24 a page
    with pytest.raises(vmem.InvalidArgument, match="32-bit"):
        vt_fi.check_strides(big)  # the same row as one page: 2^32 elements
    with pytest.raises(vmem.InvalidArgument, match="32-bit"):
        vt_fi.check_strides(torch.empty_strided((2, 16, 8, 128), (2048 * 16, 2048, 1, 8), device="meta"))


@pytest.mark.parametrize("ctx, page", [(1024, 256), (8192, 256), (48, 16), (64, 64), (1000, 8), (7, 1)])
def test_a_row_is_read_as_the_largest_power_of_two_pages_up_to_256_that_divide_it(ctx, page):
    assert vt_fi.page_tokens(ctx) == page and ctx % page == 0


@pytest.mark.parametrize("ctx", [0, -5])
def test_page_tokens_refuses_empty_rows(ctx):
    with pytest.raises(vmem.VmemError):
        vt_fi.page_tokens(ctx)


@pytest.mark.parametrize("strided", [False, True])
def test_the_page_view_is_the_rows_memory_page_by_page(strided):
    rows, ctx, page = 3, 48, 16
    k4, _ = _rows(rows, ctx, 2, 4, strided, None)
    k4.copy_(torch.arange(k4.numel(), dtype=k4.dtype).view(k4.shape))
    pages = vt_fi.page_view(k4, page)
    assert pages.shape == (rows * ctx // page, page, 2, 4) and pages.data_ptr() == k4.data_ptr()
    for r in range(rows):
        for k in range(ctx // page):
            assert torch.equal(pages[r * (ctx // page) + k], k4[r, k * page:(k + 1) * page])
    with pytest.raises(vmem.VmemError, match="not pages"):
        vt_fi.page_view(k4, 20)  # 20 does not divide 48
    with pytest.raises(vmem.VmemError, match="not pages"):
        vt_fi.page_view(k4[:, :24], 8)  # rows not max_context token strides apart


# -- the plan ---------------------------------------------------------------------------------------
def _rows(rows, ctx, hkv, d, strided, g):
    """``[rows, ctx, hkv, d]`` K and V full of NaN: contiguous, or strided views of a
    token-major-like buffer (K and V of 3 layers interleaved per token)."""
    if not strided:
        return (torch.full((rows, ctx, hkv, d), float("nan")) for _ in range(2))
    base = torch.full((rows, ctx, 3, 2, hkv, d), float("nan"))
    return base[:, :, 1, 0], base[:, :, 1, 1]


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_paged_plan_of_a_mixed_round_reads_what_fa_reads(seed, strided):
    """Rows in random order, decodes and prefill chunks mixed, NaN past every request's length:
    the plan's arrays are the rows as pages, and FlashInfer's paged attention over them (the
    reference) equals FA's varlen reference over the flat views."""
    g = torch.Generator().manual_seed(seed)
    rows, ctx, hkv, hq, d = 7, 48, 2, 6, 8
    k4, v4 = _rows(rows, ctx, hkv, d, strided, g)
    entries = eng.random_mixed_round(g, k4, v4)
    plan = vt_fi.paged_plan(entries, ctx)
    qs = [e[2] for e in entries]
    assert plan.qo_indptr.tolist() == [sum(qs[:i]) for i in range(len(qs) + 1)]
    assert plan.kv_indptr.tolist() == list(range(len(entries) + 1))
    assert plan.kv_indices.tolist() == [row for row, _, _ in entries] and plan.page_size == ctx and not plan.decode
    assert plan.kv_last_page_len.tolist() == [p + q for _, p, q in entries]
    assert all(t.dtype == torch.int32 for t in (plan.qo_indptr, plan.kv_indptr, plan.kv_indices,
                                                 plan.kv_last_page_len))
    q = torch.randn(plan.total_q, hq, d, generator=g)
    scale = 0.3
    got = vt_fi.paged_reference(q, k4, v4, plan, scale)
    assert torch.isfinite(got).all()
    flat = [t.as_strided((rows * ctx, hkv, d), t.stride()[1:]) for t in (k4, v4)]
    want = vk_fa.fa_varlen_reference(q, *flat, vk_fa.fa_varlen_indices(entries, ctx).to("cpu"), scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [1, 8, 16, 24])
@pytest.mark.parametrize("seed", [0, 1])
def test_rows_read_as_pages_read_what_fa_reads(seed, page):
    """The same mixed rounds read as pages of ``page`` tokens: each request lists its row's first
    ``ceil(length / page)`` pages in order, the last filled to the rest, and the reference over
    the page views equals FA's over the flat views (NaN past every length: nothing more is read)."""
    g = torch.Generator().manual_seed(seed)
    rows, ctx, hkv, hq, d = 7, 48, 2, 6, 8
    k4, v4 = _rows(rows, ctx, hkv, d, True, g)
    entries = eng.random_mixed_round(g, k4, v4)
    plan = vt_fi.paged_plan(entries, ctx, page)
    per_row, ip = ctx // page, plan.kv_indptr.tolist()
    for b, (row, past, q) in enumerate(entries):
        n = -(-(past + q) // page)
        assert ip[b + 1] - ip[b] == n
        assert plan.kv_indices[ip[b]:ip[b + 1]].tolist() == list(range(row * per_row, row * per_row + n))
        assert (n - 1) * page + int(plan.kv_last_page_len[b]) == past + q
    q = torch.randn(plan.total_q, hq, d, generator=g)
    got = vt_fi.paged_reference(q, vt_fi.page_view(k4, page), vt_fi.page_view(v4, page), plan, 0.3)
    flat = [t.as_strided((rows * ctx, hkv, d), t.stride()[1:]) for t in (k4, v4)]
    want = vk_fa.fa_varlen_reference(q, *flat, vk_fa.fa_varlen_indices(entries, ctx).to("cpu"), 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("page", [0, -16, 5, 96])
def test_pages_that_do_not_divide_the_row_are_refused(page):
    with pytest.raises(vmem.VmemError, match="divide"):
        vt_fi.paged_plan([(0, 0, 1)], 48, page)


def test_the_reference_refuses_a_plan_that_reads_past_its_pages():
    k = torch.zeros(4, 8, 1, 4)
    for last in (0, 9):
        plan = vt_fi.PagedPlan(torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([2]), torch.tensor([last]),
                               8, True, 1)
        with pytest.raises(vmem.VmemError, match="pages"):
            vt_fi.paged_reference(torch.zeros(1, 1, 4), k, k, plan)


def test_a_decode_round_plans_for_the_decode_wrapper():
    plan = vt_fi.paged_plan([(3, 0, 1), (0, 9, 1), (2, 15, 1)], 16)
    assert plan.decode and plan.total_q == 3
    assert plan.kv_indices.tolist() == [3, 0, 2] and plan.kv_last_page_len.tolist() == [1, 10, 16]


@pytest.mark.parametrize("entries", [[], [(0, 10, 7)], [(0, 0, 0)], [(0, -1, 2)], [(-1, 0, 1)]])
def test_paged_plan_refuses_bad_entries(entries):
    with pytest.raises(vmem.VmemError):
        vt_fi.paged_plan(entries, 16)


# -- in the engine (the reference as the kernel) ----------------------------------------------------
def _cache(options):
    cb = transformers.ContinuousBatchingConfig(max_batch_tokens=64)
    return vt.cache_class()(h.make_config("llama-gqa"), cb, "cpu", dtype=torch.float32, options=options)


@pytest.mark.parametrize("split", [256, 16])
@pytest.mark.parametrize("layout", vt.LAYOUTS)
def test_flashinfer_kernel_in_the_engine_matches_fa(layout, split, stub_flashinfer, monkeypatch):
    """Chunked prefill (mixed rounds) and decode rounds through the engine with kernel="flashinfer":
    logits match the DynamicCache reference, greedy tokens equal kernel="fa"'s, and the plan is
    made once per round (not per layer). Rows are read as pages of up to ``split`` tokens (16:
    most requests span several)."""
    monkeypatch.setattr(vt_fi, "SPLIT_TOKENS", split)
    plans = []
    real = vt_fi.paged_plan
    monkeypatch.setattr(vt_fi, "paged_plan", lambda *a: plans.append(1) or real(*a))
    model = h.make_model("llama-gqa", torch.float32, "cpu", logit_scale=20.0)
    prompts = h.make_prompts(len(LENGTHS), LENGTHS, model.config.vocab_size)
    runs = {}
    for kernel in ("flashinfer", "fa"):
        with vt.serving(**OPTS, layout=layout, kernel=kernel):
            runs[kernel] = h.run_engine(model, vt.VMEM_ATTENTION, prompts, NEW, cb_kwargs=dict(max_batch_tokens=64),
                                        stagger=[0, 0, 0, 3, 6, 9])
    ours = runs["flashinfer"]
    assert ours["cache"].kernel == "flashinfer" and isinstance(ours["cache"].read, FlashInferReader)
    assert ours["cache"].read.page == split
    assert len(plans) == ours["rounds"], (len(plans), ours["rounds"])
    cmp = h.compare(ours, model, NEW)
    assert cmp["counts_ok"] and cmp["max_rel_err"] < TOL, cmp
    assert cmp["decisive"] > 0 and cmp["top1_agree"] == cmp["decisive"], cmp
    for rid in ours["ids"]:
        assert list(ours["results"][rid].generated_tokens) == list(runs["fa"]["results"][rid].generated_tokens)
    assert h.cross_compare(ours, runs["fa"]) < TOL
