"""Serve a small random Llama through transformers' continuous batching on the CPU, with its KV
cache in vmem, and check every request's greedy tokens against ``generate()`` with sdpa.

    pip install "./python[transformers]"     # from a clone (PyPI: pip install "vmem-kv[transformers]")
    python examples/serve_cpu.py

Nothing is downloaded: the model is built from a config with random weights. On a GPU the same
lines serve a real model (docs/serving.md). Exits 1 if a request's tokens differ from
``generate()``'s. The README and docs/serving.md show the part above the check, verbatim
(python/tests/test_docs.py holds them to it).
"""

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaConfig

import vmem.transformers

# Before the model is built: a 64 MiB KV cache, rows of 512 tokens for 8 requests, 256 KB pages.
vmem.transformers.install(memory="64MiB", max_requests=8, max_context=512, page_size="256K")

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="vmem", dtype=torch.float32).eval()

prompts = [torch.randint(3, 512, (n,)).tolist() for n in (5, 40, 120, 300, 17, 64)]
gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)
outputs = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128))
for out in outputs.values():
    print(f"{len(out.prompt_ids):3} prompt tokens -> {list(out.generated_tokens)}")

# The check: the same weights, one request at a time through generate() with sdpa.
served = {tuple(out.prompt_ids): list(out.generated_tokens) for out in outputs.values()}
model.set_attn_implementation("sdpa")
same = 0
for prompt in prompts:
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), generation_config=gen, attention_mask=None)
    same += served.get(tuple(prompt)) == ref[0, len(prompt):].tolist()
print(f"vmem {vmem.__version__}, transformers {transformers.__version__}, torch {torch.__version__}: "
      f"{same} of {len(prompts)} requests served on vmem gave generate()'s greedy tokens")
if same != len(prompts):
    raise SystemExit(1)
