/*
 * A strict stand-in for the CUDA driver (libcuda.so.1) for tests on machines without a GPU.
 *
 * The real cuda-bindings load this library, so every argument they marshal and every value they
 * unpack crosses the same C ABI as on a GPU. "Device" memory is host memory: a reservation is a
 * PROT_NONE mapping, a physical allocation is a memfd, cuMemMap maps the memfd into the
 * reservation, cuMemSetAccess makes it readable (PROT_READ) or readable and writable. Touching an
 * unmapped page from the host therefore faults, as a kernel would on a GPU, and so does a write
 * to a read-only mapping.
 *
 * The VMM rules are enforced strictly (CUDA_ERROR_INVALID_VALUE, or CUDA_ERROR_INVALID_CONTEXT
 * without a current context), one more strictly than the real driver (a mapped handle may not be
 * released), so bookkeeping bugs fail loudly. As in the real driver, one handle may be mapped at
 * several addresses (they alias the same memory); fake_mapping_at tells a test which handle and
 * access each page has, so aliasing is checked where it matters. New physical memory is filled
 * with 0xFF bytes (NaN as fp32) because the real driver does not zero it. Device-side work is
 * checked against the access flags: a memset or a writing kernel (fake_launch_write) needs
 * read-write access, a copy to the host or a reading kernel (fake_launch) needs read access;
 * anything else is a sticky CUDA_ERROR_ILLEGAL_ADDRESS.
 *
 * Extra exported functions (fake_*) let the tests read live counts, inject failures and
 * simulate queued kernels and sticky faults.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

enum {
    OK = 0,
    INVALID_VALUE = 1,
    OUT_OF_MEMORY = 2,
    NOT_INITIALIZED = 3,
    INVALID_DEVICE = 101,
    INVALID_CONTEXT = 201,
    NOT_FOUND = 500,
    NOT_SUPPORTED = 801,
    ILLEGAL_ADDRESS = 700,
};

typedef struct {
    int type;
    int id;
} Location;

typedef struct {
    int type;
    int requestedHandleTypes;
    Location location;
    void *win32HandleMetaData;
    unsigned char allocFlags[8];
} AllocationProp;

typedef struct {
    Location location;
    int flags;
} AccessDesc;

typedef struct {
    int live;
    int fd;
    size_t size;
    int mapped; /* how many addresses it is mapped at */
} Handle;

typedef struct {
    uintptr_t base;
    size_t size;
} Span;

enum { ACCESS_NONE = 0, ACCESS_READ = 1, ACCESS_READWRITE = 3 }; /* CUmemAccess_flags */

typedef struct {
    uintptr_t base;
    size_t size;
    unsigned long long handle;
    int access; /* ACCESS_* for the (one) device */
} Mapping;

#define MAX_ITEMS 65536
#define MAX_CALLS 64

static pthread_mutex_t lock = PTHREAD_RECURSIVE_MUTEX_INITIALIZER_NP;
static int initialized;
static int device_count = 1;
static int vmm_supported = 1;
static size_t granularity = 2u << 20;
static size_t total_memory = 64ull << 30;
static int sticky;
static int read_only_refusal; /* 0: PROT_READ access accepted, else the code cuMemSetAccess returns */
static int primary_retains;
static int primary_ctx_token; /* the primary context's address is its identity */
static __thread CUcontext stack[16];
static __thread int depth;

static Handle handles[MAX_ITEMS];
static Span reservations[MAX_ITEMS];
static Mapping mappings[MAX_ITEMS];
static Span pending[MAX_ITEMS];
static int n_handles, n_reservations, n_mappings, n_pending;
static int last_access_count, last_access_devices[8];

static struct {
    const char *name;
    long count;
    long fail_at; /* the count at which the call fails, 0 = never */
    int fail_code;
} calls[MAX_CALLS];
static int n_calls;

static int call_slot(const char *name) {
    for (int i = 0; i < n_calls; i++)
        if (strcmp(calls[i].name, name) == 0) return i;
    if (n_calls == MAX_CALLS) abort();
    calls[n_calls].name = strdup(name);
    return n_calls++;
}

/* Bookkeeping common to every entry point: count it, then refuse what the driver would. */
static CUresult enter(const char *name, int needs_context) {
    int slot = call_slot(name);
    long count = ++calls[slot].count;
    if (!initialized) return NOT_INITIALIZED;
    if (needs_context && sticky) return sticky;
    if (needs_context && (depth == 0 || stack[depth - 1] == NULL)) return INVALID_CONTEXT;
    if (calls[slot].fail_at && calls[slot].fail_at == count) {
        calls[slot].fail_at = 0;
        if (calls[slot].fail_code == ILLEGAL_ADDRESS) sticky = ILLEGAL_ADDRESS; /* as a fault */
        return calls[slot].fail_code;
    }
    return OK;
}

#define ENTER(name, ctx)                          \
    pthread_mutex_lock(&lock);                    \
    CUresult status_ = enter(name, ctx);          \
    if (status_ != OK) {                          \
        pthread_mutex_unlock(&lock);              \
        return status_;                           \
    }
#define LEAVE(code)               \
    do {                          \
        pthread_mutex_unlock(&lock); \
        return (code);            \
    } while (0)

static int aligned(uintptr_t value) { return value % granularity == 0; }

static int overlaps(uintptr_t a, size_t an, uintptr_t b, size_t bn) { return a < b + bn && b < a + an; }

static Span *reservation_of(uintptr_t base, size_t size) {
    for (int i = 0; i < n_reservations; i++) {
        Span *r = &reservations[i];
        if (r->size && base >= r->base && base + size <= r->base + r->size) return r;
    }
    return NULL;
}

static size_t used_memory(void) {
    size_t used = 0;
    for (int i = 0; i < n_handles; i++)
        if (handles[i].live) used += handles[i].size;
    return used;
}

/* Bytes of [base, base + size) covered by mappings whose access includes `need` (ACCESS_NONE:
 * any mapping, ACCESS_READ: readable, ACCESS_READWRITE: writable). */
static size_t covered(uintptr_t base, size_t size, int need) {
    size_t bytes = 0;
    for (int i = 0; i < n_mappings; i++) {
        Mapping *m = &mappings[i];
        if (m->size && overlaps(base, size, m->base, m->size) && (m->access & need) == need) {
            uintptr_t lo = m->base > base ? m->base : base;
            uintptr_t hi = m->base + m->size < base + size ? m->base + m->size : base + size;
            bytes += hi - lo;
        }
    }
    return bytes;
}

/* ---- initialisation, errors, devices ---------------------------------------------------- */

CUresult cuInit(unsigned int flags) {
    pthread_mutex_lock(&lock);
    calls[call_slot("cuInit")].count++;
    if (flags != 0) LEAVE(INVALID_VALUE);
    initialized = 1;
    LEAVE(OK);
}

CUresult cuDriverGetVersion(int *version) {
    pthread_mutex_lock(&lock);
    calls[call_slot("cuDriverGetVersion")].count++;
    if (!version) LEAVE(INVALID_VALUE);
    *version = 13000;
    LEAVE(OK);
}

static const char *error_name(CUresult code) {
    switch (code) {
    case OK: return "CUDA_SUCCESS";
    case INVALID_VALUE: return "CUDA_ERROR_INVALID_VALUE";
    case OUT_OF_MEMORY: return "CUDA_ERROR_OUT_OF_MEMORY";
    case NOT_INITIALIZED: return "CUDA_ERROR_NOT_INITIALIZED";
    case INVALID_DEVICE: return "CUDA_ERROR_INVALID_DEVICE";
    case INVALID_CONTEXT: return "CUDA_ERROR_INVALID_CONTEXT";
    case NOT_FOUND: return "CUDA_ERROR_NOT_FOUND";
    case NOT_SUPPORTED: return "CUDA_ERROR_NOT_SUPPORTED";
    case ILLEGAL_ADDRESS: return "CUDA_ERROR_ILLEGAL_ADDRESS";
    default: return NULL;
    }
}

static const char *error_text(CUresult code) {
    switch (code) {
    case OK: return "no error";
    case INVALID_VALUE: return "invalid argument";
    case OUT_OF_MEMORY: return "out of memory";
    case NOT_INITIALIZED: return "initialization error";
    case INVALID_DEVICE: return "invalid device ordinal";
    case INVALID_CONTEXT: return "invalid device context";
    case NOT_FOUND: return "named symbol not found";
    case NOT_SUPPORTED: return "operation not supported";
    case ILLEGAL_ADDRESS: return "an illegal memory access was encountered";
    default: return NULL;
    }
}

CUresult cuGetErrorName(CUresult code, const char **name) {
    if (!name || !error_name(code)) return INVALID_VALUE;
    *name = error_name(code);
    return OK;
}

CUresult cuGetErrorString(CUresult code, const char **text) {
    if (!text || !error_text(code)) return INVALID_VALUE;
    *text = error_text(code);
    return OK;
}

CUresult cuDeviceGetCount(int *count) {
    ENTER("cuDeviceGetCount", 0);
    if (!count) LEAVE(INVALID_VALUE);
    *count = device_count;
    LEAVE(OK);
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
    ENTER("cuDeviceGet", 0);
    if (!device) LEAVE(INVALID_VALUE);
    if (ordinal < 0 || ordinal >= device_count) LEAVE(INVALID_DEVICE);
    *device = ordinal;
    LEAVE(OK);
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
    ENTER("cuDeviceGetAttribute", 0);
    if (!value) LEAVE(INVALID_VALUE);
    if (device < 0 || device >= device_count) LEAVE(INVALID_DEVICE);
    if (attribute != 102) LEAVE(INVALID_VALUE); /* VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED */
    *value = vmm_supported;
    LEAVE(OK);
}

/* The device's 16-byte UUID (fixed per ordinal: what nvidia-smi shows as GPU-<hex groups>). */
CUresult cuDeviceGetUuid_v2(unsigned char *uuid, CUdevice device) {
    ENTER("cuDeviceGetUuid", 0);
    if (!uuid) LEAVE(INVALID_VALUE);
    if (device < 0 || device >= device_count) LEAVE(INVALID_DEVICE);
    for (int i = 0; i < 16; i++) uuid[i] = (unsigned char)(0xE0 + i + 16 * device);
    LEAVE(OK);
}

CUresult cuDeviceGetUuid(unsigned char *uuid, CUdevice device) {
    return cuDeviceGetUuid_v2(uuid, device);
}

/* ---- contexts ---------------------------------------------------------------------------- */

CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
    ENTER("cuDevicePrimaryCtxRetain", 0);
    if (!context) LEAVE(INVALID_VALUE);
    if (device != 0) LEAVE(INVALID_DEVICE); /* one context is enough for these tests */
    primary_retains++;
    *context = &primary_ctx_token;
    LEAVE(OK);
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice device) {
    ENTER("cuDevicePrimaryCtxRelease", 0);
    if (device != 0) LEAVE(INVALID_DEVICE);
    if (primary_retains == 0) LEAVE(INVALID_CONTEXT);
    primary_retains--;
    LEAVE(OK);
}

CUresult cuDevicePrimaryCtxRelease(CUdevice device) { return cuDevicePrimaryCtxRelease_v2(device); }

CUresult cuCtxGetCurrent(CUcontext *context) {
    ENTER("cuCtxGetCurrent", 0);
    if (!context) LEAVE(INVALID_VALUE);
    *context = depth ? stack[depth - 1] : NULL;
    LEAVE(OK);
}

CUresult cuCtxPushCurrent_v2(CUcontext context) {
    ENTER("cuCtxPushCurrent", 0);
    if (context != &primary_ctx_token || primary_retains == 0) LEAVE(INVALID_CONTEXT);
    if (depth == 16) LEAVE(INVALID_VALUE);
    stack[depth++] = context;
    LEAVE(OK);
}

CUresult cuCtxPushCurrent(CUcontext context) { return cuCtxPushCurrent_v2(context); }

CUresult cuCtxPopCurrent_v2(CUcontext *context) {
    ENTER("cuCtxPopCurrent", 0);
    if (depth == 0) LEAVE(INVALID_CONTEXT);
    depth--;
    if (context) *context = stack[depth];
    LEAVE(OK);
}

CUresult cuCtxPopCurrent(CUcontext *context) { return cuCtxPopCurrent_v2(context); }

CUresult cuCtxSynchronize(void) {
    ENTER("cuCtxSynchronize", 1);
    n_pending = 0; /* every queued kernel has finished */
    LEAVE(OK);
}

CUresult cuStreamSynchronize(CUstream stream) {
    ENTER("cuStreamSynchronize", 1);
    (void)stream; /* one simulated stream: work queued on any stream is done */
    n_pending = 0;
    LEAVE(OK);
}

/* ---- memory ------------------------------------------------------------------------------ */

CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total_bytes) {
    ENTER("cuMemGetInfo", 1);
    if (!free_bytes || !total_bytes) LEAVE(INVALID_VALUE);
    *total_bytes = total_memory;
    *free_bytes = total_memory - used_memory();
    LEAVE(OK);
}

CUresult cuMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    return cuMemGetInfo_v2(free_bytes, total_bytes);
}

static int valid_prop(const AllocationProp *prop) {
    return prop && prop->type == 1 && prop->location.type == 1 && prop->location.id >= 0 &&
           prop->location.id < device_count;
}

CUresult cuMemGetAllocationGranularity(size_t *value, const AllocationProp *prop, int option) {
    ENTER("cuMemGetAllocationGranularity", 1);
    if (!value || !valid_prop(prop) || (option != 0 && option != 1)) LEAVE(INVALID_VALUE);
    *value = granularity;
    LEAVE(OK);
}

CUresult cuMemAddressReserve(CUdeviceptr *ptr, size_t size, size_t alignment, CUdeviceptr addr,
                             unsigned long long flags) {
    ENTER("cuMemAddressReserve", 1);
    if (!ptr || size == 0 || !aligned(size) || flags != 0 || addr != 0) LEAVE(INVALID_VALUE);
    if (alignment & (alignment - 1)) LEAVE(INVALID_VALUE); /* a power of two, or 0 */
    size_t align = alignment > granularity ? alignment : granularity;
    if (n_reservations == MAX_ITEMS) LEAVE(OUT_OF_MEMORY);
    char *raw = mmap(NULL, size + align, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                     -1, 0);
    if (raw == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
    uintptr_t base = ((uintptr_t)raw + align - 1) / align * align;
    if (base > (uintptr_t)raw) munmap(raw, base - (uintptr_t)raw);
    size_t tail = (uintptr_t)raw + size + align - (base + size);
    if (tail) munmap((char *)(base + size), tail);
    reservations[n_reservations++] = (Span){base, size};
    *ptr = base;
    LEAVE(OK);
}

CUresult cuMemAddressFree(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemAddressFree", 1);
    for (int i = 0; i < n_reservations; i++) {
        Span *r = &reservations[i];
        if (r->size && r->base == ptr && r->size == size) {
            if (covered(ptr, size, ACCESS_NONE)) LEAVE(INVALID_VALUE); /* unmap everything first */
            munmap((void *)r->base, r->size);
            r->size = 0;
            LEAVE(OK);
        }
    }
    LEAVE(INVALID_VALUE);
}

CUresult cuMemCreate(CUmemGenericAllocationHandle *handle, size_t size, const AllocationProp *prop,
                     unsigned long long flags) {
    ENTER("cuMemCreate", 1);
    if (!handle || size == 0 || !aligned(size) || flags != 0 || !valid_prop(prop))
        LEAVE(INVALID_VALUE);
    if (used_memory() + size > total_memory || n_handles == MAX_ITEMS) LEAVE(OUT_OF_MEMORY);
    int fd = memfd_create("fakecuda", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) LEAVE(OUT_OF_MEMORY);
    void *fill = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (fill == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
    memset(fill, 0xFF, size); /* stale contents: the driver does not zero new memory */
    munmap(fill, size);
    handles[n_handles] = (Handle){1, fd, size, 0};
    *handle = (CUmemGenericAllocationHandle)(++n_handles);
    LEAVE(OK);
}

static Handle *handle_of(CUmemGenericAllocationHandle handle) {
    if (handle == 0 || handle > (unsigned long long)n_handles) return NULL;
    Handle *h = &handles[handle - 1];
    return h->live ? h : NULL;
}

CUresult cuMemRelease(CUmemGenericAllocationHandle handle) {
    ENTER("cuMemRelease", 1);
    Handle *h = handle_of(handle);
    if (!h || h->mapped) LEAVE(INVALID_VALUE); /* stricter than the driver: unmap everywhere first */
    close(h->fd);
    h->live = 0;
    LEAVE(OK);
}

CUresult cuMemMap(CUdeviceptr ptr, size_t size, size_t offset, CUmemGenericAllocationHandle handle,
                  unsigned long long flags) {
    ENTER("cuMemMap", 1);
    Handle *h = handle_of(handle);
    /* A handle may already be mapped elsewhere (the driver allows aliases); the address may not. */
    if (!h || offset != 0 || flags != 0 || size != h->size || !aligned(ptr)) LEAVE(INVALID_VALUE);
    if (!reservation_of(ptr, size) || covered(ptr, size, ACCESS_NONE)) LEAVE(INVALID_VALUE);
    if (n_mappings == MAX_ITEMS) LEAVE(OUT_OF_MEMORY);
    void *at = mmap((void *)ptr, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0);
    if (at == MAP_FAILED) LEAVE(OUT_OF_MEMORY);
    int slot = n_mappings;
    for (int i = 0; i < n_mappings; i++)
        if (!mappings[i].size) {
            slot = i;
            break;
        }
    if (slot == n_mappings) n_mappings++;
    mappings[slot] = (Mapping){ptr, size, handle, ACCESS_NONE};
    h->mapped++;
    LEAVE(OK);
}

CUresult cuMemSetAccess(CUdeviceptr ptr, size_t size, const AccessDesc *desc, size_t count) {
    ENTER("cuMemSetAccess", 1);
    if (!desc || count == 0 || count > 8 || size == 0 || !aligned(ptr) || !aligned(size))
        LEAVE(INVALID_VALUE);
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1 || desc[i].location.id < 0 ||
            desc[i].location.id >= device_count)
            LEAVE(INVALID_DEVICE);
        int flags = desc[i].flags;
        if (flags != ACCESS_NONE && flags != ACCESS_READ && flags != ACCESS_READWRITE)
            LEAVE(INVALID_VALUE);
        if (flags == ACCESS_READ && read_only_refusal) LEAVE(read_only_refusal);
    }
    if (covered(ptr, size, ACCESS_NONE) != size) LEAVE(INVALID_VALUE); /* only mapped bytes */
    int flags = desc[0].flags;
    int prot = flags == ACCESS_READWRITE ? PROT_READ | PROT_WRITE
               : flags == ACCESS_READ    ? PROT_READ
                                         : PROT_NONE;
    if (mprotect((void *)ptr, size, prot) != 0) LEAVE(INVALID_VALUE);
    for (int i = 0; i < n_mappings; i++)
        if (mappings[i].size && overlaps(ptr, size, mappings[i].base, mappings[i].size))
            mappings[i].access = flags;
    last_access_count = (int)count;
    for (size_t i = 0; i < count; i++) last_access_devices[i] = desc[i].location.id;
    LEAVE(OK);
}

CUresult cuMemUnmap(CUdeviceptr ptr, size_t size) {
    ENTER("cuMemUnmap", 1);
    if (size == 0) LEAVE(INVALID_VALUE);
    /* The range must be made of whole mappings, back to back. */
    size_t whole = 0;
    for (int i = 0; i < n_mappings; i++) {
        Mapping *m = &mappings[i];
        if (!m->size || !overlaps(ptr, size, m->base, m->size)) continue;
        if (m->base < ptr || m->base + m->size > ptr + size) LEAVE(INVALID_VALUE);
        whole += m->size;
    }
    if (whole != size) LEAVE(INVALID_VALUE);
    for (int i = 0; i < n_pending; i++)
        if (overlaps(ptr, size, pending[i].base, pending[i].size))
            sticky = ILLEGAL_ADDRESS; /* a queued kernel will touch what is gone */
    for (int i = 0; i < n_mappings; i++) {
        Mapping *m = &mappings[i];
        if (!m->size || !overlaps(ptr, size, m->base, m->size)) continue;
        handles[m->handle - 1].mapped--;
        m->size = 0;
    }
    mmap((void *)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1,
         0);
    LEAVE(OK);
}

static CUresult memset_d8(const char *name, CUdeviceptr ptr, unsigned char value, size_t n) {
    ENTER(name, 1);
    if (n == 0) LEAVE(OK);
    if (covered(ptr, n, ACCESS_READWRITE) != n) {
        sticky = ILLEGAL_ADDRESS; /* the memset kernel hit an unmapped or read-only page */
        LEAVE(ILLEGAL_ADDRESS);
    }
    memset((void *)ptr, value, n);
    LEAVE(OK);
}

CUresult cuMemsetD8_v2(CUdeviceptr ptr, unsigned char value, size_t n) {
    return memset_d8("cuMemsetD8", ptr, value, n);
}

CUresult cuMemsetD8(CUdeviceptr ptr, unsigned char value, size_t n) {
    return cuMemsetD8_v2(ptr, value, n);
}

CUresult cuMemsetD8Async(CUdeviceptr ptr, unsigned char value, size_t n, CUstream stream) {
    (void)stream;
    return memset_d8("cuMemsetD8Async", ptr, value, n);
}

/* A synchronous copy to the host: every byte must be readable by the device. */
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t n) {
    ENTER("cuMemcpyDtoH", 1);
    if (!dst) LEAVE(INVALID_VALUE);
    if (n == 0) LEAVE(OK);
    if (covered(src, n, ACCESS_READ) != n) {
        sticky = ILLEGAL_ADDRESS; /* the copy read an unmapped page */
        LEAVE(ILLEGAL_ADDRESS);
    }
    n_pending = 0; /* synchronous: like the legacy stream, it waits for queued work first */
    memcpy(dst, (const void *)src, n);
    LEAVE(OK);
}

CUresult cuMemcpyDtoH(void *dst, CUdeviceptr src, size_t n) { return cuMemcpyDtoH_v2(dst, src, n); }

/* ---- symbol lookup ----------------------------------------------------------------------- */

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status);

static const struct {
    const char *name;
    void *function;
} table[] = {
    {"cuGetProcAddress", (void *)cuGetProcAddress_v2},
    {"cuInit", (void *)cuInit},
    {"cuDriverGetVersion", (void *)cuDriverGetVersion},
    {"cuGetErrorName", (void *)cuGetErrorName},
    {"cuGetErrorString", (void *)cuGetErrorString},
    {"cuDeviceGetCount", (void *)cuDeviceGetCount},
    {"cuDeviceGet", (void *)cuDeviceGet},
    {"cuDeviceGetAttribute", (void *)cuDeviceGetAttribute},
    {"cuDeviceGetUuid", (void *)cuDeviceGetUuid_v2},
    {"cuDeviceGetUuid_v2", (void *)cuDeviceGetUuid_v2},
    {"cuDevicePrimaryCtxRetain", (void *)cuDevicePrimaryCtxRetain},
    {"cuDevicePrimaryCtxRelease", (void *)cuDevicePrimaryCtxRelease_v2},
    {"cuCtxGetCurrent", (void *)cuCtxGetCurrent},
    {"cuCtxPushCurrent", (void *)cuCtxPushCurrent_v2},
    {"cuCtxPopCurrent", (void *)cuCtxPopCurrent_v2},
    {"cuCtxSynchronize", (void *)cuCtxSynchronize},
    {"cuStreamSynchronize", (void *)cuStreamSynchronize},
    {"cuMemGetInfo", (void *)cuMemGetInfo_v2},
    {"cuMemGetAllocationGranularity", (void *)cuMemGetAllocationGranularity},
    {"cuMemAddressReserve", (void *)cuMemAddressReserve},
    {"cuMemAddressFree", (void *)cuMemAddressFree},
    {"cuMemCreate", (void *)cuMemCreate},
    {"cuMemRelease", (void *)cuMemRelease},
    {"cuMemMap", (void *)cuMemMap},
    {"cuMemSetAccess", (void *)cuMemSetAccess},
    {"cuMemUnmap", (void *)cuMemUnmap},
    {"cuMemsetD8", (void *)cuMemsetD8_v2},
    {"cuMemsetD8Async", (void *)cuMemsetD8Async},
    {"cuMemcpyDtoH", (void *)cuMemcpyDtoH_v2},
};

static void *lookup(const char *symbol) {
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (symbol && strcmp(table[i].name, symbol) == 0) return table[i].function;
    return NULL;
}

CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, unsigned long long flags,
                             int *status) {
    (void)version;
    (void)flags;
    if (!pfn) return INVALID_VALUE;
    *pfn = lookup(symbol);
    if (status) *status = *pfn ? 0 : 1; /* SUCCESS / SYMBOL_NOT_FOUND */
    return *pfn ? OK : NOT_FOUND;
}

CUresult cuGetProcAddress(const char *symbol, void **pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, NULL);
}

/* ---- test hooks -------------------------------------------------------------------------- */

static int live(const void *items, int n, size_t stride, size_t offset) {
    int count = 0;
    for (int i = 0; i < n; i++) {
        const char *item = (const char *)items + (size_t)i * stride;
        size_t value;
        memcpy(&value, item + offset, sizeof value);
        count += value != 0;
    }
    return count;
}

int fake_live_handles(void) {
    int count = 0;
    for (int i = 0; i < n_handles; i++) count += handles[i].live;
    return count;
}

int fake_live_mappings(void) { return live(mappings, n_mappings, sizeof(Mapping), offsetof(Mapping, size)); }

int fake_live_reservations(void) {
    return live(reservations, n_reservations, sizeof(Span), offsetof(Span, size));
}

int fake_primary_retains(void) { return primary_retains; }
int fake_context_depth(void) { return depth; }
int fake_sticky_error(void) { return sticky; }
int fake_pending_kernels(void) { return n_pending; }
size_t fake_used_bytes(void) { return used_memory(); }

long fake_calls(const char *name) {
    pthread_mutex_lock(&lock);
    long count = calls[call_slot(name)].count;
    pthread_mutex_unlock(&lock);
    return count;
}

/* Make the `nth` next call of `name` (1 = the next one) return `code` and do nothing. */
void fake_fail(const char *name, long nth, int code) {
    pthread_mutex_lock(&lock);
    int slot = call_slot(name);
    calls[slot].fail_at = calls[slot].count + nth;
    calls[slot].fail_code = code;
    pthread_mutex_unlock(&lock);
}

void fake_set_device_count(int count) { device_count = count; }
void fake_set_vmm_supported(int supported) { vmm_supported = supported; }
void fake_set_total_memory(size_t bytes) { total_memory = bytes; }
void fake_set_granularity(size_t bytes) { granularity = bytes; }

int fake_last_access(int *devices, int capacity) {
    for (int i = 0; i < last_access_count && i < capacity; i++) devices[i] = last_access_devices[i];
    return last_access_count;
}

/* Queue a simulated kernel that reads [ptr, ptr + size): it faults at once (a sticky
 * CUDA_ERROR_ILLEGAL_ADDRESS) if any byte is not readable, else it stays pending until a
 * synchronize; an unmap under it before then faults too. Returns the sticky error (0 = none). */
int fake_launch(CUdeviceptr ptr, size_t size) {
    pthread_mutex_lock(&lock);
    if (covered(ptr, size, ACCESS_READ) != size) sticky = ILLEGAL_ADDRESS;
    else if (n_pending < MAX_ITEMS) pending[n_pending++] = (Span){ptr, size};
    int result = sticky;
    pthread_mutex_unlock(&lock);
    return result;
}

/* The same for a kernel that writes `value` to every byte: it faults unless every byte is
 * mapped read-write (a read-only mapping is an illegal address for a store, as on a GPU). */
int fake_launch_write(CUdeviceptr ptr, size_t size, int value) {
    pthread_mutex_lock(&lock);
    if (covered(ptr, size, ACCESS_READWRITE) != size) sticky = ILLEGAL_ADDRESS;
    else {
        memset((void *)ptr, value, size);
        if (n_pending < MAX_ITEMS) pending[n_pending++] = (Span){ptr, size};
    }
    int result = sticky;
    pthread_mutex_unlock(&lock);
    return result;
}

/* Which handle is mapped at `ptr` and with which access; returns 0 if nothing is mapped. */
int fake_mapping_at(CUdeviceptr ptr, unsigned long long *handle, int *access) {
    pthread_mutex_lock(&lock);
    int found = 0;
    for (int i = 0; i < n_mappings && !found; i++) {
        Mapping *m = &mappings[i];
        if (m->size && ptr >= m->base && ptr < m->base + m->size) {
            *handle = m->handle;
            *access = m->access;
            found = 1;
        }
    }
    pthread_mutex_unlock(&lock);
    return found;
}

/* How many addresses `handle` is mapped at (0 for an unknown or released handle). */
int fake_handle_mappings(unsigned long long handle) {
    pthread_mutex_lock(&lock);
    Handle *h = handle_of(handle);
    int count = h ? h->mapped : 0;
    pthread_mutex_unlock(&lock);
    return count;
}

/* 0: cuMemSetAccess accepts CU_MEM_ACCESS_FLAGS_PROT_READ; else it refuses it with `code`. */
void fake_refuse_read_only(int code) { read_only_refusal = code; }

/* Free everything and restore the defaults, so one test's leak cannot break the next. */
void fake_reset(void) {
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_mappings; i++)
        if (mappings[i].size)
            mmap((void *)mappings[i].base, mappings[i].size, PROT_NONE,
                 MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    for (int i = 0; i < n_handles; i++)
        if (handles[i].live) close(handles[i].fd);
    for (int i = 0; i < n_reservations; i++)
        if (reservations[i].size) munmap((void *)reservations[i].base, reservations[i].size);
    n_mappings = n_handles = n_reservations = n_pending = 0;
    for (int i = 0; i < n_calls; i++) calls[i].fail_at = 0;
    sticky = 0;
    read_only_refusal = 0;
    device_count = 1;
    vmm_supported = 1;
    granularity = 2u << 20;
    total_memory = 64ull << 30;
    last_access_count = 0;
    pthread_mutex_unlock(&lock);
}
