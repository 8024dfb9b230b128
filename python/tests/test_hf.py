"""vmem.hf.VmemCache with transformers: needs torch and transformers (the GPU script runs it
on the H100 too). Where they are missing the tests are skipped, and pytest says why."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch); scripts/python-gpu.sh run runs this on the GPU machine")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from vmem.transformers import VmemCache  # noqa: E402


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def prefill_then_decode_matches_no_cache(model, ids, cache):
    """Prefill `ids` through `cache`, then decode one greedy token: both steps' logits must match
    the model run without a cache."""
    with torch.no_grad():
        a = model(ids, past_key_values=cache, use_cache=True).logits
        b = model(ids, use_cache=True).logits
        torch.testing.assert_close(a, b)
        nxt = a[:, -1:].argmax(-1)
        a2 = model(nxt, past_key_values=cache, use_cache=True).logits
        ref = model(torch.cat([ids, nxt], 1)).logits[:, -1:]
        torch.testing.assert_close(a2, ref, rtol=1e-4, atol=1e-4)


def test_logits_match_dynamic_cache_on_cpu():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16))
    cache = VmemCache(model.config, 2, 128, device="cpu", dtype=torch.float32, page_size="64K")
    prefill_then_decode_matches_no_cache(model, ids, cache)
    assert cache.get_seq_length() == 17


def test_static_mode_returns_full_views_over_zero_backed_memory_and_matches_dynamic():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16))
    cache = VmemCache(model.config, 2, 256, device="cpu", dtype=torch.float32, page_size="64K", static=True)
    assert cache.is_compileable
    prefill_then_decode_matches_no_cache(model, ids, cache)
    layer = cache.layers[0]
    assert layer.keys.shape == (2, 2, 256, 32)  # [B, H, max_cache_len, D]: static shapes
    assert int(cache.get_seq_length()) == 17
    assert layer.keys[:, :, :17].abs().sum() > 0
    assert not layer.keys[:, :, 17:].any()  # past the tokens: mapped-but-unwritten or zero page
    # Memory: the tokens' pages (a 64K page holds 256 tokens of 2 x 32 fp32) and no more.
    u = cache.memory()
    assert u["mapped_bytes"] == 2 * 2 * 2 * (64 << 10), u
    cache.reset()
    assert cache.memory()["mapped_bytes"] == 0
    assert int(cache.get_seq_length()) == 0 and not layer.keys.any()


def test_static_mode_generate_matches_static_cache_on_cpu():
    model = tiny_llama()
    with torch.no_grad():
        model.lm_head.weight.mul_(50.0)  # decisive logits: greedy tokens must agree exactly
    ids = torch.randint(3, 256, (2, 12))
    mask = torch.ones_like(ids)
    ids[0, :5] = 0
    mask[0, :5] = 0  # left padding
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=20, do_sample=False)
    with torch.no_grad():
        ref = model.generate(**kw, past_key_values=transformers.StaticCache(config=model.config, max_cache_len=64))
        vm = model.generate(**kw, past_key_values=VmemCache(model.config, 2, 64, device="cpu",
                                                            dtype=torch.float32, page_size="64K", static=True))
    assert torch.equal(ref, vm)


def test_vmem_hf_stays_importable_as_a_re_export():
    # VmemCache moved to vmem.transformers.generate; users' `from vmem.hf import VmemCache` keeps working.
    import vmem.hf
    import vmem.transformers as vt

    assert vmem.hf.VmemCache is VmemCache is vt.VmemCache
    assert vmem.hf.VmemLayer is vt.VmemLayer
