// SPDX-License-Identifier: MIT
/*
 * libFuzzer target for uvm_vmem_check.h, the vMem ioctls' argument checks, compiled from the
 * very header nvidia-uvm compiles. Each input is cut into the parameters of every check,
 * and each check is compared with an independent model in 128-bit arithmetic, where
 * address + length cannot wrap. The rest of the input drives a sequence of shared-page
 * operations (version 3: one page mapped at several addresses) decided by the header's
 * checks as the module decides them, against a model that tracks every 64K slot of a small
 * address space and each page's mappings. Any disagreement aborts (and ASan/UBSan catch the
 * rest).
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

/*
 * Shared pages. 4 pages (sizes 64K, 128K, 256K, 2M), a 32 MB space of 64K slots. The
 * "module" side keeps a list of mappings and decides with the header's checks (as
 * vmem_entries_link and the release ioctl do); the model marks slots and counts by hand.
 */
#define SLOTS 512
#define MAX_MAPS 64

struct mapping {
	uint64_t base, size;
	int page;
};

static void sharing(const uint8_t *data, size_t size)
{
	static const uint64_t page_size[4] = { 65536, 131072, 262144, 2097152 };
	struct mapping maps[MAX_MAPS];
	int owner[SLOTS];		/* model: the page mapped over each 64K slot, or -1 */
	int released[4] = { 0 };
	uint64_t count[4] = { 0 };	/* module: map counts */
	int n = 0, i, j;

	for (i = 0; i < SLOTS; i++)
		owner[i] = -1;
	while (size >= 3) {
		int op = data[0] & 3, page = (data[0] >> 2) & 3, flags = (data[0] >> 4) & 3;
		uint64_t base = ((uint64_t)data[1] | (uint64_t)data[2] << 8) % (SLOTS * 2) * 32768;

		data += 3;
		size -= 3;
		if (op <= 1) {		/* map `page` at `base` (op 1: 64K-aligned base) */
			uint64_t ps = page_size[page];
			int ok, free_slots = 1;

			if (op == 1)
				base &= ~(uint64_t)65535;
			ok = !released[page] && n < MAX_MAPS && uvm_vmem_page_at_ok(base, ps) &&
			     base + ps <= (uint64_t)SLOTS * 65536;
			for (j = 0; ok && j < n; j++)
				ok = !uvm_vmem_overlaps(base, ps, maps[j].base, maps[j].size);
			/* model: aligned, inside, and every slot it covers free */
			if (released[page] || n >= MAX_MAPS || base % ps ||
			    base + ps > (uint64_t)SLOTS * 65536)
				free_slots = 0;
			for (j = 0; free_slots && (uint64_t)j < ps / 65536; j++)
				free_slots = owner[base / 65536 + j] < 0;
			MUST(ok == free_slots);
			if (!ok)
				continue;
			maps[n++] = (struct mapping){ base, ps, page };
			count[page]++;
			for (j = 0; (uint64_t)j < ps / 65536; j++)
				owner[base / 65536 + j] = page;
		} else if (op == 2) {	/* unmap the mapping at `base`, if one starts there */
			for (j = 0; j < n && maps[j].base != (base & ~(uint64_t)65535); j++)
				;
			if (j == n)
				continue;
			for (i = 0; (uint64_t)i < maps[j].size / 65536; i++)
				owner[maps[j].base / 65536 + i] = -1;
			count[maps[j].page]--;
			maps[j] = maps[--n];
		} else {		/* release `page` with `flags` */
			int action = uvm_vmem_release_action(count[page], (uint32_t)flags);

			if (released[page])
				continue;
			MUST(action == (!count[page] ? UVM_VMEM_RELEASE_FREE :
					(flags & UVM_VMEM_RELEASE_UNMAP) ? UVM_VMEM_RELEASE_UNMAP_FIRST :
					UVM_VMEM_RELEASE_REFUSE));
			if (action == UVM_VMEM_RELEASE_REFUSE)
				continue;
			for (j = n - 1; j >= 0; j--) {
				if (maps[j].page != page)
					continue;
				for (i = 0; (uint64_t)i < maps[j].size / 65536; i++)
					owner[maps[j].base / 65536 + i] = -1;
				count[page]--;
				maps[j] = maps[--n];
			}
			MUST(count[page] == 0);
			released[page] = 1;
		}
		/* invariants: counts are the mappings per page; the slots are theirs */
		for (i = 0; i < 4; i++) {
			uint64_t c = 0, slots = 0;

			for (j = 0; j < n; j++)
				c += maps[j].page == i;
			for (j = 0; j < SLOTS; j++)
				slots += owner[j] == i;
			MUST(c == count[i] && slots == c * (page_size[i] / 65536));
			MUST(!released[i] || !c);
		}
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	uint64_t a = shape(take64(&data, &size)), b = shape(take64(&data, &size));
	uint64_t c = shape(take64(&data, &size)), d = shape(take64(&data, &size));
	uint32_t flags = (uint32_t)take64(&data, &size) & 3, count = (uint32_t)shape(take64(&data, &size));
	uint32_t cmd = (uint32_t)take64(&data, &size);
	/* Version 2's numbers (size in bits 4-11, no version bits): unknown to version 3. */
	static const uint32_t v2[] = { 0x564d0282, 0x564d0283, 0x564d0184, 0x564d0205,
				       0x564d0106, 0x564d0107, 0x564d0188, 0x564d0189 };
	size_t k;

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
	MUST(uvm_vmem_release_action(a, flags) ==
	     (!a ? UVM_VMEM_RELEASE_FREE : (flags & 1) ? UVM_VMEM_RELEASE_UNMAP_FIRST :
	      UVM_VMEM_RELEASE_REFUSE));
	for (k = 0; k < sizeof(v2) / sizeof(v2[0]); k++)
		MUST(uvm_vmem_cmd_unknown(v2[k]));
	{
		static const uint32_t known[] = { UVM_VMEM_QUERY, UVM_VMEM_RESERVE, UVM_VMEM_CREATE,
						  UVM_VMEM_MAP, UVM_VMEM_UNMAP, UVM_VMEM_RELEASE,
						  UVM_VMEM_FREE, UVM_VMEM_MAP_BATCH,
						  UVM_VMEM_UNMAP_BATCH, UVM_VMEM_SELF_TEST };
		int is_known = 0;
		size_t i;

		cmd = (cmd & 1) ? (UVM_VMEM_IOCTL_BASE | (cmd >> 16)) : cmd;
		for (i = 0; i < sizeof(known) / sizeof(known[0]); i++)
			is_known |= cmd == known[i];
		MUST(uvm_vmem_cmd_unknown(cmd) == ((cmd >> 16) == 0x564d && !is_known));
	}
	sharing(data, size);
	return 0;
}
