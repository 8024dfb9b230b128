// SPDX-License-Identifier: MIT
/*
 * uvm_vmem.c - vMem: small-page virtual memory management for nvidia-uvm.
 *
 * Copyright (c) 2026 the vmem authors.
 *
 * Lets user space reserve GPU virtual address ranges, allocate physical pages
 * of 64K, 128K, 256K or 2M from UVM's own physical memory manager (PMM), and
 * map them page by page into the process's GPU VA space through UVM's page
 * tree code. The ioctls are described in uvm_vmem_ioctl.h.
 *
 * A reserved range is backed by a PROT_NONE reservation of the same CPU
 * virtual addresses, which keeps it unique in the unified address space that
 * CUDA allocations share. Pages of 64K-256K are made of 64K PMM chunks mapped
 * with 64K PTEs; 2M pages are one 2M chunk mapped with one 2M PTE.
 *
 * State lives per UVM VA space (per open file of /dev/nvidia-uvm). Pages and
 * mappings on a GPU are released when its GPU VA space goes away, and
 * everything when the VA space is destroyed (file closed, process exit).
 */

#include <linux/idr.h>
#include <linux/list.h>
#include <linux/mman.h>
#include <linux/mm.h>
#include <linux/mutex.h>
#include <linux/rbtree.h>
#include <linux/sched.h>

#include "uvm_api.h"
#include "uvm_gpu.h"
#include "uvm_hal.h"
#include "uvm_kvmalloc.h"
#include "uvm_mmu.h"
#include "uvm_pmm_gpu.h"
#include "uvm_push.h"
#include "uvm_va_space.h"
#include "uvm_vmem.h"
#include "uvm_vmem_ioctl.h"

/* Most pages one file may hold, as a bound on what a bad caller can pin. */
#define VMEM_MAX_HANDLE 0x7fffffff

struct vmem_range {
	struct list_head link;
	NvU64 base;
	NvU64 length;
	uvm_gpu_t *gpu;
	struct mm_struct *mm;		/* where the CPU reservation lives */
	unsigned long cpu_start;	/* the CPU reservation (>= base) */
	unsigned long cpu_length;
	NvU64 mapped_pages;
};

struct vmem_page {
	struct rb_node node;		/* in vmem_state.mapped, by address */
	NvU64 handle;
	uvm_gpu_t *gpu;
	NvU64 page_size;
	NvU32 chunk_count;
	uvm_gpu_chunk_t **chunks;
	struct vmem_range *range;	/* NULL when not mapped */
	NvU64 address;
	uvm_page_table_range_vec_t *ptes;
};

struct vmem_state {
	struct list_head link;		/* in vmem_states */
	uvm_va_space_t *va_space;
	struct mutex lock;		/* protects everything below */
	struct list_head ranges;
	struct idr pages;		/* handle -> vmem_page */
	struct rb_root mapped;
	NvU64 bytes;			/* physical bytes held */
};

static LIST_HEAD(vmem_states);
static DEFINE_MUTEX(vmem_states_lock);

static struct vmem_state *vmem_state_find(uvm_va_space_t *va_space, bool create)
{
	struct vmem_state *state;

	mutex_lock(&vmem_states_lock);
	list_for_each_entry(state, &vmem_states, link) {
		if (state->va_space == va_space)
			goto out;
	}
	state = NULL;
	if (create) {
		state = uvm_kvmalloc_zero(sizeof(*state));
		if (state) {
			state->va_space = va_space;
			mutex_init(&state->lock);
			INIT_LIST_HEAD(&state->ranges);
			idr_init(&state->pages);
			state->mapped = RB_ROOT;
			list_add(&state->link, &vmem_states);
		}
	}
out:
	mutex_unlock(&vmem_states_lock);
	return state;
}

static bool vmem_page_size_valid(NvU64 page_size)
{
	return (page_size & UVM_VMEM_PAGE_SIZES) && is_power_of_2(page_size);
}

static NvU64 vmem_mmu_page_size(NvU64 page_size)
{
	return page_size == UVM_VMEM_PAGE_2M ? UVM_PAGE_SIZE_2M : UVM_PAGE_SIZE_64K;
}

static struct vmem_range *vmem_range_containing(struct vmem_state *state, NvU64 address, NvU64 size)
{
	struct vmem_range *range;

	list_for_each_entry(range, &state->ranges, link) {
		if (address >= range->base && size <= range->length &&
		    address - range->base <= range->length - size)
			return range;
	}
	return NULL;
}

/* The mapped page overlapping [address, address + size), if any. */
static struct vmem_page *vmem_mapped_overlap(struct vmem_state *state, NvU64 address, NvU64 size)
{
	struct rb_node *node = state->mapped.rb_node;

	while (node) {
		struct vmem_page *page = rb_entry(node, struct vmem_page, node);

		if (address + size <= page->address)
			node = node->rb_left;
		else if (address >= page->address + page->page_size)
			node = node->rb_right;
		else
			return page;
	}
	return NULL;
}

static void vmem_mapped_insert(struct vmem_state *state, struct vmem_page *page)
{
	struct rb_node **link = &state->mapped.rb_node, *parent = NULL;

	while (*link) {
		struct vmem_page *other = rb_entry(*link, struct vmem_page, node);

		parent = *link;
		link = page->address < other->address ? &(*link)->rb_left : &(*link)->rb_right;
	}
	rb_link_node(&page->node, parent, link);
	rb_insert_color(&page->node, &state->mapped);
}

static NvU64 vmem_pte_maker(uvm_page_table_range_vec_t *range_vec, NvU64 offset, void *data)
{
	struct vmem_page *page = data;
	uvm_page_tree_t *tree = range_vec->tree;
	NvU64 chunk_size = page->page_size / page->chunk_count;
	uvm_gpu_chunk_t *chunk = page->chunks[offset / chunk_size];

	return tree->hal->make_pte(UVM_APERTURE_VID,
				   chunk->address + offset % chunk_size,
				   UVM_PROT_READ_WRITE_ATOMIC,
				   UVM_MMU_PTE_FLAGS_CACHED);
}

/*
 * Clears a page's PTEs and puts its page tables. On failure the mapping stays as it was,
 * unless `force` (teardown, where there is no caller to report to): then the error is logged
 * and the page tables are put anyway, as UVM's own uvm_mem teardown does.
 */
static NV_STATUS vmem_page_unmap(struct vmem_state *state, struct vmem_page *page, bool force)
{
	NV_STATUS status;

	if (!page->range)
		return NV_OK;
	status = uvm_page_table_range_vec_clear_ptes(page->ptes, UVM_MEMBAR_GPU);
	if (status != NV_OK && !force)
		return status;
	if (status != NV_OK)
		UVM_ERR_PRINT("vmem: clearing PTEs failed: %s, GPU %s\n",
			      nvstatusToString(status), uvm_gpu_name(page->gpu));
	uvm_page_table_range_vec_destroy(page->ptes);
	page->ptes = NULL;
	page->range->mapped_pages--;
	page->range = NULL;
	rb_erase(&page->node, &state->mapped);
	return NV_OK;
}

/* Returns the page's chunks to PMM (those allocated: the array is zeroed) and frees it. */
static void vmem_page_destroy(struct vmem_page *page)
{
	NvU32 i;

	for (i = 0; i < page->chunk_count; i++) {
		if (page->chunks[i])
			uvm_pmm_gpu_free(&page->gpu->pmm, page->chunks[i], NULL);
	}
	uvm_kvfree(page->chunks);
	uvm_kvfree(page);
}

static void vmem_page_free(struct vmem_state *state, struct vmem_page *page)
{
	state->bytes -= page->page_size;
	idr_remove(&state->pages, (int)page->handle);
	vmem_page_destroy(page);
}

/* Zeroes chunks PMM did not hand out zeroed: no data leaks between processes. */
static NV_STATUS vmem_page_zero(struct vmem_page *page)
{
	uvm_gpu_t *gpu = page->gpu;
	uvm_push_t push;
	NV_STATUS status;
	NvU32 i;

	status = uvm_push_begin(gpu->channel_manager, UVM_CHANNEL_TYPE_GPU_INTERNAL, &push,
				"vmem: zero a %llu-byte page", page->page_size);
	if (status != NV_OK)
		return status;
	for (i = 0; i < page->chunk_count; i++) {
		uvm_gpu_chunk_t *chunk = page->chunks[i];
		uvm_gpu_phys_address_t phys;

		if (chunk->is_zero)
			continue;
		phys = uvm_gpu_phys_address(UVM_APERTURE_VID, chunk->address);
		uvm_push_set_flag(&push, UVM_PUSH_FLAG_CE_NEXT_PIPELINED);
		uvm_push_set_flag(&push, UVM_PUSH_FLAG_NEXT_MEMBAR_NONE);
		gpu->parent->ce_hal->memset_8(&push, uvm_gpu_address_copy(gpu, phys), 0,
					      uvm_gpu_chunk_get_size(chunk));
	}
	/* The push ends with a membar, so the zeroes land before any PTE points here. */
	return uvm_push_end_and_wait(&push);
}

/*
 * Forgets a range. With unmap_cpu, also drops its CPU reservation; teardown
 * paths pass false: they run under the VA space lock, which UVM orders after
 * mmap_lock, so they leave the PROT_NONE reservation to the process's exit.
 */
static void vmem_range_free(struct vmem_range *range, bool unmap_cpu)
{
	if (unmap_cpu && current->mm == range->mm)
		vm_munmap(range->cpu_start, range->cpu_length);
	list_del(&range->link);
	uvm_kvfree(range);
}

/*
 * Releases what `gpu` holds (every GPU when NULL): mappings, pages, ranges.
 * Caller holds state->lock.
 */
static void vmem_release_gpu(struct vmem_state *state, uvm_gpu_t *gpu)
{
	struct vmem_range *range, *next_range;
	struct vmem_page *page;
	int id;

	idr_for_each_entry(&state->pages, page, id) {
		if (gpu && page->gpu != gpu)
			continue;
		vmem_page_unmap(state, page, true);
		vmem_page_free(state, page);
	}
	list_for_each_entry_safe(range, next_range, &state->ranges, link) {
		if (!gpu || range->gpu == gpu)
			vmem_range_free(range, false);
	}
}

void uvm_vmem_remove_gpu_va_space(uvm_va_space_t *va_space, uvm_gpu_t *gpu)
{
	struct vmem_state *state = vmem_state_find(va_space, false);

	if (!state)
		return;
	mutex_lock(&state->lock);
	vmem_release_gpu(state, gpu);
	mutex_unlock(&state->lock);
}

void uvm_vmem_va_space_destroy(uvm_va_space_t *va_space)
{
	struct vmem_state *state = vmem_state_find(va_space, false);

	if (!state)
		return;
	mutex_lock(&vmem_states_lock);
	list_del(&state->link);
	mutex_unlock(&vmem_states_lock);

	mutex_lock(&state->lock);
	vmem_release_gpu(state, NULL);
	mutex_unlock(&state->lock);
	idr_destroy(&state->pages);
	uvm_kvfree(state);
}

/* Looks up a GPU of the VA space that has a GPU VA space. Caller holds the VA space lock. */
static uvm_gpu_t *vmem_gpu(uvm_va_space_t *va_space, const NvProcessorUuid *uuid)
{
	uvm_gpu_t *gpu = uvm_va_space_get_gpu_by_uuid(va_space, uuid);

	if (!gpu || !uvm_gpu_va_space_get(va_space, gpu))
		return NULL;
	return gpu;
}

NV_STATUS uvm_api_vmem_query(UVM_VMEM_QUERY_PARAMS *params, struct file *filp)
{
	params->pageSizes = UVM_VMEM_PAGE_SIZES;
	params->rangeAlign = UVM_VMEM_RANGE_ALIGN;
	params->version = UVM_VMEM_VERSION;
	return NV_OK;
}

NV_STATUS uvm_api_vmem_reserve(UVM_VMEM_RESERVE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	struct vmem_range *range;
	unsigned long cpu, span;
	NV_STATUS status = NV_OK;

	if (params->flags || !params->length || params->length % UVM_VMEM_RANGE_ALIGN ||
	    params->length > ULONG_MAX - UVM_VMEM_RANGE_ALIGN)
		return NV_ERR_INVALID_ARGUMENT;
	if (!current->mm)
		return NV_ERR_NOT_SUPPORTED;
	range = uvm_kvmalloc_zero(sizeof(*range));
	if (!range)
		return NV_ERR_NO_MEMORY;

	/*
	 * Reserve CPU VA aligned to rangeAlign (over-reserve, keep it all) before taking the
	 * VA space lock: UVM orders mmap_lock before it.
	 */
	span = params->length + UVM_VMEM_RANGE_ALIGN;
	cpu = vm_mmap(NULL, 0, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, 0);
	if (IS_ERR_VALUE(cpu)) {
		uvm_kvfree(range);
		return NV_ERR_NO_MEMORY;
	}
	range->cpu_start = cpu;
	range->cpu_length = span;
	range->mm = current->mm;
	range->base = UVM_ALIGN_UP((NvU64)cpu, UVM_VMEM_RANGE_ALIGN);
	range->length = params->length;

	/* Held until the range is listed, so the GPU VA space cannot go away meanwhile. */
	uvm_va_space_down_read(va_space);
	range->gpu = vmem_gpu(va_space, &params->gpuUuid);
	state = range->gpu ? vmem_state_find(va_space, true) : NULL;
	if (!range->gpu) {
		status = NV_ERR_INVALID_DEVICE;
	} else if (!state) {
		status = NV_ERR_NO_MEMORY;
	} else {
		mutex_lock(&state->lock);
		list_add(&range->link, &state->ranges);
		mutex_unlock(&state->lock);
		params->base = range->base;
	}
	uvm_va_space_up_read(va_space);
	if (status != NV_OK) {
		vm_munmap(range->cpu_start, range->cpu_length);
		uvm_kvfree(range);
	}
	return status;
}

NV_STATUS uvm_api_vmem_create(UVM_VMEM_CREATE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	struct vmem_page *page;
	uvm_chunk_size_t chunk_size;
	uvm_gpu_t *gpu;
	NV_STATUS status;
	int id;

	if (params->flags || !vmem_page_size_valid(params->pageSize))
		return NV_ERR_INVALID_ARGUMENT;
	page = uvm_kvmalloc_zero(sizeof(*page));
	if (!page)
		return NV_ERR_NO_MEMORY;
	chunk_size = params->pageSize == UVM_VMEM_PAGE_2M ? UVM_CHUNK_SIZE_2M : UVM_CHUNK_SIZE_64K;
	page->chunk_count = params->pageSize / chunk_size;
	page->page_size = params->pageSize;
	page->chunks = uvm_kvmalloc_zero(page->chunk_count * sizeof(*page->chunks));
	if (!page->chunks) {
		uvm_kvfree(page);
		return NV_ERR_NO_MEMORY;
	}

	/* Held until the page is listed, so the GPU VA space cannot go away meanwhile. */
	uvm_va_space_down_read(va_space);
	gpu = vmem_gpu(va_space, &params->gpuUuid);
	state = gpu ? vmem_state_find(va_space, true) : NULL;
	if (!gpu || !state) {
		status = gpu ? NV_ERR_NO_MEMORY : NV_ERR_INVALID_DEVICE;
		goto error;
	}
	page->gpu = gpu;

	/* PMM returns the chunks pinned: never evicted until we free them. */
	status = uvm_pmm_gpu_alloc_user(&gpu->pmm, page->chunk_count, chunk_size,
					UVM_PMM_ALLOC_FLAGS_EVICT, page->chunks, NULL);
	if (status == NV_OK)
		status = vmem_page_zero(page);
	if (status != NV_OK)
		goto error;

	mutex_lock(&state->lock);
	id = idr_alloc(&state->pages, page, 1, VMEM_MAX_HANDLE, GFP_KERNEL);
	if (id >= 0) {
		page->handle = id;
		state->bytes += page->page_size;
	}
	mutex_unlock(&state->lock);
	if (id < 0) {
		status = NV_ERR_NO_MEMORY;
		goto error;
	}
	uvm_va_space_up_read(va_space);
	params->handle = page->handle;
	return NV_OK;

error:
	uvm_va_space_up_read(va_space);
	vmem_page_destroy(page);
	return status;
}

static struct vmem_page *vmem_page_get(struct vmem_state *state, NvU64 handle)
{
	if (!handle || handle > VMEM_MAX_HANDLE)
		return NULL;
	return idr_find(&state->pages, (int)handle);
}

NV_STATUS uvm_api_vmem_map(UVM_VMEM_MAP_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state = vmem_state_find(va_space, false);
	uvm_gpu_va_space_t *gpu_va_space;
	struct vmem_range *range;
	struct vmem_page *page;
	NV_STATUS status;

	if (params->flags)
		return NV_ERR_INVALID_ARGUMENT;
	if (!state)
		return NV_ERR_OBJECT_NOT_FOUND;

	uvm_va_space_down_read(va_space);
	mutex_lock(&state->lock);
	page = vmem_page_get(state, params->handle);
	if (!page) {
		status = NV_ERR_OBJECT_NOT_FOUND;
		goto out;
	}
	if (page->range) {
		status = NV_ERR_IN_USE;
		goto out;
	}
	if (params->base % page->page_size) {
		status = NV_ERR_INVALID_ARGUMENT;
		goto out;
	}
	range = vmem_range_containing(state, params->base, page->page_size);
	if (!range || range->gpu != page->gpu ||
	    vmem_mapped_overlap(state, params->base, page->page_size)) {
		status = NV_ERR_INVALID_ADDRESS;
		goto out;
	}
	gpu_va_space = uvm_gpu_va_space_get(va_space, page->gpu);
	if (!gpu_va_space) {
		status = NV_ERR_INVALID_DEVICE;
		goto out;
	}
	status = uvm_page_table_range_vec_create(&gpu_va_space->page_tables, params->base,
						 page->page_size,
						 vmem_mmu_page_size(page->page_size),
						 UVM_PMM_ALLOC_FLAGS_EVICT, &page->ptes);
	if (status != NV_OK)
		goto out;
	status = uvm_page_table_range_vec_write_ptes(page->ptes, UVM_MEMBAR_NONE,
						     vmem_pte_maker, page);
	if (status != NV_OK) {
		uvm_page_table_range_vec_destroy(page->ptes);
		page->ptes = NULL;
		goto out;
	}
	page->address = params->base;
	page->range = range;
	range->mapped_pages++;
	vmem_mapped_insert(state, page);
out:
	mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	return status;
}

NV_STATUS uvm_api_vmem_unmap(UVM_VMEM_UNMAP_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state = vmem_state_find(va_space, false);
	struct vmem_page *page;
	NvU64 at, end;
	NV_STATUS status = NV_OK;

	if (params->flags || !params->length || params->base > ~0ULL - params->length)
		return NV_ERR_INVALID_ARGUMENT;
	if (!state)
		return NV_ERR_INVALID_ADDRESS;
	end = params->base + params->length;

	uvm_va_space_down_read(va_space);
	mutex_lock(&state->lock);
	/* Validate the whole run first: on error nothing is unmapped. */
	for (at = params->base; at < end; at += page->page_size) {
		page = vmem_mapped_overlap(state, at, 1);
		if (!page || page->address != at || end - at < page->page_size) {
			status = NV_ERR_INVALID_ADDRESS;
			goto out;
		}
	}
	for (at = params->base; at < end && status == NV_OK; ) {
		page = vmem_mapped_overlap(state, at, 1);
		at += page->page_size;
		status = vmem_page_unmap(state, page, false);
	}
out:
	mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	return status;
}

NV_STATUS uvm_api_vmem_release(UVM_VMEM_RELEASE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state = vmem_state_find(va_space, false);
	struct vmem_page *page;
	NV_STATUS status = NV_OK;

	if (params->flags & ~UVM_VMEM_RELEASE_UNMAP)
		return NV_ERR_INVALID_ARGUMENT;
	if (!state)
		return NV_ERR_OBJECT_NOT_FOUND;

	uvm_va_space_down_read(va_space);
	mutex_lock(&state->lock);
	page = vmem_page_get(state, params->handle);
	if (!page) {
		status = NV_ERR_OBJECT_NOT_FOUND;
	} else if (page->range && !(params->flags & UVM_VMEM_RELEASE_UNMAP)) {
		status = NV_ERR_IN_USE;
	} else {
		status = vmem_page_unmap(state, page, false);
		if (status == NV_OK)
			vmem_page_free(state, page);
	}
	mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	return status;
}

NV_STATUS uvm_api_vmem_free(UVM_VMEM_FREE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state = vmem_state_find(va_space, false);
	struct vmem_range *range;
	NV_STATUS status = NV_ERR_INVALID_ADDRESS;

	if (params->flags)
		return NV_ERR_INVALID_ARGUMENT;
	if (!state)
		return NV_ERR_INVALID_ADDRESS;

	mutex_lock(&state->lock);
	list_for_each_entry(range, &state->ranges, link) {
		if (range->base != params->base)
			continue;
		if (range->mapped_pages) {
			status = NV_ERR_IN_USE;
		} else {
			vmem_range_free(range, true);
			status = NV_OK;
		}
		break;
	}
	mutex_unlock(&state->lock);
	return status;
}
