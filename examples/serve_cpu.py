"""Serve a small random Llama through transformers' continuous batching on the CPU, with its KV
cache in vmem, and check every request's greedy tokens against ``generate()`` with sdpa.

    pip install "./python[transformers]"     # from a clone (PyPI: pip install "vmem-kv[transformers]")
    python examples/serve_cpu.py

Nothing is downloaded: the model is built from a config with random weights. On a GPU the same
lines serve a real model: ``from_pretrained(name, attn_implementation="vmem")`` and
``device="cuda"`` (docs/serving.md). Exits 1 if any request's tokens differ from ``generate()``'s.
"""

import sys

import torch
import transformers
from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig, LlamaConfig

import vmem
import vmem.transformers

# Before the model is built. vmem serves a request stream from one KV cache of `memory` bytes:
# each request gets a virtually contiguous row of up to `max_context` tokens, whose pages are
# mapped as it grows and unmapped when it finishes (on the CPU: host memory, 256 KB pages).
vmem.transformers.install(memory="64MiB", max_requests=8, max_context=512, page_size="256K")

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                     bos_token_id=1, eos_token_id=2, pad_token_id=0)
model = AutoModelForCausalLM.from_config(config, attn_implementation="vmem", dtype=torch.float32).eval()

lengths = [5, 40, 120, 300, 17, 64]
prompts = [torch.randint(3, config.vocab_size, (n,)).tolist() for n in lengths]
gen = GenerationConfig(max_new_tokens=16, do_sample=False, eos_token_id=2, pad_token_id=0)

# Continuous batching: requests of different lengths join and leave one engine.
outputs = model.generate_batch(prompts, generation_config=gen,
                               continuous_batching_config=ContinuousBatchingConfig(max_batch_tokens=128))
served = {tuple(o.prompt_ids): list(o.generated_tokens) for o in outputs.values()}

# The reference: the same weights, one request at a time through generate() with sdpa.
model.set_attn_implementation("sdpa")
print(f"vmem {vmem.__version__}, transformers {transformers.__version__}, torch {torch.__version__}: "
      f"{len(prompts)} requests, one KV cache of {vmem.transformers.options().memory >> 20} MiB in host memory")
same = 0
for i, prompt in enumerate(prompts):
    with torch.no_grad():
        ref = model.generate(torch.tensor([prompt]), generation_config=gen, attention_mask=None)
    expected = ref[0, len(prompt):].tolist()
    got = served.get(tuple(prompt), [])
    ok = got == expected
    same += ok
    print(f"request {i}: prompt {len(prompt):3} tokens, {len(got)} new: {got[:6]} ... "
          f"{'same as' if ok else 'DIFFERENT from'} generate() with sdpa")
print(f"{same} of {len(prompts)} requests served through continuous batching on vmem "
      f"gave generate()'s greedy tokens")
sys.exit(0 if same == len(prompts) else 1)
