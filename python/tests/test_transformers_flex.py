"""vmem.kernels.flex's CPU reference against torch's own (eager) FlexAttention, for block
masks of the three kinds the reader builds: rows (decode), broadcast decode and packed."""

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed")

from vmem.kernels.flex import blockwise_reference

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

KB = 128


def _mask(num, idx, mask_mod, q_len, kv_len):
    from torch.nn.attention.flex_attention import BlockMask

    return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=(KB, KB), mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


@pytest.mark.parametrize("seed", [0, 1])
def test_rows_decode_matches_eager_flex(seed):
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(seed)
    rows, hq, hkv, ctx, d = 5, 4, 2, 512, 16
    lengths = torch.tensor([0, 300, 5, 129, 512], dtype=torch.int32)
    num = ((lengths + KB - 1) // KB).view(rows, 1, 1)
    idx = torch.arange(ctx // KB, dtype=torch.int32).expand(rows, 1, 1, ctx // KB).contiguous()

    def mask_mod(b, h, q, kv):
        return kv < lengths[b]

    q = torch.randn(rows, hq, 1, d, generator=g)
    k = torch.randn(rows, hkv, ctx, d, generator=g)
    v = torch.randn(rows, hkv, ctx, d, generator=g)
    m = _mask(num, idx, mask_mod, 1, ctx)
    got = blockwise_reference(q, k, v, block_mask=m, scale=0.25, enable_gqa=True)
    want = flex_attention(q, k, v, block_mask=m, scale=0.25, enable_gqa=True)
    live = lengths > 0  # rows with no block listed: zeros here, whatever eager Flex leaves
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert (got[~live] == 0).all()


def test_packed_matches_eager_flex_and_reads_only_listed_blocks():
    """Two requests packed in 300 query tokens over a flat KV of 4 rows x 256; the KV outside the
    listed blocks is NaN, so reading it would show."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(3)
    hq, hkv, d, ctx, rows = 2, 1, 8, 256, 4
    # request 0: row 2, past 0, q 200; request 1: row 0, past 40, q 100
    owner = torch.tensor([2] * 200 + [0] * 100 + [0] * (384 - 300), dtype=torch.int32)
    pos = torch.tensor(list(range(200)) + list(range(40, 140)) + [0] * 84, dtype=torch.int32)
    lists = [[4, 5], [4, 5, 0, 1], [0, 1]]  # Q block 0: row 2's blocks; 1: both requests'; 2: row 0's
    width = 4
    idx = torch.zeros(1, 1, 3, width, dtype=torch.int32)
    num = torch.zeros(1, 1, 3, dtype=torch.int32)
    for i, lst in enumerate(lists):
        idx[0, 0, i, :len(lst)] = torch.tensor(lst)
        num[0, 0, i] = len(lst)

    def mask_mod(b, h, qi, kv):
        return (kv // ctx == owner[qi]) & (kv % ctx <= pos[qi])

    q = torch.randn(1, hq, 300, d, generator=g)
    k = torch.randn(1, hkv, rows * ctx, d, generator=g)
    v = torch.randn(1, hkv, rows * ctx, d, generator=g)
    m = _mask(num, idx, mask_mod, 300, rows * ctx)
    want = flex_attention(q, k, v, block_mask=m, enable_gqa=True)
    listed = torch.zeros(rows * ctx, dtype=torch.bool)
    for lst in lists:
        for b in lst:
            listed[b * KB:(b + 1) * KB] = True
    k[:, :, ~listed] = float("nan")
    v[:, :, ~listed] = float("nan")
    got = blockwise_reference(q, k, v, block_mask=m, enable_gqa=True)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
