/* SPDX-License-Identifier: MIT */
/*
 * uvm_vmem_ioctl.h - vMem ioctls for nvidia-uvm: small-page virtual memory management.
 *
 * The contract between the vmem driver patch and user space (the uvm-ioctl Rust crate
 * generates its bindings from this file). Copyright (c) 2026 the vmem authors.
 *
 * The ioctls are issued on an open /dev/nvidia-uvm file that has been initialised with
 * UVM_INITIALIZE (in practice the CUDA driver's own file): all state lives on that file and
 * is released when it is closed or the process dies.
 *
 *   UVM_VMEM_QUERY    version and supported page sizes (no side effects)
 *   UVM_VMEM_RESERVE  reserve a range of GPU virtual address space           (vMemReserve)
 *   UVM_VMEM_CREATE   allocate one physical page of 64K/128K/256K/2M bytes     (vMemCreate)
 *   UVM_VMEM_MAP      map a page at a page-aligned address of a reserved range (vMemMap)
 *   UVM_VMEM_UNMAP    unmap a run of pages, keeping them allocated
 *   UVM_VMEM_RELEASE  free a physical page (unmapping it first if asked)       (vMemRelease)
 *   UVM_VMEM_FREE     free a reserved range; it must have nothing mapped       (vMemFree)
 *
 * Every command fills rmStatus: NV_OK, or NV_ERR_INVALID_ARGUMENT (bad size, alignment,
 * overflow, unsupported page size, flags), NV_ERR_INVALID_ADDRESS (not inside a range this
 * file reserved, or already mapped / not mapped), NV_ERR_OBJECT_NOT_FOUND (unknown handle),
 * NV_ERR_INVALID_DEVICE (GPU UUID not registered on this file), NV_ERR_NO_MEMORY,
 * NV_ERR_IN_USE (page mapped, range not empty), NV_ERR_NOT_SUPPORTED.
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
#define UVM_VMEM_QUERY (UVM_VMEM_IOCTL_BASE + 1u)
#define UVM_VMEM_RESERVE (UVM_VMEM_IOCTL_BASE + 2u)
#define UVM_VMEM_CREATE (UVM_VMEM_IOCTL_BASE + 3u)
#define UVM_VMEM_MAP (UVM_VMEM_IOCTL_BASE + 4u)
#define UVM_VMEM_UNMAP (UVM_VMEM_IOCTL_BASE + 5u)
#define UVM_VMEM_RELEASE (UVM_VMEM_IOCTL_BASE + 6u)
#define UVM_VMEM_FREE (UVM_VMEM_IOCTL_BASE + 7u)

/* Interface version reported by UVM_VMEM_QUERY. */
#define UVM_VMEM_VERSION 1u

/* Page sizes, as bits of UVM_VMEM_QUERY_PARAMS.pageSizes (bit n = 2^n bytes). */
#define UVM_VMEM_PAGE_64K (1ull << 16)
#define UVM_VMEM_PAGE_128K (1ull << 17)
#define UVM_VMEM_PAGE_256K (1ull << 18)
#define UVM_VMEM_PAGE_2M (1ull << 21)
#define UVM_VMEM_PAGE_SIZES \
	(UVM_VMEM_PAGE_64K | UVM_VMEM_PAGE_128K | UVM_VMEM_PAGE_256K | UVM_VMEM_PAGE_2M)

/* Reserved ranges are aligned to, and a multiple of, this. */
#define UVM_VMEM_RANGE_ALIGN (2ull << 20)

/* UVM_VMEM_RELEASE_PARAMS.flags: unmap the page first if it is mapped. */
#define UVM_VMEM_RELEASE_UNMAP 0x1u

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
	NvU64 handle; /* OUT: non-zero, unique on this file */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_CREATE_PARAMS;

typedef struct uvm_vmem_map_params {
	NvU64 base; /* IN: page-aligned address inside a reserved range */
	NvU64 handle; /* IN: a page created on this file, not mapped */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_MAP_PARAMS;

typedef struct uvm_vmem_unmap_params {
	NvU64 base; /* IN: first page of a run of mapped pages */
	NvU64 length; /* IN: bytes; the run must be exactly mapped */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_UNMAP_PARAMS;

typedef struct uvm_vmem_release_params {
	NvU64 handle; /* IN */
	NvU32 flags; /* IN: 0 or UVM_VMEM_RELEASE_UNMAP */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_RELEASE_PARAMS;

typedef struct uvm_vmem_free_params {
	NvU64 base; /* IN: start of a reserved range with nothing mapped */
	NvU32 flags; /* IN: must be 0 */
	NV_STATUS rmStatus; /* OUT */
} UVM_VMEM_FREE_PARAMS;

#endif /* _UVM_VMEM_IOCTL_H */
