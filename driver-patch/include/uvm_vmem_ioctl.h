/* SPDX-License-Identifier: MIT */
/*
 * uvm_vmem_ioctl.h - vMem ioctls for nvidia-uvm: small-page virtual memory management.
 *
 * The contract between the vmem driver patch and user space (the uvm-ioctl Rust crate
 * generates its bindings from this file). Copyright (c) 2026 the vmem authors.
 *
 * The ioctls are issued on an open /dev/nvidia-uvm file that has been initialised with
 * UVM_INITIALIZE (in practice the CUDA driver's own file): all state lives on that file and
 * is released when it is closed or the process dies. Only the process that owns the file's
 * VA space may use them (a forked child gets NV_ERR_NOT_SUPPORTED).
 *
 *   UVM_VMEM_QUERY      version and supported page sizes (no side effects)
 *   UVM_VMEM_RESERVE    reserve a range of GPU virtual address space          (vMemReserve)
 *   UVM_VMEM_CREATE     allocate one physical page of 64K/128K/256K/2M bytes    (vMemCreate)
 *   UVM_VMEM_MAP        map a page at a page-aligned address of a reserved range (vMemMap)
 *   UVM_VMEM_UNMAP      unmap a run of mappings, keeping the pages allocated
 *   UVM_VMEM_RELEASE    free a physical page (unmapping it first if asked)      (vMemRelease)
 *   UVM_VMEM_FREE       free a reserved range; it must have nothing mapped      (vMemFree)
 *   UVM_VMEM_MAP_BATCH  map N (address, page) pairs: one membar, one TLB invalidate
 *   UVM_VMEM_UNMAP_BATCH unmap N (address, page) pairs: likewise
 *   UVM_VMEM_SELF_TEST  the module's own bookkeeping test (builtin tests only)
 *
 * Shared pages (version 3). A page can be mapped at several addresses at once, in one range
 * or several of the same GPU: each mapping has its own PTEs, and the page counts its
 * mappings (mapCount). Unmapping one mapping leaves the others. A page is freed only by
 * UVM_VMEM_RELEASE, which refuses a page that still has a mapping (NV_ERR_IN_USE) unless
 * UVM_VMEM_RELEASE_UNMAP asks it to unmap all of them first.
 *
 * Every command fills rmStatus: NV_OK, or NV_ERR_INVALID_ARGUMENT (bad size, alignment,
 * overflow, unsupported page size, flags), NV_ERR_INVALID_ADDRESS (not inside a range this
 * file reserved, or already mapped / not mapped), NV_ERR_UVM_ADDRESS_IN_USE (a reservation
 * would overlap a UVM range), NV_ERR_OBJECT_NOT_FOUND (unknown handle), NV_ERR_INVALID_DEVICE
 * (GPU UUID not registered on this file), NV_ERR_NO_MEMORY, NV_ERR_IN_USE (page mapped, range
 * not empty), NV_ERR_NOT_SUPPORTED (not the VA space's process).
 *
 * ABI. UVM copies a command's parameter struct in and out by the size the module was built
 * with, so a struct of another size must never reach it. Each command number therefore
 * carries its struct's size (bits 4-11) next to its number (bits 0-3), as _IOWR numbers do,
 * and, since version 3, the interface version (bits 12-15; version 2 left them 0), because a
 * command can change its meaning without changing its struct (version 3's MAP accepts a page
 * that is mapped already, which version 2 refused): a module and a client built from
 * different versions of this header disagree on every number, and the module answers a
 * number of this family it does not know with the errno EPROTO (never copying anything).
 * UVM_VMEM_QUERY alone is frozen (number and struct, since version 1), so any client can
 * read the module's version and refuse one it does not know.
 */
#ifndef _UVM_VMEM_IOCTL_H
#define _UVM_VMEM_IOCTL_H

#if defined(__KERNEL__)
#include "uvm_types.h"
#else
/* User space: the UVM types this header uses, with the same layout as uvm_types.h. */
#include <stdint.h>
typedef uint8_t NvU8;
typedef uint32_t NvU32;
typedef uint64_t NvU64;
typedef NvU32 NV_STATUS;
typedef struct nv_processor_uuid {
	NvU8 uuid[16];
} NvProcessorUuid;
#endif

/*
 * Command numbers. UVM dispatches on the raw number (no _IOC encoding); upstream uses
 * 0x30000001-2 and 1..2047. 0x564d ('V' 'M') << 16 keeps ours out of that space.
 */
#define UVM_VMEM_IOCTL_BASE 0x564d0000u
#define UVM_VMEM_IOCTL_MASK 0xffff0000u
#define UVM_VMEM_SIZE_SHIFT 4
#define UVM_VMEM_VERSION_SHIFT 12

/* Interface version reported by UVM_VMEM_QUERY, and carried by every other number. */
#define UVM_VMEM_VERSION 3u

#define UVM_VMEM_IOCTL_V (UVM_VMEM_IOCTL_BASE | (UVM_VMEM_VERSION << UVM_VMEM_VERSION_SHIFT))
#define UVM_VMEM_QUERY (UVM_VMEM_IOCTL_BASE + 1u)
#define UVM_VMEM_RESERVE (UVM_VMEM_IOCTL_V | (40u << UVM_VMEM_SIZE_SHIFT) | 2u)
#define UVM_VMEM_CREATE (UVM_VMEM_IOCTL_V | (40u << UVM_VMEM_SIZE_SHIFT) | 3u)
#define UVM_VMEM_MAP (UVM_VMEM_IOCTL_V | (32u << UVM_VMEM_SIZE_SHIFT) | 4u)
#define UVM_VMEM_UNMAP (UVM_VMEM_IOCTL_V | (32u << UVM_VMEM_SIZE_SHIFT) | 5u)
#define UVM_VMEM_RELEASE (UVM_VMEM_IOCTL_V | (16u << UVM_VMEM_SIZE_SHIFT) | 6u)
#define UVM_VMEM_FREE (UVM_VMEM_IOCTL_V | (16u << UVM_VMEM_SIZE_SHIFT) | 7u)
#define UVM_VMEM_MAP_BATCH (UVM_VMEM_IOCTL_V | (24u << UVM_VMEM_SIZE_SHIFT) | 8u)
#define UVM_VMEM_UNMAP_BATCH (UVM_VMEM_IOCTL_V | (24u << UVM_VMEM_SIZE_SHIFT) | 9u)
#define UVM_VMEM_SELF_TEST (UVM_VMEM_IOCTL_V | (12u << UVM_VMEM_SIZE_SHIFT) | 10u)

/* Page sizes, as bits of UVM_VMEM_QUERY_PARAMS.pageSizes (bit n = 2^n bytes). */
#define UVM_VMEM_PAGE_64K (1ull << 16)
#define UVM_VMEM_PAGE_128K (1ull << 17)
#define UVM_VMEM_PAGE_256K (1ull << 18)
#define UVM_VMEM_PAGE_2M (1ull << 21)
#define UVM_VMEM_PAGE_SIZES \
	(UVM_VMEM_PAGE_64K | UVM_VMEM_PAGE_128K | UVM_VMEM_PAGE_256K | UVM_VMEM_PAGE_2M)

/* Reserved ranges are aligned to, and a multiple of, this. */
#define UVM_VMEM_RANGE_ALIGN (2ull << 20)

/* Most entries one UVM_VMEM_MAP_BATCH / UVM_VMEM_UNMAP_BATCH takes. */
#define UVM_VMEM_BATCH_MAX 512u

/* UVM_VMEM_RELEASE_PARAMS.flags: unmap the page first if it is mapped. */
#define UVM_VMEM_RELEASE_UNMAP 0x1u

/* Frozen since version 1: the number and this struct never change. */
typedef struct uvm_vmem_query_params {
	NvU64 pageSizes; /* OUT: UVM_VMEM_PAGE_* bits */
	NvU64 rangeAlign; /* OUT: UVM_VMEM_RANGE_ALIGN */
	NvU32 version; /* OUT: UVM_VMEM_VERSION */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_QUERY_PARAMS;

typedef struct uvm_vmem_reserve_params {
	NvProcessorUuid gpuUuid; /* IN: a GPU registered on this file */
	NvU64 length; /* IN: multiple of rangeAlign */
	NvU64 base; /* OUT: start of the range, aligned to rangeAlign */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_RESERVE_PARAMS;

typedef struct uvm_vmem_create_params {
	NvProcessorUuid gpuUuid; /* IN: the GPU whose memory backs the page */
	NvU64 pageSize; /* IN: one of UVM_VMEM_PAGE_* */
	NvU64 handle; /* OUT: non-zero, unique on this file, not reused soon after release */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_CREATE_PARAMS;

typedef struct uvm_vmem_map_params {
	NvU64 base; /* IN: page-aligned address inside a reserved range, nothing mapped there */
	NvU64 handle; /* IN: a page created on this file; it may be mapped elsewhere already */
	NvU64 mapCount; /* OUT: the page's mappings, this one included */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_MAP_PARAMS;

typedef struct uvm_vmem_unmap_params {
	NvU64 base; /* IN: first mapping of a run of mappings */
	/* IN: bytes; the run must be exactly mapped (other mappings of its pages stay) */
	NvU64 length;
	NvU64 unmapped; /* OUT: bytes from base unmapped; length unless a GPU error stopped it */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_UNMAP_PARAMS;

typedef struct uvm_vmem_release_params {
	NvU64 handle; /* IN */
	/* IN: 0 (NV_ERR_IN_USE while it has a mapping) or UVM_VMEM_RELEASE_UNMAP (unmap every
	 * mapping of it, then free it)
	 */
	NvU32 flags;
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_RELEASE_PARAMS;

typedef struct uvm_vmem_free_params {
	NvU64 base; /* IN: start of a reserved range with nothing mapped */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_FREE_PARAMS;

/* One (address, page) pair of a batch. */
typedef struct uvm_vmem_batch_entry {
	NvU64 base; /* page-aligned address inside a reserved range */
	NvU64 handle; /* the page to map there / the page mapped there */
} UVM_VMEM_BATCH_ENTRY;

/*
 * UVM_VMEM_MAP_BATCH: all or nothing; every entry is validated (as UVM_VMEM_MAP does, and
 * no two entries overlap; one page may be named by several entries, at different addresses)
 * before any PTE is written. UVM_VMEM_UNMAP_BATCH: every entry must name the page mapped at
 * its address, and no address twice; done counts the entries unmapped, in order (count
 * unless a GPU error stopped it; then the rest are still mapped).
 */
typedef struct uvm_vmem_batch_params {
	NvU64 entries; /* IN: user address of count UVM_VMEM_BATCH_ENTRY */
	NvU32 count; /* IN: 1..UVM_VMEM_BATCH_MAX */
	NvU32 flags; /* IN: must be 0 */
	NvU32 done; /* OUT: entries mapped / unmapped */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_BATCH_PARAMS;

typedef UVM_VMEM_BATCH_PARAMS UVM_VMEM_MAP_BATCH_PARAMS;
typedef UVM_VMEM_BATCH_PARAMS UVM_VMEM_UNMAP_BATCH_PARAMS;

/*
 * UVM_VMEM_SELF_TEST: runs the module's sharing bookkeeping (map counts, overlap and
 * all-or-nothing validation, unmapping one mapping of several, release and free refusals)
 * on objects of its own, with no GPU and no page tables, and touches nothing of the file's.
 * Only when nvidia-uvm was loaded with uvm_enable_builtin_tests=1 (NV_ERR_NOT_SUPPORTED
 * otherwise). failedStep is 0 when every step passed, else the first that did not.
 */
typedef struct uvm_vmem_self_test_params {
	NvU32 flags; /* IN: must be 0 */
	NvU32 failedStep; /* OUT */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_SELF_TEST_PARAMS;

/* Each number carries its struct's size and the version: checked wherever it is compiled. */
#define UVM_VMEM_CMD_OF(type, nr) \
	(UVM_VMEM_IOCTL_V | ((NvU32)sizeof(type) << UVM_VMEM_SIZE_SHIFT) | (nr))
#define UVM_VMEM_CHECK_CMD(cmd, type, nr) \
	_Static_assert((cmd) == UVM_VMEM_CMD_OF(type, nr), #cmd " does not encode its size")
UVM_VMEM_CHECK_CMD(UVM_VMEM_RESERVE, UVM_VMEM_RESERVE_PARAMS, 2u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_CREATE, UVM_VMEM_CREATE_PARAMS, 3u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_MAP, UVM_VMEM_MAP_PARAMS, 4u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_UNMAP, UVM_VMEM_UNMAP_PARAMS, 5u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_RELEASE, UVM_VMEM_RELEASE_PARAMS, 6u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_FREE, UVM_VMEM_FREE_PARAMS, 7u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_MAP_BATCH, UVM_VMEM_BATCH_PARAMS, 8u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_UNMAP_BATCH, UVM_VMEM_BATCH_PARAMS, 9u);
UVM_VMEM_CHECK_CMD(UVM_VMEM_SELF_TEST, UVM_VMEM_SELF_TEST_PARAMS, 10u);

#endif /* _UVM_VMEM_IOCTL_H */
