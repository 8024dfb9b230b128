"""What the server tests share (not a test module): a tiny random Llama with a tokenizer made
here, saved as a model directory; a ``vmem-serve`` started as a subprocess on 127.0.0.1 with a
free port; reading its metrics. Every wait is bounded."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from typing import Any, Dict, List, Optional

#: The made-up vocabulary: specials, the chat template's words, then words w0..w{WORDS-1}.
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]
TEMPLATE_WORDS = ["system", "user", "assistant", "developer", ":"]
WORDS = 200
CHAT_TEMPLATE = ("{{ bos_token }} {% for m in messages %}{{ m['role'] }} : {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}assistant :{% endif %}")
#: How long a server may take to start (imports, model load) on a busy 2-core machine.
START_TIMEOUT = 120.0
#: The tiny servers' vmem options: 64 KiB pages (the host backend), 4 rows of 256 tokens, 8 MiB.
TINY_ARGS = ["--page-size", "64K", "--memory", "8M", "--max-requests", "4", "--max-context", "256",
             "--log-level", "warning"]


def require() -> None:
    """Skips the calling module, saying why, where the server cannot run: no torch or
    transformers (the torch-less stage), a transformers vmem does not serve, or the server's
    dependencies (the serving stage installs them)."""
    import pytest

    pytest.importorskip("torch", reason="torch is not installed: the server tests run in scripts/test.sh serving")
    pytest.importorskip("transformers", reason="transformers is not installed")
    for name in ("fastapi", "uvicorn", "httpx", "prometheus_client", "openai", "tokenizers"):
        pytest.importorskip(name, reason=f"{name} is not installed (pip install 'vmem[server]' openai)")
    import tf_engine

    tf_engine.skip_unless_served()


def generate(path: str, prompt: List[int], max_new_tokens: int) -> List[int]:
    """``generate()``'s greedy tokens for ``prompt`` with the model at ``path`` (its own
    attention, a DynamicCache), stopping at EOS as the server does."""
    import torch

    model = _model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


@functools.lru_cache(maxsize=4)
def _model(path: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def client(url: str, key: str = "none", timeout: float = 60.0) -> Any:
    """The official OpenAI client for the server at ``url``, retries off."""
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=timeout)


def vocabulary() -> List[str]:
    return SPECIALS + TEMPLATE_WORDS + [f"w{i}" for i in range(WORDS)]


def make_model_dir(path: str, seed: int = 0, max_position_embeddings: int = 512, logit_scale: float = 20.0) -> str:
    """A tiny random Llama (2 layers, hidden 64) and a WordLevel tokenizer over
    :func:`vocabulary` with a chat template, saved at ``path``. The output head is scaled by
    ``logit_scale`` so greedy choices are decisive (the same in any attention kernel)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight.mul_(logit_scale)
    model.save_pretrained(path)
    return path


def words(ids: List[int]) -> str:
    v = vocabulary()
    return " ".join(v[i] for i in ids)


class Server:
    """``vmem-serve ARGS`` on 127.0.0.1 with a free port (``--port 0``; the port is read from its
    ``ready at`` line), its stderr kept in a file."""

    def __init__(self, args: List[str], log_path: str, env: Optional[Dict[str, str]] = None) -> None:
        self.log_path = log_path
        self.log = open(log_path, "wb")
        full_env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([sys.executable, "-m", "vmem.server", "--host", "127.0.0.1", "--port", "0",
                                      *args], stdout=self.log, stderr=subprocess.STDOUT, env=full_env)
        self.url = ""

    def output(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode(errors="replace")

    def wait_ready(self, timeout: float = START_TIMEOUT) -> "Server":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(r"ready at (http://[\d.]+:\d+)", self.output())
            if m:
                self.url = m.group(1)
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            time.sleep(0.1)
        self.stop()
        raise AssertionError(f"the server was not ready in {timeout} s:\n{self.output()[-4000:]}")

    def get(self, path: str, timeout: float = 10.0) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()

    def metrics(self) -> Dict[str, float]:
        """``/metrics`` as {series: value} (labels kept in the key)."""
        status, text = self.get("/metrics")
        assert status == 200, text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The one series of ``name`` (labels ignored)."""
        found = [v for k, v in self.metrics().items() if k == name or k.startswith(name + "{")]
        assert len(found) == 1, (name, found)
        return found[0]

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        return int(self.proc.returncode)


def post_json(url: str, body: Any, headers: Optional[Dict[str, str]] = None, raw: Optional[bytes] = None,
              timeout: float = 30.0) -> tuple[int, Dict[str, str], Any]:
    """POSTs ``body`` (or ``raw`` bytes); (status, headers, parsed JSON or text)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text
