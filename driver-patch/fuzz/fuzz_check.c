// SPDX-License-Identifier: MIT
/*
 * libFuzzer target for uvm_vmem_check.h, the vMem ioctls' argument checks, compiled from the
 * very header nvidia-uvm compiles. Each input is cut into the parameters of every check,
 * and each check is compared with an independent model in 128-bit arithmetic, where
 * address + length cannot wrap. Any disagreement aborts (and ASan/UBSan catch the rest).
 *
 *   scripts/driver-fuzz.sh [SECONDS]     # builds with clang -fsanitize=fuzzer,address,undefined
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "uvm_vmem_check.h"

typedef unsigned __int128 u128;

#define TOP ((u128)1 << 64)
#define MUST(cond) do { if (!(cond)) abort(); } while (0)

static uint64_t take64(const uint8_t **p, size_t *n)
{
	uint64_t v = 0;
	size_t k = *n < 8 ? *n : 8;

	memcpy(&v, *p, k);
	*p += k;
	*n -= k;
	return v;
}

/* Bias some values to the edges: near 0, near 2^64, and the page sizes. */
static uint64_t shape(uint64_t v)
{
	static const uint64_t edge[] = { 0, 1, 65536, 131072, 262144, 2097152, 4096,
					 UINT64_MAX, UINT64_MAX - 65535, UINT64_MAX - 2097151,
					 1ull << 63, 0x7fffffff, 0x80000000 };

	switch (v & 3) {
	case 0:
		return edge[(v >> 2) % (sizeof(edge) / sizeof(edge[0]))];
	case 1:
		return UINT64_MAX - (v >> 2) % 4194304;
	case 2:
		return (v >> 2) % 8388608;
	default:
		return v;
	}
}

static int model_page_size(u128 s)
{
	return s == 65536 || s == 131072 || s == 262144 || s == 2097152;
}

static int model_span(u128 base, u128 len)
{
	return len != 0 && base + len < TOP;	/* the end is representable */
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint64_t a = shape(take64(&data, &size)), b = shape(take64(&data, &size));
	uint64_t c = shape(take64(&data, &size)), d = shape(take64(&data, &size));
	uint32_t flags = (uint32_t)take64(&data, &size) & 3, count = (uint32_t)shape(take64(&data, &size));
	uint32_t cmd = (uint32_t)take64(&data, &size);

	MUST(uvm_vmem_page_size_ok(a) == model_page_size(a));
	MUST(uvm_vmem_span_ok(a, b) == model_span(a, b));
	if (uvm_vmem_span_ok(a, b))
		MUST((u128)a + b < TOP);	/* overflowing address + length is always refused */
	MUST(uvm_vmem_reserve_ok(a, flags, c) ==
	     (!flags && a && a % 2097152 == 0 && (u128)a + 2097152 <= c));
	MUST(uvm_vmem_create_ok(a, flags) == (!flags && model_page_size(a)));
	MUST(uvm_vmem_handle_ok(a) == (a >= 1 && a <= 0x7fffffff));
	MUST(uvm_vmem_page_at_ok(a, b) == (model_page_size(b) && a % b == 0 && model_span(a, b)));
	if (model_span(a, b) && model_span(c, d)) {
		MUST(uvm_vmem_inside(a, b, c, d) == ((u128)c >= a && (u128)c + d <= (u128)a + b));
		MUST(uvm_vmem_overlaps(a, b, c, d) == ((u128)a < (u128)c + d && (u128)c < (u128)a + b));
	}
	MUST(uvm_vmem_unmap_ok(a, b, flags) ==
	     (!flags && model_span(a, b) && a % 65536 == 0 && b % 65536 == 0));
	MUST(uvm_vmem_release_ok(a, flags) == (!(flags & ~1u) && a >= 1 && a <= 0x7fffffff));
	MUST(uvm_vmem_batch_ok(count, flags) == (!flags && count >= 1 && count <= 512));
	{
		static const uint32_t known[] = { UVM_VMEM_QUERY, UVM_VMEM_RESERVE, UVM_VMEM_CREATE,
						  UVM_VMEM_MAP, UVM_VMEM_UNMAP, UVM_VMEM_RELEASE,
						  UVM_VMEM_FREE, UVM_VMEM_MAP_BATCH,
						  UVM_VMEM_UNMAP_BATCH };
		int is_known = 0;
		size_t i;

		cmd = (cmd & 1) ? (UVM_VMEM_IOCTL_BASE | (cmd >> 16)) : cmd;
		for (i = 0; i < sizeof(known) / sizeof(known[0]); i++)
			is_known |= cmd == known[i];
		MUST(uvm_vmem_cmd_unknown(cmd) == ((cmd >> 16) == 0x564d && !is_known));
	}
	return 0;
}
