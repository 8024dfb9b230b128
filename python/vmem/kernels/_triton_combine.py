"""The CUDA side of :func:`vmem.kernels.fa_split.combine`: one Triton kernel merging each
request's slot outputs by their log-sum-exps. Imported only on CUDA (Triton ships with torch's
CUDA builds); :func:`vmem.kernels.fa_split.combine_reference` is what it must equal.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _combine_kernel(out_ptr, lse_ptr, first_ptr, count_ptr, merged_ptr,  # type: ignore[no-untyped-def]
                    stride_out_s, stride_out_h, stride_lse_h, stride_m_s, stride_m_h,
                    D: tl.constexpr):
    b = tl.program_id(0)  # output row (a request, or a padded row: no slots)
    h = tl.program_id(1)  # query head
    first = tl.load(first_ptr + b)
    count = tl.load(count_ptr + b)
    d = tl.arange(0, D)
    m = tl.full([], float("-inf"), tl.float32)  # tensors from the start: loop-carried types stay fixed
    total = tl.zeros([], tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    j = first
    while j < first + count:  # online softmax over the request's slots
        lse = tl.load(lse_ptr + h * stride_lse_h + j)
        o = tl.load(out_ptr + j * stride_out_s + h * stride_out_h + d).to(tl.float32)
        m_new = tl.maximum(m, lse)
        rescale = tl.exp(m - m_new)
        w = tl.exp(lse - m_new)
        acc = acc * rescale + w * o
        total = total * rescale + w
        m = m_new
        j += 1
    merged = tl.where(count > 0, acc / tl.maximum(total, 1e-30), 0.0)
    tl.store(merged_ptr + b * stride_m_s + h * stride_m_h + d, merged.to(merged_ptr.dtype.element_ty))


def combine_slots(out: torch.Tensor, lse: torch.Tensor, first: torch.Tensor, count: torch.Tensor,
                  dtype: torch.dtype | None = None) -> torch.Tensor:
    """``out`` ``[S, Hq, D]`` (last dim contiguous, ``D`` a power of two), ``lse`` ``[Hq, S]``
    float32 (last dim contiguous), ``first``/``count`` ``[R]`` int32 on the device (``R`` output
    rows, at most ``S``); returns ``[R, Hq, D]`` in ``dtype`` (``out``'s when ``None``)."""
    hq, d = out.shape[1], out.shape[2]
    rows = first.numel()
    if out.stride(-1) != 1:
        out = out.contiguous()
    if lse.stride(-1) != 1:
        lse = lse.contiguous()
    merged = torch.empty((rows, hq, d), dtype=dtype or out.dtype, device=out.device)
    _combine_kernel[(rows, hq)](out, lse, first, count, merged,
                                out.stride(0), out.stride(1), lse.stride(0), merged.stride(0), merged.stride(1),
                                D=d)
    return merged
