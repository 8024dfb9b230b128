// Does a lone 2 MB page in a 1 GB region cost more to map/unmap than one whose region holds
// another mapping (so that the GPU's page directory for the region stays resident)? The three
// cases are interleaved in one process. On the H100 (2026-11-23, docs/gpu.md) they cost the
// same: no anchor mapping is worth keeping. Build and run there:
//   nvcc -O2 -o /tmp/pd tests/gpu/page_directory_probe.cu -lcuda && /tmp/pd
#include <cuda.h>
#include <cstdio>
#include <vector>
#include <algorithm>
#include <chrono>
#define CK(x) do { CUresult r = (x); if (r != CUDA_SUCCESS) { const char* s; cuGetErrorName(r, &s); printf("%s:%d %s\n", __FILE__, __LINE__, s); return 1; } } while (0)
static double now() { return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count(); }
int main() {
  CK(cuInit(0)); CUdevice d; CK(cuDeviceGet(&d, 0)); CUcontext c; CK(cuDevicePrimaryCtxRetain(&c, d)); CK(cuCtxSetCurrent(c));
  const size_t P = 2 << 20, G = 1ull << 30;
  CUdeviceptr base; CK(cuMemAddressReserve(&base, 8 * G, G, 0, 0));
  CUmemAllocationProp prop = {}; prop.type = CU_MEM_ALLOCATION_TYPE_PINNED; prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE; prop.location.id = 0;
  CUmemAccessDesc acc = {}; acc.location = prop.location; acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  CUmemGenericAllocationHandle h[4]; for (auto& x : h) CK(cuMemCreate(&x, P, &prop, 0));
  // Region 0: lone page. Region 2: page with an anchor at the region's last page. Region 4: anchor in the next region only.
  CK(cuMemMap(base + 2 * G + G - P, P, 0, h[3], 0)); CK(cuMemSetAccess(base + 2 * G + G - P, P, &acc, 1));
  CK(cuMemMap(base + 5 * G, P, 0, h[2], 0)); CK(cuMemSetAccess(base + 5 * G, P, &acc, 1));
  CUdeviceptr at[3] = {base, base + 2 * G, base + 4 * G};
  const char* name[3] = {"lone page in its 1 GB region", "page beside an anchor in its region", "anchor in the next region only"};
  std::vector<double> m[3], u[3];
  for (int it = 0; it < 2000; it++) {
    for (int k0 = 0; k0 < 3; k0++) {
      int k = (k0 + it) % 3;
      double t0 = now();
      CK(cuMemMap(at[k], P, 0, h[k == 2 ? 1 : 0], 0)); CK(cuMemSetAccess(at[k], P, &acc, 1));
      double t1 = now();
      CK(cuMemUnmap(at[k], P));
      double t2 = now();
      if (it >= 20) { m[k].push_back(t1 - t0); u[k].push_back(t2 - t1); }
    }
  }
  for (int k = 0; k < 3; k++) {
    std::sort(m[k].begin(), m[k].end()); std::sort(u[k].begin(), u[k].end());
    printf("%-40s map+access %6.2f us  unmap %6.2f us  (medians of %zu)\n", name[k], m[k][m[k].size() / 2], u[k][u[k].size() / 2], m[k].size());
  }
  return 0;
}
