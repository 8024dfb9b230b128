/* SPDX-License-Identifier: MIT */
/*
 * uvm_vmem.h - vMem ioctl handlers and the hooks UVM calls at teardown.
 *
 * Copyright (c) 2026 the vmem authors.
 */
#ifndef _UVM_VMEM_H
#define _UVM_VMEM_H

#include "uvm_forward_decl.h"
#include "uvm_vmem_ioctl.h"

NV_STATUS uvm_api_vmem_query(struct uvm_vmem_query_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_reserve(struct uvm_vmem_reserve_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_create(struct uvm_vmem_create_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_map(struct uvm_vmem_map_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_unmap(struct uvm_vmem_unmap_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_release(struct uvm_vmem_release_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_free(struct uvm_vmem_free_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_map_batch(struct uvm_vmem_batch_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_unmap_batch(struct uvm_vmem_batch_params *params, struct file *filp);
NV_STATUS uvm_api_vmem_self_test(struct uvm_vmem_self_test_params *params, struct file *filp);

/*
 * NV_ERR_UVM_ADDRESS_IN_USE when [start, end] (inclusive) overlaps a vMem range of the VA
 * space. UVM calls it before it creates a VA range (VA space lock held for writing): our
 * ranges are not in its range tree.
 */
NV_STATUS uvm_vmem_check_range_free(uvm_va_space_t *va_space, NvU64 start, NvU64 end);

/* Releases vMem mappings, pages and ranges on `gpu` (its GPU VA space is going away). */
void uvm_vmem_remove_gpu_va_space(uvm_va_space_t *va_space, uvm_gpu_t *gpu);

/* Releases everything vMem holds for the VA space (file closed / process exit). */
void uvm_vmem_va_space_destroy(uvm_va_space_t *va_space);

#endif /* _UVM_VMEM_H */
