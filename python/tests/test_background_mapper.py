"""Reads of a request's row past its length while vmem's background thread maps it (#30, item 1).

On host memory the cache backs every slot without a page with one read-only page of zeros, and
the background thread replaces those slots with pages while Python reads them through NumPy,
without any lock. Before the fix a slot was unmapped (``PROT_NONE``) for a moment before its
page was mapped, and a read then killed the process with SIGSEGV (every run of this loop here;
the issue's shorter loop, 4 runs in 5 on the reporter's machine).
The loop runs in a subprocess so that a crash fails this test instead of ending pytest.
"""

import subprocess
import sys

import pytest

np = pytest.importorskip("numpy")

LOOP = """
import numpy as np
import vmem
for _ in range({n}):
    kv = vmem.KVCache(layers=2, kv_heads=2, head_dim=64, max_batch=2, max_context=4096,
                      dtype="fp16", page_size="64K", device="cpu")
    assert kv.config()["zero_page"] and kv.config()["overlap"]
    K = np.from_dlpack(kv.layer(1)[0])
    # Every row, while the background thread maps the first id's pages over zero slots.
    for _ in range(3):
        assert K.sum() == 0
    r = kv.alloc()
    kv.step({{r: 10}})
    K[r, :10] = 1
    # Past the request's 10 tokens, and the next id's row, which the thread maps now.
    for _ in range(3):
        assert K.sum() == 10 * 2 * 64
    kv.close()
print("loops", {n})
"""


def test_reading_past_a_requests_length_while_the_background_thread_maps_never_faults():
    n = 1000
    r = subprocess.run([sys.executable, "-c", LOOP.format(n=n)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"exit {r.returncode} (-11 is SIGSEGV)\n{r.stdout}\n{r.stderr}"
    assert f"loops {n}" in r.stdout
