// SPDX-License-Identifier: MIT
/*
 * uvm_vmem.c - vMem: small-page virtual memory management for nvidia-uvm.
 *
 * Copyright (c) 2026 the vmem authors.
 *
 * Lets user space reserve GPU virtual address ranges, allocate physical pages
 * of 64K, 128K, 256K or 2M from UVM's own physical memory manager (PMM), and
 * map them page by page into the process's GPU VA space through UVM's page
 * tree code. The ioctls are described in uvm_vmem_ioctl.h; their argument
 * checks are the pure functions of uvm_vmem_check.h.
 *
 * A reserved range is backed by a PROT_NONE reservation of the same CPU
 * virtual addresses, which keeps it unique among the process's mappings, and
 * UVM's own range creation asks uvm_vmem_check_range_free() first, so no UVM
 * range (external, channel, semaphore pool, ...) can be created over it.
 * Pages of 64K-256K are made of 64K PMM chunks mapped with 64K PTEs; 2M pages
 * are one 2M chunk mapped with one 2M PTE.
 *
 * State lives per UVM VA space (per open file of /dev/nvidia-uvm) and belongs
 * to the process whose mm the VA space serves. Pages and mappings on a GPU are
 * released when its GPU VA space goes away, and everything when the VA space
 * is destroyed (file closed, process exit).
 *
 * Lock order, outermost first; a lock is only taken while holding locks above it:
 *
 *   mmap_lock          vm_mmap()/vm_munmap() take it: they run with none of the
 *                      locks below held (UVM takes mmap_lock before its VA space
 *                      lock on teardown, so holding either here would be ABBA)
 *   va_space->lock     UVM's; read in the ioctls, write on UVM's teardown and
 *                      range creation paths, which call our hooks
 *   state->lock        uvm_mutex_t at UVM_LOCK_ORDER_EXT_RANGE_TREE's level: after
 *                      the VA space lock, before the page tree, push, PMM and
 *                      channel locks that the page-table and PMM calls take; we
 *                      never hold an external range tree lock, nor does UVM call
 *                      us holding one, so sharing that level cannot nest
 *   vmem_states_lock   a leaf spinlock (the list of states): nothing is taken, and
 *                      nothing sleeps, under it; lockdep covers it
 *
 * UVM's debug build (UVM_IS_DEBUG) checks the order of state->lock at run time.
 */

#include <linux/idr.h>
#include <linux/list.h>
#include <linux/mman.h>
#include <linux/mm.h>
#include <linux/rbtree.h>
#include <linux/sched.h>
#include <linux/sched/mm.h>

#include "uvm_api.h"
#include "uvm_gpu.h"
#include "uvm_hal.h"
#include "uvm_kvmalloc.h"
#include "uvm_lock.h"
#include "uvm_mmu.h"
#include "uvm_pmm_gpu.h"
#include "uvm_pte_batch.h"
#include "uvm_push.h"
#include "uvm_tlb_batch.h"
#include "uvm_tracker.h"
#include "uvm_va_range.h"
#include "uvm_va_space.h"
#include "uvm_va_space_mm.h"
#include "uvm_vmem.h"
#include "uvm_vmem_check.h"
#include "uvm_vmem_ioctl.h"

/* Push space kept free when packing PTE writes for many pages into one push. */
#define VMEM_PUSH_MARGIN 1024

struct vmem_range {
	struct list_head link;
	NvU64 base;
	NvU64 length;
	uvm_gpu_t *gpu;
	unsigned long cpu_start;	/* the CPU reservation (<= base), in state->mm */
	unsigned long cpu_length;
	NvU64 mapped_pages;		/* mappings inside it */
};

struct vmem_page {
	NvU64 handle;
	uvm_gpu_t *gpu;
	NvU64 page_size;
	NvU32 chunk_count;
	uvm_gpu_chunk_t **chunks;
	struct list_head mappings;	/* its vmem_mappings (one per address it is mapped at) */
	NvU64 map_count;		/* how many */
};

/* One address a page is mapped at: since version 3 a page can have several. */
struct vmem_mapping {
	struct rb_node node;		/* in vmem_state.mapped, by address */
	struct list_head page_link;	/* in page->mappings */
	struct vmem_page *page;
	struct vmem_range *range;
	NvU64 address;
	uvm_page_table_range_vec_t *ptes; /* NULL until its page tables are made */
	bool picked;			/* named by the unmap batch being validated */
};

struct vmem_state {
	struct list_head link;		/* in vmem_states */
	uvm_va_space_t *va_space;
	struct mm_struct *mm;		/* the process it belongs to (mmgrab'd) */
	uvm_mutex_t lock;		/* protects everything below */
	struct list_head ranges;
	struct idr pages;		/* handle -> vmem_page */
	struct rb_root mapped;
	NvU64 bytes;			/* physical bytes held */
};

static LIST_HEAD(vmem_states);
static DEFINE_SPINLOCK(vmem_states_lock);

static struct vmem_state *vmem_state_lookup(uvm_va_space_t *va_space)
{
	struct vmem_state *state;

	list_for_each_entry(state, &vmem_states, link) {
		if (state->va_space == va_space)
			return state;
	}
	return NULL;
}

/* The VA space's state, or NULL. */
static struct vmem_state *vmem_state_find(uvm_va_space_t *va_space)
{
	struct vmem_state *state;

	spin_lock(&vmem_states_lock);
	state = vmem_state_lookup(va_space);
	spin_unlock(&vmem_states_lock);
	return state;
}

/*
 * The VA space's state for the calling process, made on its first vMem call, which binds
 * the VA space to the caller's mm. Only that process may use it: a forked child, or a
 * process the fd was passed to, would otherwise reserve CPU VA in its own mm while the GPU
 * mappings live in the VA space of another. NULL with *status = NV_ERR_NOT_SUPPORTED for
 * another process, NV_ERR_NO_MEMORY when the state cannot be made.
 */
static struct vmem_state *vmem_state_for_caller(uvm_va_space_t *va_space, NV_STATUS *status)
{
	struct vmem_state *state, *fresh;

	*status = NV_ERR_NOT_SUPPORTED;
	if (!current->mm)
		return NULL;
	if (uvm_va_space_mm_enabled(va_space) && va_space->va_space_mm.mm != current->mm)
		return NULL;
	state = vmem_state_find(va_space);
	if (!state) {
		fresh = uvm_kvmalloc_zero(sizeof(*fresh));
		if (!fresh) {
			*status = NV_ERR_NO_MEMORY;
			return NULL;
		}
		fresh->va_space = va_space;
		uvm_mutex_init(&fresh->lock, UVM_LOCK_ORDER_EXT_RANGE_TREE);
		INIT_LIST_HEAD(&fresh->ranges);
		idr_init(&fresh->pages);
		fresh->mapped = RB_ROOT;
		fresh->mm = current->mm;
		spin_lock(&vmem_states_lock);
		state = vmem_state_lookup(va_space);
		if (!state) {
			/* The state keeps a pointer to the mm: hold it (mmdrop in destroy). */
			mmgrab(fresh->mm);
			list_add(&fresh->link, &vmem_states);
			state = fresh;
			fresh = NULL;
		}
		spin_unlock(&vmem_states_lock);
		if (fresh) {
			idr_destroy(&fresh->pages);
			uvm_kvfree(fresh);
		}
	}
	if (state->mm != current->mm)
		return NULL;
	*status = NV_OK;
	return state;
}

static NvU64 vmem_mmu_page_size(NvU64 page_size)
{
	return page_size == UVM_VMEM_PAGE_2M ? UVM_PAGE_SIZE_2M : UVM_PAGE_SIZE_64K;
}

static struct vmem_range *vmem_range_containing(struct vmem_state *state, NvU64 address, NvU64 size)
{
	struct vmem_range *range;

	list_for_each_entry(range, &state->ranges, link) {
		if (uvm_vmem_inside(range->base, range->length, address, size))
			return range;
	}
	return NULL;
}

/* The mapping overlapping [address, address + size), if any. */
static struct vmem_mapping *vmem_mapped_overlap(struct vmem_state *state, NvU64 address,
						NvU64 size)
{
	struct rb_node *node = state->mapped.rb_node;

	while (node) {
		struct vmem_mapping *m = rb_entry(node, struct vmem_mapping, node);

		if (!uvm_vmem_overlaps(address, size, m->address, m->page->page_size))
			node = address < m->address ? node->rb_left : node->rb_right;
		else
			return m;
	}
	return NULL;
}

/*
 * Records `page` as mapped at `address` of `range` (bookkeeping only: no page tables yet).
 * The caller has checked that nothing is mapped there. NULL when out of memory.
 */
static struct vmem_mapping *vmem_mapping_link(struct vmem_state *state, struct vmem_page *page,
					      struct vmem_range *range, NvU64 address)
{
	struct rb_node **link = &state->mapped.rb_node, *parent = NULL;
	struct vmem_mapping *m = uvm_kvmalloc_zero(sizeof(*m));

	if (!m)
		return NULL;
	m->page = page;
	m->range = range;
	m->address = address;
	while (*link) {
		struct vmem_mapping *other = rb_entry(*link, struct vmem_mapping, node);

		parent = *link;
		link = address < other->address ? &(*link)->rb_left : &(*link)->rb_right;
	}
	rb_link_node(&m->node, parent, link);
	rb_insert_color(&m->node, &state->mapped);
	list_add_tail(&m->page_link, &page->mappings);
	page->map_count++;
	range->mapped_pages++;
	return m;
}

/* Forgets a mapping (its page tables, if any, are the caller's to have put) and frees it. */
static void vmem_mapping_unlink(struct vmem_state *state, struct vmem_mapping *m)
{
	rb_erase(&m->node, &state->mapped);
	list_del(&m->page_link);
	m->page->map_count--;
	m->range->mapped_pages--;
	uvm_kvfree(m);
}

static NvU64 vmem_pte_maker(uvm_page_table_range_vec_t *range_vec, NvU64 offset, void *data)
{
	struct vmem_mapping *m = data;
	struct vmem_page *page = m->page;
	uvm_page_tree_t *tree = range_vec->tree;
	NvU64 chunk_size = page->page_size / page->chunk_count;
	uvm_gpu_chunk_t *chunk = page->chunks[offset / chunk_size];

	/*
	 * Access counters off, as UVM does for its own kernel-owned mappings: these pages
	 * never migrate, so a counter notification would only be noise for UVM's
	 * access-counter servicing, which would find no VA range to act on.
	 */
	return tree->hal->make_pte(UVM_APERTURE_VID,
				   chunk->address + offset % chunk_size,
				   UVM_PROT_READ_WRITE_ATOMIC,
				   UVM_MMU_PTE_FLAGS_CACHED |
				   UVM_MMU_PTE_FLAGS_ACCESS_COUNTERS_DISABLED);
}

/* Pushes the PTE writes (or clears) of one mapping into `batch`. */
static void vmem_mapping_push_ptes(uvm_pte_batch_t *batch, struct vmem_mapping *m, bool clear)
{
	uvm_page_table_range_vec_t *vec = m->ptes;
	uvm_page_tree_t *tree = vec->tree;
	NvU32 entry_size = uvm_mmu_pte_size(tree, vec->page_size);
	NvU64 offset = 0;
	size_t i;
	NvU32 entry;

	for (i = 0; i < vec->range_count; i++) {
		uvm_page_table_range_t *range = &vec->ranges[i];
		uvm_gpu_phys_address_t pa = uvm_page_table_range_entry_address(tree, range, 0);

		if (clear) {
			uvm_pte_batch_clear_ptes(batch, pa, 0, entry_size, range->entry_count);
			continue;
		}
		for (entry = 0; entry < range->entry_count; entry++) {
			NvU64 pte = vmem_pte_maker(vec, offset, m);

			uvm_pte_batch_write_pte(batch, pa, pte, entry_size);
			offset += vec->page_size;
			pa.address += entry_size;
		}
	}
}

/*
 * Writes (or clears) the PTEs of `count` mappings of one GPU VA space in as few pushes as
 * fit, with one TLB invalidate, in the last push, for all of them. Only for page trees the
 * GPU writes (vmem_tree_gpu_writes). Returns when the GPU has done it.
 */
static NV_STATUS vmem_ptes_batched(uvm_page_tree_t *tree, struct vmem_mapping **maps,
				   NvU32 count, bool clear)
{
	uvm_tracker_t tracker = UVM_TRACKER_INIT();
	uvm_pte_batch_t pte_batch;
	uvm_tlb_batch_t tlb_batch;
	uvm_push_t push;
	uvm_membar_t membar = clear ? UVM_MEMBAR_GPU : UVM_MEMBAR_NONE;
	NV_STATUS status = NV_OK, tracker_status;
	NvU32 i = 0, j;

	while (i < count) {
		status = uvm_push_begin_acquire(tree->gpu->channel_manager, UVM_CHANNEL_TYPE_MEMOPS,
						&tracker, &push, "vmem: %s %u mappings",
						clear ? "unmap" : "map", count);
		if (status != NV_OK)
			break;
		uvm_pte_batch_begin(&push, &pte_batch);
		while (i < count) {
			vmem_mapping_push_ptes(&pte_batch, maps[i++], clear);
			if (!uvm_push_has_space(&push, VMEM_PUSH_MARGIN))
				break;
		}
		uvm_pte_batch_end(&pte_batch);
		if (i == count) {
			/* Unmap: a GPU membar, so no access through the old PTEs is in flight. */
			uvm_tlb_batch_begin(tree, &tlb_batch);
			for (j = 0; j < count; j++) {
				NvU64 size = maps[j]->page->page_size;

				uvm_tlb_batch_invalidate(&tlb_batch, maps[j]->address, size,
							 vmem_mmu_page_size(size), membar);
			}
			uvm_tlb_batch_end(&tlb_batch, &push, membar);
		} else {
			/* uvm_pte_batch_end's membar orders these before the last invalidate. */
			uvm_push_set_flag(&push, UVM_PUSH_FLAG_NEXT_MEMBAR_NONE);
		}
		uvm_push_end(&push);
		uvm_tracker_overwrite_with_push(&tracker, &push);
	}
	tracker_status = uvm_tracker_wait_deinit(&tracker);
	return status != NV_OK ? status : tracker_status;
}

/*
 * Clears one mapping's PTEs (TLB invalidate with a GPU membar), puts its page tables and
 * forgets it; the page's other mappings stay. On failure the mapping stays in the
 * bookkeeping: its PTEs may still point at the page, and a page that PTEs point at must
 * never be freed. With `force` (teardown, where there is no caller to report to and UVM
 * itself is going away) the error is logged and the page tables are put anyway, as UVM's
 * own uvm_mem teardown does.
 */
static NV_STATUS vmem_mapping_unmap(struct vmem_state *state, struct vmem_mapping *m, bool force)
{
	NV_STATUS status;

	status = uvm_page_table_range_vec_clear_ptes(m->ptes, UVM_MEMBAR_GPU);
	if (status != NV_OK && !force)
		return status;
	if (status != NV_OK)
		UVM_ERR_PRINT("vmem: clearing PTEs failed: %s, GPU %s\n",
			      nvstatusToString(status), uvm_gpu_name(m->page->gpu));
	uvm_page_table_range_vec_destroy(m->ptes);
	vmem_mapping_unlink(state, m);
	return NV_OK;
}

/*
 * The GPU's copy engine writes this tree's page tables: the negation of uvm_mmu.c's
 * (static) uvm_mmu_use_cpu(), which holds only while a GPU's flat mapping is bootstrapped.
 */
static bool vmem_tree_gpu_writes(uvm_page_tree_t *tree)
{
	return tree->gpu->channel_manager &&
	       (tree->location == UVM_APERTURE_SYS ||
		tree->gpu->parent->ce_phys_vidmem_write_supported ||
		tree->gpu->static_flat_mapping.ready);
}

/* The mappings all have their PTEs in one page tree the GPU writes: batching is possible. */
static uvm_page_tree_t *vmem_common_tree(struct vmem_mapping **maps, NvU32 count)
{
	uvm_page_tree_t *tree = maps[0]->ptes->tree;
	NvU32 i;

	if (!vmem_tree_gpu_writes(tree))
		return NULL;
	for (i = 1; i < count; i++) {
		if (maps[i]->ptes->tree != tree)
			return NULL;
	}
	return tree;
}

/*
 * Unmaps `count` mappings, in order (they are freed: the caller must not touch them after).
 * Caller holds the VA space lock and state->lock. First one batched clear with one TLB
 * invalidate; if that fails, mapping by mapping, stopping at the first failure. *done =
 * mappings unmapped (a prefix of `maps`); the others stay in the bookkeeping, which is then
 * still true of them or errs on the safe side (cleared PTEs recorded as mapped: unmapping
 * again is harmless; the reverse would not be).
 */
static NV_STATUS vmem_maps_unmap(struct vmem_state *state, struct vmem_mapping **maps,
				 NvU32 count, NvU32 *done)
{
	uvm_page_tree_t *tree = vmem_common_tree(maps, count);
	NV_STATUS status = NV_OK;
	NvU32 i;

	*done = 0;
	if (tree && count > 1 && vmem_ptes_batched(tree, maps, count, true) == NV_OK) {
		for (i = 0; i < count; i++) {
			uvm_page_table_range_vec_destroy(maps[i]->ptes);
			vmem_mapping_unlink(state, maps[i]);
		}
		*done = count;
		return NV_OK;
	}
	for (i = 0; i < count && status == NV_OK; i++) {
		status = vmem_mapping_unmap(state, maps[i], false);
		if (status == NV_OK)
			(*done)++;
	}
	return status;
}

/*
 * Validates and links `count` (address, page) pairs: each page known, the address aligned
 * to its size, inside one reserved range of the page's GPU, with nothing mapped there (nor
 * by an earlier entry). A page may already be mapped elsewhere, and may be named by several
 * entries at different addresses: each gets its own mapping. On any error nothing stays
 * linked. Caller holds the VA space lock and state->lock.
 */
static NV_STATUS vmem_entries_link(struct vmem_state *state, const UVM_VMEM_BATCH_ENTRY *entries,
				   NvU32 count, struct vmem_mapping **maps)
{
	NV_STATUS status = NV_OK;
	struct vmem_range *range;
	struct vmem_page *page;
	NvU32 i;

	for (i = 0; i < count; i++) {
		page = uvm_vmem_handle_ok(entries[i].handle) ?
		       idr_find(&state->pages, (int)entries[i].handle) : NULL;
		if (!page) {
			status = NV_ERR_OBJECT_NOT_FOUND;
			break;
		}
		if (!uvm_vmem_page_at_ok(entries[i].base, page->page_size)) {
			status = NV_ERR_INVALID_ARGUMENT;
			break;
		}
		range = vmem_range_containing(state, entries[i].base, page->page_size);
		if (!range || range->gpu != page->gpu ||
		    vmem_mapped_overlap(state, entries[i].base, page->page_size)) {
			status = NV_ERR_INVALID_ADDRESS;
			break;
		}
		maps[i] = vmem_mapping_link(state, page, range, entries[i].base);
		if (!maps[i]) {
			status = NV_ERR_NO_MEMORY;
			break;
		}
	}
	if (status != NV_OK) {
		while (i--)
			vmem_mapping_unlink(state, maps[i]);
	}
	return status;
}

/*
 * Maps `count` (address, page) pairs, all or nothing: validate and link every entry, get
 * page tables for each, then write every PTE with one TLB invalidate at the end. Caller
 * holds the VA space lock (read) and state->lock. *done = entries mapped: count on success,
 * 0 on failure, unless clearing the PTEs of a failed write failed too (a GPU error; then
 * the first *done entries stay mapped, see vmem_maps_unmap).
 */
static NV_STATUS vmem_entries_map(uvm_va_space_t *va_space, struct vmem_state *state,
				  const UVM_VMEM_BATCH_ENTRY *entries, NvU32 count,
				  struct vmem_mapping **maps, NvU32 *done)
{
	uvm_gpu_va_space_t *gpu_va_space;
	uvm_page_tree_t *tree;
	NV_STATUS status;
	NvU32 i, made;

	*done = 0;
	status = vmem_entries_link(state, entries, count, maps);
	if (status != NV_OK)
		return status;

	for (made = 0; made < count; made++) {
		struct vmem_mapping *m = maps[made];

		gpu_va_space = uvm_gpu_va_space_get(va_space, m->page->gpu);
		if (!gpu_va_space) {
			status = NV_ERR_INVALID_DEVICE;
			break;
		}
		status = uvm_page_table_range_vec_create(&gpu_va_space->page_tables,
							 m->address, m->page->page_size,
							 vmem_mmu_page_size(m->page->page_size),
							 UVM_PMM_ALLOC_FLAGS_EVICT, &m->ptes);
		if (status != NV_OK)
			break;
	}
	if (status != NV_OK) {
		for (i = 0; i < count; i++) {
			if (i < made)
				uvm_page_table_range_vec_destroy(maps[i]->ptes);
			vmem_mapping_unlink(state, maps[i]);
		}
		return status;
	}

	tree = vmem_common_tree(maps, count);
	if (tree) {
		status = vmem_ptes_batched(tree, maps, count, false);
	} else {
		for (i = 0; i < count && status == NV_OK; i++)
			status = uvm_page_table_range_vec_write_ptes(maps[i]->ptes,
								     UVM_MEMBAR_NONE,
								     vmem_pte_maker, maps[i]);
	}
	if (status == NV_OK) {
		*done = count;
		return NV_OK;
	}

	/*
	 * Some PTEs may be written: clear them (and TLB-invalidate) before the page tables
	 * go back, last entry first. If a clear fails (a GPU error), stop: entries [0, *done)
	 * stay recorded as mapped, PTEs and all, and the caller learns which.
	 */
	for (i = count; i > 0; i--) {
		if (vmem_mapping_unmap(state, maps[i - 1], false) != NV_OK) {
			*done = i;
			break;
		}
	}
	return status;
}

/*
 * Returns the page's chunks to PMM (those allocated: the array is zeroed) and frees it.
 * The page has no mapping.
 */
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
 * Releases what `gpu` holds (every GPU when NULL): mappings, pages, ranges. The ranges'
 * CPU reservations stay: this runs under the VA space lock (and, on GPU VA space removal,
 * mmap_lock), where vm_munmap would invert the lock order; the process's exit or its own
 * munmap drops them. Caller holds state->lock.
 */
static void vmem_release_gpu(struct vmem_state *state, uvm_gpu_t *gpu)
{
	struct vmem_range *range, *next_range;
	struct vmem_mapping *m, *next_m;
	struct vmem_page *page;
	int id;

	idr_for_each_entry(&state->pages, page, id) {
		if (gpu && page->gpu != gpu)
			continue;
		list_for_each_entry_safe(m, next_m, &page->mappings, page_link)
			vmem_mapping_unmap(state, m, true);
		vmem_page_free(state, page);
	}
	list_for_each_entry_safe(range, next_range, &state->ranges, link) {
		if (!gpu || range->gpu == gpu) {
			list_del(&range->link);
			uvm_kvfree(range);
		}
	}
}

NV_STATUS uvm_vmem_check_range_free(uvm_va_space_t *va_space, NvU64 start, NvU64 end)
{
	struct vmem_state *state = vmem_state_find(va_space);
	struct vmem_range *range;
	NV_STATUS status = NV_OK;

	if (!state || end < start)
		return NV_OK;
	uvm_mutex_lock(&state->lock);
	list_for_each_entry(range, &state->ranges, link) {
		/* [start, end] is inclusive, as UVM's range nodes are. */
		if (range->base <= end && start <= range->base + (range->length - 1)) {
			status = NV_ERR_UVM_ADDRESS_IN_USE;
			break;
		}
	}
	uvm_mutex_unlock(&state->lock);
	return status;
}

void uvm_vmem_remove_gpu_va_space(uvm_va_space_t *va_space, uvm_gpu_t *gpu)
{
	struct vmem_state *state = vmem_state_find(va_space);

	if (!state)
		return;
	uvm_mutex_lock(&state->lock);
	vmem_release_gpu(state, gpu);
	uvm_mutex_unlock(&state->lock);
}

void uvm_vmem_va_space_destroy(uvm_va_space_t *va_space)
{
	struct vmem_state *state = vmem_state_find(va_space);

	if (!state)
		return;
	spin_lock(&vmem_states_lock);
	list_del(&state->link);
	spin_unlock(&vmem_states_lock);

	uvm_mutex_lock(&state->lock);
	vmem_release_gpu(state, NULL);
	uvm_mutex_unlock(&state->lock);
	idr_destroy(&state->pages);
	mmdrop(state->mm);
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

	if (!uvm_vmem_reserve_ok(params->length, params->flags, ULONG_MAX))
		return NV_ERR_INVALID_ARGUMENT;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;
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
	range->base = UVM_ALIGN_UP((NvU64)cpu, UVM_VMEM_RANGE_ALIGN);
	range->length = params->length;

	/*
	 * Held until the range is listed: the GPU VA space cannot go away meanwhile, and UVM's
	 * range creation (VA space lock in write mode) sees either the UVM range that makes us
	 * refuse, or our listed range, which makes uvm_vmem_check_range_free refuse it.
	 */
	uvm_va_space_down_read(va_space);
	range->gpu = vmem_gpu(va_space, &params->gpuUuid);
	if (!range->gpu) {
		status = NV_ERR_INVALID_DEVICE;
	} else if (!uvm_gpu_can_address(range->gpu, range->base, range->length)) {
		/* Beyond the GPU's VA bits, or in a hole of its canonical form. */
		status = NV_ERR_INVALID_ADDRESS;
	} else if (!uvm_va_space_range_empty(va_space, range->base,
					     range->base + range->length - 1)) {
		status = NV_ERR_UVM_ADDRESS_IN_USE;
	}
	if (status == NV_OK) {
		uvm_mutex_lock(&state->lock);
		list_add(&range->link, &state->ranges);
		uvm_mutex_unlock(&state->lock);
		params->base = range->base;
	}
	uvm_va_space_up_read(va_space);
	if (status != NV_OK) {
		/* No vMem or UVM lock is held here: vm_munmap takes mmap_lock. */
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

	if (!uvm_vmem_create_ok(params->pageSize, params->flags))
		return NV_ERR_INVALID_ARGUMENT;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;
	page = uvm_kvmalloc_zero(sizeof(*page));
	if (!page)
		return NV_ERR_NO_MEMORY;
	chunk_size = params->pageSize == UVM_VMEM_PAGE_2M ? UVM_CHUNK_SIZE_2M : UVM_CHUNK_SIZE_64K;
	INIT_LIST_HEAD(&page->mappings);
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
	if (!gpu) {
		status = NV_ERR_INVALID_DEVICE;
		goto error;
	}
	page->gpu = gpu;

	/*
	 * Kernel chunks, not user chunks: PMM never considers them for eviction (user chunks
	 * would have to stay TEMP_PINNED forever, and PMA eviction under memory pressure would
	 * spin on them until its timeout). They count against the GPU's memory like any UVM
	 * kernel allocation until released; UVM_PMM_ALLOC_FLAGS_EVICT lets this allocation
	 * evict other processes' evictable (managed) memory to succeed.
	 */
	status = uvm_pmm_gpu_alloc_kernel(&gpu->pmm, page->chunk_count, chunk_size,
					  UVM_PMM_ALLOC_FLAGS_EVICT, page->chunks, NULL);
	if (status == NV_OK)
		status = vmem_page_zero(page);
	if (status != NV_OK)
		goto error;

	uvm_mutex_lock(&state->lock);
	/*
	 * Cyclic: a released handle is not handed out again until the id space wraps, so a
	 * stale handle fails with NV_ERR_OBJECT_NOT_FOUND instead of naming a new page.
	 */
	id = idr_alloc_cyclic(&state->pages, page, 1, (int)UVM_VMEM_MAX_HANDLE, GFP_KERNEL);
	if (id >= 0) {
		page->handle = id;
		state->bytes += page->page_size;
	}
	uvm_mutex_unlock(&state->lock);
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

/*
 * Shared by MAP and MAP_BATCH: copies nothing, entries are in kernel memory. Takes the
 * locks. *map_count (when not NULL) = the first entry's page's mappings after the call.
 */
static NV_STATUS vmem_map(uvm_va_space_t *va_space, const UVM_VMEM_BATCH_ENTRY *entries,
			  NvU32 count, NvU32 *done, NvU64 *map_count)
{
	struct vmem_state *state;
	struct vmem_mapping **maps;
	NV_STATUS status;

	*done = 0;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;
	maps = uvm_kvmalloc(count * sizeof(*maps));
	if (!maps)
		return NV_ERR_NO_MEMORY;
	uvm_va_space_down_read(va_space);
	uvm_mutex_lock(&state->lock);
	status = vmem_entries_map(va_space, state, entries, count, maps, done);
	if (map_count && *done)
		*map_count = maps[0]->page->map_count;
	uvm_mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	uvm_kvfree(maps);
	return status;
}

NV_STATUS uvm_api_vmem_map(UVM_VMEM_MAP_PARAMS *params, struct file *filp)
{
	UVM_VMEM_BATCH_ENTRY entry = { .base = params->base, .handle = params->handle };
	NvU32 done;

	params->mapCount = 0;
	if (params->flags)
		return NV_ERR_INVALID_ARGUMENT;
	return vmem_map(uvm_va_space_get(filp), &entry, 1, &done, &params->mapCount);
}

/* Copies a batch's entries in; NULL with *status set on failure. */
static UVM_VMEM_BATCH_ENTRY *vmem_batch_copy_in(const UVM_VMEM_BATCH_PARAMS *params,
						NV_STATUS *status)
{
	UVM_VMEM_BATCH_ENTRY *entries;
	size_t bytes;

	if (!uvm_vmem_batch_ok(params->count, params->flags)) {
		*status = NV_ERR_INVALID_ARGUMENT;
		return NULL;
	}
	bytes = (size_t)params->count * sizeof(*entries);
	entries = uvm_kvmalloc(bytes);
	if (!entries) {
		*status = NV_ERR_NO_MEMORY;
		return NULL;
	}
	if (copy_from_user(entries, (const void __user *)(uintptr_t)params->entries, bytes)) {
		uvm_kvfree(entries);
		*status = NV_ERR_INVALID_ADDRESS;
		return NULL;
	}
	return entries;
}

NV_STATUS uvm_api_vmem_map_batch(UVM_VMEM_MAP_BATCH_PARAMS *params, struct file *filp)
{
	UVM_VMEM_BATCH_ENTRY *entries;
	NV_STATUS status;

	params->done = 0;
	entries = vmem_batch_copy_in(params, &status);
	if (!entries)
		return status;
	status = vmem_map(uvm_va_space_get(filp), entries, params->count, &params->done, NULL);
	uvm_kvfree(entries);
	return status;
}

/*
 * Validates an unmap batch: every entry names the mapping at its address, by its page's
 * handle, and no address twice. Caller holds state->lock.
 */
static NV_STATUS vmem_unmap_entries_check(struct vmem_state *state,
					  const UVM_VMEM_BATCH_ENTRY *entries, NvU32 count,
					  struct vmem_mapping **maps)
{
	NV_STATUS status = NV_OK;
	struct vmem_mapping *m;
	NvU32 i, picked = 0;

	for (i = 0; i < count; i++) {
		m = vmem_mapped_overlap(state, entries[i].base, 1);
		if (!m || m->address != entries[i].base) {
			status = NV_ERR_INVALID_ADDRESS;
			break;
		}
		if (m->page->handle != entries[i].handle) {
			status = NV_ERR_OBJECT_NOT_FOUND;
			break;
		}
		if (m->picked) {	/* named twice */
			status = NV_ERR_INVALID_ARGUMENT;
			break;
		}
		m->picked = true;
		maps[picked++] = m;
	}
	for (i = 0; i < picked; i++)
		maps[i]->picked = false;
	return status;
}

NV_STATUS uvm_api_vmem_unmap_batch(UVM_VMEM_UNMAP_BATCH_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	UVM_VMEM_BATCH_ENTRY *entries;
	struct vmem_mapping **maps = NULL;
	NV_STATUS status;

	params->done = 0;
	entries = vmem_batch_copy_in(params, &status);
	if (!entries)
		return status;
	state = vmem_state_for_caller(va_space, &status);
	if (state) {
		maps = uvm_kvmalloc(params->count * sizeof(*maps));
		if (!maps)
			status = NV_ERR_NO_MEMORY;
	}
	if (status != NV_OK)
		goto out_free;

	uvm_va_space_down_read(va_space);
	uvm_mutex_lock(&state->lock);
	/* Validate every entry first: on a bad one nothing is unmapped. */
	status = vmem_unmap_entries_check(state, entries, params->count, maps);
	if (status == NV_OK)
		status = vmem_maps_unmap(state, maps, params->count, &params->done);
	uvm_mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
out_free:
	uvm_kvfree(maps);
	uvm_kvfree(entries);
	return status;
}

NV_STATUS uvm_api_vmem_unmap(UVM_VMEM_UNMAP_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	struct vmem_mapping *maps[64];
	NvU32 sizes[ARRAY_SIZE(maps)];
	struct vmem_mapping *m;
	NvU64 at, end;
	NvU32 n, i, done;
	NV_STATUS status;

	params->unmapped = 0;
	if (!uvm_vmem_unmap_ok(params->base, params->length, params->flags))
		return NV_ERR_INVALID_ARGUMENT;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;
	end = params->base + params->length;

	uvm_va_space_down_read(va_space);
	uvm_mutex_lock(&state->lock);
	/* Validate the whole run first: on error nothing is unmapped. */
	for (at = params->base; at < end; at += m->page->page_size) {
		m = vmem_mapped_overlap(state, at, 1);
		if (!m || m->address != at || end - at < m->page->page_size) {
			status = NV_ERR_INVALID_ADDRESS;
			goto out;
		}
	}
	/*
	 * Then in batches of up to 64 mappings, each with one TLB invalidate. Only these
	 * mappings go: other mappings of the same pages stay.
	 */
	for (at = params->base; at < end && status == NV_OK; ) {
		for (n = 0; n < ARRAY_SIZE(maps) && at < end; n++) {
			maps[n] = vmem_mapped_overlap(state, at, 1);
			sizes[n] = (NvU32)maps[n]->page->page_size;
			at += sizes[n];
		}
		status = vmem_maps_unmap(state, maps, n, &done);	/* frees them */
		for (i = 0; i < done; i++)
			params->unmapped += sizes[i];
	}
out:
	uvm_mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	return status;
}

/*
 * Unmaps every mapping of `page`, up to 64 per TLB invalidate. Caller holds the VA space
 * lock and state->lock. On failure the mappings not yet unmapped stay.
 */
static NV_STATUS vmem_page_unmap_all(struct vmem_state *state, struct vmem_page *page)
{
	struct vmem_mapping *maps[64];
	struct vmem_mapping *m;
	NV_STATUS status = NV_OK;
	NvU32 n, done;

	while (page->map_count && status == NV_OK) {
		n = 0;
		list_for_each_entry(m, &page->mappings, page_link) {
			maps[n++] = m;
			if (n == ARRAY_SIZE(maps))
				break;
		}
		status = vmem_maps_unmap(state, maps, n, &done);
	}
	return status;
}

NV_STATUS uvm_api_vmem_release(UVM_VMEM_RELEASE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	struct vmem_page *page;
	NV_STATUS status;
	int action;

	if (!uvm_vmem_release_ok(params->handle, params->flags))
		return params->flags & ~UVM_VMEM_RELEASE_UNMAP ? NV_ERR_INVALID_ARGUMENT :
								 NV_ERR_OBJECT_NOT_FOUND;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;

	uvm_va_space_down_read(va_space);
	uvm_mutex_lock(&state->lock);
	page = idr_find(&state->pages, (int)params->handle);
	if (!page) {
		status = NV_ERR_OBJECT_NOT_FOUND;
	} else {
		action = uvm_vmem_release_action(page->map_count, params->flags);
		if (action == UVM_VMEM_RELEASE_REFUSE)
			status = NV_ERR_IN_USE;
		else if (action == UVM_VMEM_RELEASE_UNMAP_FIRST)
			status = vmem_page_unmap_all(state, page);
		if (status == NV_OK)
			vmem_page_free(state, page);
	}
	uvm_mutex_unlock(&state->lock);
	uvm_va_space_up_read(va_space);
	return status;
}

NV_STATUS uvm_api_vmem_free(UVM_VMEM_FREE_PARAMS *params, struct file *filp)
{
	uvm_va_space_t *va_space = uvm_va_space_get(filp);
	struct vmem_state *state;
	struct vmem_range *range, *found = NULL;
	NV_STATUS status;

	if (params->flags)
		return NV_ERR_INVALID_ARGUMENT;
	state = vmem_state_for_caller(va_space, &status);
	if (!state)
		return status;

	status = NV_ERR_INVALID_ADDRESS;
	uvm_mutex_lock(&state->lock);
	list_for_each_entry(range, &state->ranges, link) {
		if (range->base != params->base)
			continue;
		if (range->mapped_pages) {
			status = NV_ERR_IN_USE;
		} else {
			list_del(&range->link);
			found = range;
			status = NV_OK;
		}
		break;
	}
	uvm_mutex_unlock(&state->lock);

	/*
	 * Unlinked under the lock, unmapped after dropping it: vm_munmap takes mmap_lock for
	 * writing, and UVM's GPU VA space teardown holds mmap_lock (read) -> VA space lock ->
	 * our hook -> state->lock. Calling it under state->lock would deadlock (ABBA) against
	 * a thread of this process closing a CUDA context. The caller is the range's process
	 * (vmem_state_for_caller), so current->mm is where the reservation lives.
	 */
	if (found) {
		vm_munmap(found->cpu_start, found->cpu_length);
		uvm_kvfree(found);
	}
	return status;
}

/*
 * UVM_VMEM_SELF_TEST: the sharing bookkeeping on objects of its own (a private state, two
 * ranges and two pages with no GPU, no chunks and no page tables), through the functions
 * the ioctls use to validate, link and unlink mappings. Returns 0, or the first step that
 * did not hold.
 */
static NvU32 vmem_self_test_steps(struct vmem_state *state, struct vmem_page *p64,
				  struct vmem_page *p2m)
{
	const NvU64 mb = 1ull << 20;
	struct vmem_mapping *maps[3], *m;
	UVM_VMEM_BATCH_ENTRY e[3];
	NvU64 h = p64->handle;

	/* 1: one 64K page at three addresses, in two ranges, in one batch. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb, h };
	e[1] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb + 0x10000, h };
	e[2] = (UVM_VMEM_BATCH_ENTRY){ 8 * mb, h };
	if (vmem_entries_link(state, e, 3, maps) != NV_OK)
		return 1;
	/* 2: map count and per-range counts. */
	if (p64->map_count != 3 || maps[0]->range->mapped_pages != 2 ||
	    maps[2]->range->mapped_pages != 1)
		return 2;
	/* 3: a second map of the same page at one of its addresses: refused. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb + 0x10000, h };
	if (vmem_entries_link(state, e, 1, maps) != NV_ERR_INVALID_ADDRESS || p64->map_count != 3)
		return 3;
	/* 4: a 2M page over the 64K mappings: refused, nothing linked. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb, p2m->handle };
	if (vmem_entries_link(state, e, 1, maps) != NV_ERR_INVALID_ADDRESS || p2m->map_count)
		return 4;
	/* 5: all or nothing: a good entry, then one overlapping it. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 4 * mb, p2m->handle };
	e[1] = (UVM_VMEM_BATCH_ENTRY){ 4 * mb + 0x10000, h };
	if (vmem_entries_link(state, e, 2, maps) != NV_ERR_INVALID_ADDRESS ||
	    p2m->map_count || p64->map_count != 3 || vmem_mapped_overlap(state, 4 * mb, 2 * mb))
		return 5;
	/* 6: misaligned, outside every range, unknown handle. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 4 * mb + 0x10000, p2m->handle };
	if (vmem_entries_link(state, e, 1, maps) != NV_ERR_INVALID_ARGUMENT)
		return 6;
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 6 * mb, h };
	if (vmem_entries_link(state, e, 1, maps) != NV_ERR_INVALID_ADDRESS)
		return 6;
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 3 * mb, h + 1000 };
	if (vmem_entries_link(state, e, 1, maps) != NV_ERR_OBJECT_NOT_FOUND)
		return 6;
	/* 7: release of a mapped page: refused without the flag, unmap-first with it. */
	if (uvm_vmem_release_action(p64->map_count, 0) != UVM_VMEM_RELEASE_REFUSE ||
	    uvm_vmem_release_action(p64->map_count, UVM_VMEM_RELEASE_UNMAP) !=
	    UVM_VMEM_RELEASE_UNMAP_FIRST)
		return 7;
	/* 8: an unmap batch naming one mapping twice, or by another page: refused. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 8 * mb, h };
	e[1] = (UVM_VMEM_BATCH_ENTRY){ 8 * mb, h };
	if (vmem_unmap_entries_check(state, e, 2, maps) != NV_ERR_INVALID_ARGUMENT)
		return 8;
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 8 * mb, p2m->handle };
	if (vmem_unmap_entries_check(state, e, 1, maps) != NV_ERR_OBJECT_NOT_FOUND)
		return 8;
	/* 9: unmapping one mapping leaves the other two. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb + 0x10000, h };
	if (vmem_unmap_entries_check(state, e, 1, maps) != NV_OK)
		return 9;
	vmem_mapping_unlink(state, maps[0]);
	m = vmem_mapped_overlap(state, 2 * mb, 1);
	if (p64->map_count != 2 || vmem_mapped_overlap(state, 2 * mb + 0x10000, 0x10000) ||
	    !m || m->page != p64 || !vmem_mapped_overlap(state, 8 * mb, 1))
		return 9;
	/* 10: the freed address takes a mapping again, of the same page. */
	e[0] = (UVM_VMEM_BATCH_ENTRY){ 2 * mb + 0x10000, h };
	if (vmem_entries_link(state, e, 1, maps) != NV_OK || p64->map_count != 3)
		return 10;
	/* 11: every mapping gone: counts back to 0, release frees. */
	while (!list_empty(&p64->mappings))
		vmem_mapping_unlink(state, list_first_entry(&p64->mappings, struct vmem_mapping,
							    page_link));
	if (p64->map_count || !RB_EMPTY_ROOT(&state->mapped) ||
	    uvm_vmem_release_action(p64->map_count, 0) != UVM_VMEM_RELEASE_FREE)
		return 11;
	return 0;
}

static struct vmem_page *vmem_self_test_page(struct vmem_state *state, NvU64 page_size)
{
	struct vmem_page *page = uvm_kvmalloc_zero(sizeof(*page));
	int id;

	if (!page)
		return NULL;
	INIT_LIST_HEAD(&page->mappings);
	page->page_size = page_size;
	id = idr_alloc_cyclic(&state->pages, page, 1, (int)UVM_VMEM_MAX_HANDLE, GFP_KERNEL);
	if (id < 0) {
		uvm_kvfree(page);
		return NULL;
	}
	page->handle = id;
	state->bytes += page_size;
	return page;
}

NV_STATUS uvm_api_vmem_self_test(UVM_VMEM_SELF_TEST_PARAMS *params, struct file *filp)
{
	struct vmem_range ranges[2] = {
		{ .base = 2ull << 20, .length = 4ull << 20 },
		{ .base = 8ull << 20, .length = 2ull << 20 },
	};
	struct vmem_page *p64, *p2m;
	struct vmem_mapping *m, *next;
	struct vmem_state *state;
	int id;

	params->failedStep = 0;
	if (!uvm_enable_builtin_tests)
		return NV_ERR_NOT_SUPPORTED;
	if (params->flags)
		return NV_ERR_INVALID_ARGUMENT;
	state = uvm_kvmalloc_zero(sizeof(*state));
	if (!state)
		return NV_ERR_NO_MEMORY;
	uvm_mutex_init(&state->lock, UVM_LOCK_ORDER_EXT_RANGE_TREE);
	INIT_LIST_HEAD(&state->ranges);
	idr_init(&state->pages);
	state->mapped = RB_ROOT;
	list_add_tail(&ranges[0].link, &state->ranges);
	list_add_tail(&ranges[1].link, &state->ranges);

	uvm_mutex_lock(&state->lock);
	p64 = vmem_self_test_page(state, UVM_VMEM_PAGE_64K);
	p2m = vmem_self_test_page(state, UVM_VMEM_PAGE_2M);
	if (p64 && p2m)
		params->failedStep = vmem_self_test_steps(state, p64, p2m);
	else
		params->failedStep = ~0u;
	/* Whatever a failed step left: mappings first, then pages (no chunks to free). */
	idr_for_each_entry(&state->pages, p64, id) {
		list_for_each_entry_safe(m, next, &p64->mappings, page_link)
			vmem_mapping_unlink(state, m);
		vmem_page_free(state, p64);
	}
	if (!params->failedStep && (state->bytes || ranges[0].mapped_pages ||
				    ranges[1].mapped_pages))
		params->failedStep = 12;
	uvm_mutex_unlock(&state->lock);
	idr_destroy(&state->pages);
	uvm_kvfree(state);
	return NV_OK;
}
