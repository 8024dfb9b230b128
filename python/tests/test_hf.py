"""vmem.hf.VmemCache with transformers: needs torch and transformers (the GPU script runs it
on the H100 too). Where they are missing the tests are skipped, and pytest says why."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (CI has no torch); tests/gpu_check.py runs this on the GPU")
transformers = pytest.importorskip("transformers", reason="transformers is not installed")

from vmem.hf import VmemCache  # noqa: E402


def tiny_llama():
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def test_logits_match_dynamic_cache_on_cpu():
    model = tiny_llama()
    ids = torch.randint(0, 256, (2, 16))
    cache = VmemCache(model.config, 2, 128, device="cpu", dtype=torch.float32, page_size="64K")
    with torch.no_grad():
        a = model(ids, past_key_values=cache, use_cache=True).logits
        b = model(ids, use_cache=True).logits
        torch.testing.assert_close(a, b)
        nxt = a[:, -1:].argmax(-1)
        a2 = model(nxt, past_key_values=cache, use_cache=True).logits
        ref = model(torch.cat([ids, nxt], 1)).logits[:, -1:]
        torch.testing.assert_close(a2, ref, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 17
