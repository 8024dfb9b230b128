// Stock-driver proxy for the vMem patch's map path, on the GPU machine (which cannot load
// the patched module). nvidia-uvm maps its own semaphore pools with the same machinery the
// patch uses: a page-table range vector, PTE writes through the page tree, a membar and a
// TLB invalidate (uvm_mem_map_gpu_user). This program drives that stock path through the
// stock ioctls on the CUDA driver's own UVM file: for a 64 KB and a 2 MB pool it reserves a
// PROT_NONE range (as the patch's RESERVE does), allocates a semaphore pool inside it
// (UVM_ALLOC_SEMAPHORE_POOL), writes and reads every word from a kernel, frees it (UVM_FREE),
// and, in a child process, checks that the next GPU access faults.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/proxy tests/gpu/uvm_semaphore_proxy.cu -lcuda && /tmp/proxy
//
// The parameter layouts are nvidia-uvm's of the 580 branch (uvm_ioctl.h: UVM_MAX_GPUS = 256,
// UvmGpuMappingAttributes 36 bytes, UVM_ALLOC_SEMAPHORE_POOL_PARAMS 9248 bytes), checked by
// static_assert against those numbers. Exit status 0: every check passed.
#include <cuda.h>
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

struct MappingAttributes {
    uint8_t uuid[16];
    uint32_t mappingType, cachingType, formatType, elementBits, compressionType;
};
static_assert(sizeof(MappingAttributes) == 36, "UvmGpuMappingAttributes");

struct AllocSemaphorePool {
    uint64_t base, length;
    MappingAttributes perGpu[256];
    uint64_t gpuAttributesCount;
    uint32_t rmStatus;
};
static_assert(sizeof(AllocSemaphorePool) == 9248, "UVM_ALLOC_SEMAPHORE_POOL_PARAMS");
static_assert(offsetof(AllocSemaphorePool, gpuAttributesCount) == 9232, "layout");

struct FreeParams { uint64_t base, length; uint32_t rmStatus; };
static_assert(sizeof(FreeParams) == 24, "UVM_FREE_PARAMS");
struct PageableMemAccess { uint8_t access; uint32_t rmStatus; };

enum { UVM_FREE = 34, UVM_PAGEABLE_MEM_ACCESS = 39, UVM_ALLOC_SEMAPHORE_POOL = 68 };

static int failures;
#define CHECK(cond, ...) do { bool c_ = (cond); printf("proxy: %s ", c_ ? "ok  " : "FAIL"); \
    printf(__VA_ARGS__); printf("\n"); fflush(stdout); if (!c_) failures++; } while (0)
#define CU(x) do { CUresult r_ = (x); if (r_ != CUDA_SUCCESS) { const char *s_; cuGetErrorName(r_, &s_); \
    printf("proxy: FAIL %s: %s\n", #x, s_); exit(100); } } while (0)

__global__ void fill(uint32_t *p, size_t n, uint32_t seed) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        p[i] = (uint32_t)i * 2654435761u ^ seed;
}
__global__ void check(const uint32_t *p, size_t n, uint32_t seed, unsigned long long *bad) {
    for (size_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
        if (p[i] != ((uint32_t)i * 2654435761u ^ seed)) atomicAdd(bad, 1ull);
}

// The CUDA driver's nvidia-uvm file with a VA space (not UVM's MM file).
static int uvm_fd() {
    DIR *d = opendir("/proc/self/fd");
    struct dirent *e;
    char path[300], target[64];
    while (d && (e = readdir(d))) {
        snprintf(path, sizeof path, "/proc/self/fd/%s", e->d_name);
        ssize_t n = readlink(path, target, sizeof target - 1);
        if (n <= 0) continue;
        target[n] = 0;
        if (strcmp(target, "/dev/nvidia-uvm")) continue;
        int fd = atoi(e->d_name);
        PageableMemAccess q = {};
        if (ioctl(fd, UVM_PAGEABLE_MEM_ACCESS, &q) == 0 && q.rmStatus == 0) { closedir(d); return fd; }
    }
    if (d) closedir(d);
    return -1;
}

// A pool of `size` bytes at a 2 MB-aligned address inside a fresh PROT_NONE reservation.
static uint64_t pool(int fd, const CUuuid &uuid, uint64_t size, uint32_t *status) {
    void *r = mmap(nullptr, size + (2 << 20), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    uint64_t base = ((uint64_t)r + (2 << 20) - 1) & ~(uint64_t)((2 << 20) - 1);
    static AllocSemaphorePool p;
    memset(&p, 0, sizeof p);
    p.base = base;
    p.length = size;
    memcpy(p.perGpu[0].uuid, uuid.bytes, 16);
    p.gpuAttributesCount = 1;
    int ret = ioctl(fd, UVM_ALLOC_SEMAPHORE_POOL, &p);
    *status = ret ? 0xffffffffu : p.rmStatus;
    return base;
}

static uint32_t pool_free(int fd, uint64_t base, uint64_t size) {
    FreeParams f = {base, size, 0};
    return ioctl(fd, UVM_FREE, &f) ? 0xffffffffu : f.rmStatus;
}

int main(int argc, char **argv) {
    CUdevice dev;
    CUcontext ctx;
    CUuuid uuid;
    CU(cuInit(0));
    CU(cuDeviceGet(&dev, 0));
    CU(cuDevicePrimaryCtxRetain(&ctx, dev));
    CU(cuCtxSetCurrent(ctx));
    CU(cuDeviceGetUuid(&uuid, dev));
    int fd = uvm_fd();
    if (argc > 2 && !strcmp(argv[1], "--fault")) {
        // Child: a pool mapped, used, freed; then one more read must fault.
        uint64_t size = strtoull(argv[2], nullptr, 0);
        uint32_t st;
        uint64_t base = pool(fd, uuid, size, &st);
        if (st) return 3;
        fill<<<64, 256>>>((uint32_t *)base, size / 4, 7);
        if (cuCtxSynchronize() != CUDA_SUCCESS) return 4;
        if (pool_free(fd, base, size)) return 5;
        unsigned long long *bad;
        cudaMallocManaged(&bad, 8);
        check<<<64, 256>>>((const uint32_t *)base, size / 4, 7, bad);
        CUresult r = cuCtxSynchronize();
        const char *name = "?";
        cuGetErrorName(r, &name);
        printf("proxy: child: access after UVM_FREE -> %s\n", name);
        return r == CUDA_ERROR_ILLEGAL_ADDRESS ? 0 : 6;
    }
    CHECK(fd >= 0, "the CUDA driver's nvidia-uvm file with a VA space: fd %d", fd);
    if (fd < 0) return 1;
    for (uint64_t size : {64ull << 10, 2ull << 20}) {
        uint32_t st;
        uint64_t base = pool(fd, uuid, size, &st);
        CHECK(st == 0, "%llu KB semaphore pool in a PROT_NONE reservation at %#llx: status %#x",
              (unsigned long long)size >> 10, (unsigned long long)base, st);
        if (st) continue;
        unsigned long long *bad;
        cudaMallocManaged(&bad, 8);
        *bad = 0;
        fill<<<64, 256>>>((uint32_t *)base, size / 4, (uint32_t)size);
        check<<<64, 256>>>((const uint32_t *)base, size / 4, (uint32_t)size, bad);
        CUresult r = cuCtxSynchronize();
        CHECK(r == CUDA_SUCCESS && *bad == 0, "%llu KB: a kernel wrote and read back every word: %llu wrong, %d",
              (unsigned long long)size >> 10, *bad, (int)r);
        cudaFree(bad);
        CHECK(pool_free(fd, base, size) == 0, "%llu KB: UVM_FREE", (unsigned long long)size >> 10);
        char cmd[256];
        snprintf(cmd, sizeof cmd, "%s --fault %llu", argv[0], (unsigned long long)size);
        int ws = system(cmd);
        CHECK(WIFEXITED(ws) && WEXITSTATUS(ws) == 0,
              "%llu KB: in a child, the next GPU access after UVM_FREE faults (exit %d)",
              (unsigned long long)size >> 10, WIFEXITED(ws) ? WEXITSTATUS(ws) : -1);
    }
    printf("proxy: %d failed\n", failures);
    return failures != 0;
}
