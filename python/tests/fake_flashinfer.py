"""A ``flashinfer`` stand-in for the CPU tests: FlashInfer's two paged wrappers, following its
0.6 rules (graph mode fixes the batch and the first plan the rows; ``plan()`` copies into the
fixed buffers), computing with :func:`vmem.kernels.flashinfer.paged_reference` from what was
planned. FlashInfer's kernels need a CUDA GPU; ``test_gpu.py`` runs the real ones."""

import types

import torch

from vmem.kernels import flashinfer as vt_fi


class FakeFlashInfer:
    """A ``flashinfer`` stand-in: its two paged wrappers, following FlashInfer 0.6's graph-mode
    rules, computing with :func:`paged_reference` from their (fixed) buffers. ``made`` lists every
    wrapper; ``inside`` is set by the tests while the model's forward runs, and
    ``planned_inside`` records, per plan(), whether it ran inside a forward."""

    def __init__(self):
        self.made, self.inside, self.planned_inside = [], [], []
        fake = self

        class Wrapper:
            decode = False

            def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto", use_cuda_graph=False,
                         **bufs):
                assert layout == "NHD" and (use_tensor_cores or not self.decode)
                self.graph, self.bufs, self.plans, self.rows = use_cuda_graph, bufs, 0, None
                self.backend, self.workspace = backend, workspace
                # FlashInfer 0.6: each wrapper makes its own int workspace and pinned staging buffer
                self._int_workspace_buffer, self._pin_memory_int_workspace_buffer = torch.zeros(8), torch.zeros(8)
                if use_cuda_graph:
                    last = bufs["paged_kv_last_page_len_buffer" if self.decode else "paged_kv_last_page_len_buf"]
                    self.batch = len(last)
                fake.made.append(self)

            def reset_workspace_buffer(self, float_workspace, int_workspace):
                self._int_workspace_buffer, self._pin_memory_int_workspace_buffer = int_workspace, torch.zeros(8)

            def _buf(self, name):
                return self.bufs[name if self.decode else {"paged_kv_indptr_buffer": "paged_kv_indptr_buf",
                                                          "paged_kv_indices_buffer": "paged_kv_indices_buf",
                                                          "paged_kv_last_page_len_buffer": "paged_kv_last_page_len_buf"
                                                          }.get(name, name)]

            def _plan(self, qo, indptr, indices, last, page_size, scale):
                fake.planned_inside.append(bool(fake.inside))
                batch = len(last)
                if self.graph:
                    assert batch == self.batch, "the batch size is fixed in graph mode"
                    rows = int(qo[-1])
                    self.rows = rows if self.rows is None else self.rows
                    assert rows <= self.rows, "more rows than the first plan"
                    assert len(indices) <= len(self._buf("paged_kv_indices_buffer"))
                    self._buf("paged_kv_indptr_buffer").copy_(indptr)
                    self._buf("paged_kv_last_page_len_buffer").copy_(last)
                    self._buf("paged_kv_indices_buffer")[: len(indices)].copy_(indices)
                    if not self.decode:
                        self.bufs["qo_indptr_buf"].copy_(qo)
                else:
                    self.eager = (qo.clone(), indptr.clone(), indices.clone(), last.clone())
                self.page_size, self.scale = page_size, scale
                self.plans += 1

            def run(self, q, kv, out=None):
                if self.graph:
                    indptr = self._buf("paged_kv_indptr_buffer")
                    qo = torch.arange(self.batch + 1, dtype=torch.int32) if self.decode else self.bufs["qo_indptr_buf"]
                    plan = vt_fi.PagedPlan(qo, indptr, self._buf("paged_kv_indices_buffer"),
                                           self._buf("paged_kv_last_page_len_buffer"), self.page_size, self.decode,
                                           int(qo[-1]))
                else:
                    qo, indptr, indices, last = self.eager
                    plan = vt_fi.PagedPlan(qo, indptr, indices, last, self.page_size, self.decode, int(qo[-1]))
                assert q.shape[0] == int(plan.qo_indptr[-1])
                got = vt_fi.paged_reference(q, kv[0], kv[1], plan, self.scale)
                if out is None:
                    return got
                assert out.shape == got.shape and out.is_contiguous()
                return out.copy_(got)

        class Decode(Wrapper):
            decode = True

            def plan(self, indptr, indices, last, hq, hkv, d, page_size, q_data_type=None, kv_data_type=None,
                     sm_scale=None):
                self._plan(torch.arange(len(last) + 1, dtype=torch.int32), indptr, indices, last, page_size, sm_scale)

        class Prefill(Wrapper):
            def plan(self, qo, indptr, indices, last, hq, hkv, d, page_size, causal=False, q_data_type=None,
                     kv_data_type=None, sm_scale=None, seq_lens=None):
                assert causal
                if seq_lens is not None:  # the keys each request reads, as the plan's pages say
                    got = vt_fi.PagedPlan(qo, indptr, indices, last, page_size, False, int(qo[-1]))
                    keys = [(int(indptr[b + 1] - indptr[b]) - 1) * page_size + int(last[b]) for b in range(len(last))]
                    assert seq_lens.tolist() == keys, (seq_lens, keys, got)
                self._plan(qo, indptr, indices, last, page_size, sm_scale)

        self.module = types.ModuleType("flashinfer")
        self.module.BatchDecodeWithPagedKVCacheWrapper = Decode
        self.module.BatchPrefillWithPagedKVCacheWrapper = Prefill
