/* SPDX-License-Identifier: MIT */
/*
 * uvm_vmem_check.h - argument checks of the vMem ioctls, as pure functions.
 *
 * Copyright (c) 2026 the vmem authors.
 *
 * Everything an ioctl decides from its parameters alone (sizes, alignment, page sizes,
 * overflow of address + length, handle and batch bounds, flags) is decided here, with no
 * kernel state, so the same code is compiled into nvidia-uvm and into the user-space fuzzer
 * (driver-patch/fuzz/). An address range is [base, base + length): every check is written so
 * that base + length is never computed where it could wrap.
 */
#ifndef _UVM_VMEM_CHECK_H
#define _UVM_VMEM_CHECK_H

#include "uvm_vmem_ioctl.h"

/* Handles are IDR ids: positive ints. */
#define UVM_VMEM_MAX_HANDLE 0x7fffffffull

static inline int uvm_vmem_is_pow2(NvU64 x)
{
	return x && !(x & (x - 1));
}

/* One of the UVM_VMEM_PAGE_* sizes. */
static inline int uvm_vmem_page_size_ok(NvU64 page_size)
{
	return uvm_vmem_is_pow2(page_size) && (page_size & UVM_VMEM_PAGE_SIZES);
}

/* [base, base + length) is non-empty and its end is representable: no wrap. */
static inline int uvm_vmem_span_ok(NvU64 base, NvU64 length)
{
	return length && base <= ~0ull - length;
}

/*
 * UVM_VMEM_RESERVE: a non-zero multiple of the range alignment, small enough that the
 * aligned over-reservation (length + one alignment) fits in `cpu_max` bytes of CPU VA.
 */
static inline int uvm_vmem_reserve_ok(NvU64 length, NvU32 flags, NvU64 cpu_max)
{
	return !flags && length && !(length % UVM_VMEM_RANGE_ALIGN) &&
	       cpu_max >= UVM_VMEM_RANGE_ALIGN && length <= cpu_max - UVM_VMEM_RANGE_ALIGN;
}

static inline int uvm_vmem_create_ok(NvU64 page_size, NvU32 flags)
{
	return !flags && uvm_vmem_page_size_ok(page_size);
}

/* A handle UVM_VMEM_CREATE can have returned. */
static inline int uvm_vmem_handle_ok(NvU64 handle)
{
	return handle && handle <= UVM_VMEM_MAX_HANDLE;
}

/* A page of page_size at base: aligned, and [base, base + page_size) does not wrap. */
static inline int uvm_vmem_page_at_ok(NvU64 base, NvU64 page_size)
{
	return uvm_vmem_page_size_ok(page_size) && !(base & (page_size - 1)) &&
	       uvm_vmem_span_ok(base, page_size);
}

/* [address, address + size) lies inside [range_base, range_base + range_length). */
static inline int uvm_vmem_inside(NvU64 range_base, NvU64 range_length, NvU64 address, NvU64 size)
{
	return address >= range_base && size <= range_length &&
	       address - range_base <= range_length - size;
}

/* [a, a + a_len) and [b, b + b_len) share a byte (both spans must be valid). */
static inline int uvm_vmem_overlaps(NvU64 a, NvU64 a_len, NvU64 b, NvU64 b_len)
{
	return a < b ? b - a < a_len : a - b < b_len;
}

/* UVM_VMEM_UNMAP: a non-empty, non-wrapping run, aligned to the smallest page size. */
static inline int uvm_vmem_unmap_ok(NvU64 base, NvU64 length, NvU32 flags)
{
	return !flags && uvm_vmem_span_ok(base, length) && !(base % UVM_VMEM_PAGE_64K) &&
	       !(length % UVM_VMEM_PAGE_64K);
}

static inline int uvm_vmem_release_ok(NvU64 handle, NvU32 flags)
{
	return !(flags & ~UVM_VMEM_RELEASE_UNMAP) && uvm_vmem_handle_ok(handle);
}

static inline int uvm_vmem_batch_ok(NvU32 count, NvU32 flags)
{
	return !flags && count && count <= UVM_VMEM_BATCH_MAX;
}

/* What UVM_VMEM_RELEASE does with a page that has map_count mappings. */
#define UVM_VMEM_RELEASE_REFUSE 0	/* NV_ERR_IN_USE: it is mapped, and no UNMAP flag */
#define UVM_VMEM_RELEASE_FREE 1		/* not mapped: freed */
#define UVM_VMEM_RELEASE_UNMAP_FIRST 2	/* every mapping unmapped, then freed */

static inline int uvm_vmem_release_action(NvU64 map_count, NvU32 flags)
{
	if (!map_count)
		return UVM_VMEM_RELEASE_FREE;
	return (flags & UVM_VMEM_RELEASE_UNMAP) ? UVM_VMEM_RELEASE_UNMAP_FIRST :
						  UVM_VMEM_RELEASE_REFUSE;
}

/* A number of the vMem family that this header does not define (answered with EPROTO). */
static inline int uvm_vmem_cmd_unknown(NvU32 cmd)
{
	if ((cmd & UVM_VMEM_IOCTL_MASK) != UVM_VMEM_IOCTL_BASE)
		return 0;
	switch (cmd) {
	case UVM_VMEM_QUERY:
	case UVM_VMEM_RESERVE:
	case UVM_VMEM_CREATE:
	case UVM_VMEM_MAP:
	case UVM_VMEM_UNMAP:
	case UVM_VMEM_RELEASE:
	case UVM_VMEM_FREE:
	case UVM_VMEM_MAP_BATCH:
	case UVM_VMEM_UNMAP_BATCH:
	case UVM_VMEM_SELF_TEST:
		return 0;
	default:
		return 1;
	}
}

#endif /* _UVM_VMEM_CHECK_H */
