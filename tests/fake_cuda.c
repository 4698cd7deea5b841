/* A stand-in for libcudart + libcuda with the exact C signatures cuda_ipc binds through
 * ctypes (cuda_ipc/cuda_api.py), for CPU tests of that layer (tests/test_cuda_api.py).
 *
 * What it models, to catch what a wrong ctypes declaration or a missing context would do
 * on a real GPU:
 * - contexts: a thread has no current context until it makes a runtime call (which binds
 *   device 0's primary one, as libcudart does) or pushes one; driver stream operations
 *   without a current context fail with CUDA_ERROR_INVALID_CONTEXT (201);
 * - host registration: registered ranges get device addresses at a fixed offset from the
 *   host ones (so passing a host address where a device one is due, or an unregistered one,
 *   fails with 1); overlapping registration fails with 712;
 * - IPC handles: 64 bytes passed by value; opening one this process exported fails with
 *   201, a handle whose bytes were not all carried fails with 400;
 * - streams: one worker thread runs every stream operation in order; a wait holds the
 *   queue until (int32_t)(*word - value) >= 0, a write stores after everything before it.
 * fake_set_mode(1): waits do not wait; fake_set_mode(2): writes never land.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define DEV_OFFSET 0x100000000000ULL
#define MAX_REG 256
#define MAX_OPS 65536

static __thread void *ctx_stack[16];
static __thread int ctx_depth = 0;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
static struct { uintptr_t host; size_t size; } regs[MAX_REG];
static int nregs = 0;
static struct { int kind; uint32_t *word; uint32_t value; } ops[MAX_OPS];
static int op_head = 0, op_tail = 0, op_busy = 0;
static pthread_t worker;
static int worker_started = 0;
static int mode = 0;

/* what the tests read back */
void *fake_last_ctx = 0;
uint64_t fake_last_addr = 0;
uint32_t fake_last_value = 0;
unsigned fake_last_flags = 0;
unsigned fake_last_register_flags = 0;
unsigned fake_last_open_flags = 0;
int fake_memops = 0;

static void *primary(int dev) { return (void *)(uintptr_t)(0x1000 + dev); }
static void *current(void) { return ctx_depth ? ctx_stack[ctx_depth - 1] : 0; }
static void runtime_binds(void) { if (!ctx_depth) ctx_stack[ctx_depth++] = primary(0); }

void fake_set_mode(int m) { mode = m; }
int fake_registrations(void) { return nregs; }

int fake_pending(void) {
    pthread_mutex_lock(&mu);
    int n = op_tail - op_head + op_busy;
    pthread_mutex_unlock(&mu);
    return n;
}

/* ---- runtime ------------------------------------------------------------------------- */

const char *cudaGetErrorString(int code) { return code ? "fake error" : "no error"; }
int cudaRuntimeGetVersion(int *v) { *v = 13000; return 0; }
int cudaDriverGetVersion(int *v) { *v = 13000; return 0; }
int cudaDeviceSynchronize(void) { runtime_binds(); return 0; }

int cudaMalloc(void **p, size_t n) {
    runtime_binds();
    *p = malloc(n ? n : 1);
    return *p ? 0 : 2;
}

int cudaFree(void *p) { runtime_binds(); free(p); return 0; }

int cudaMemset(void *p, int v, size_t n) { runtime_binds(); memset(p, v, n); return 0; }

int cudaDeviceCanAccessPeer(int *can, int dev, int peer) { *can = dev != peer; return 0; }

int cudaDeviceGetAttribute(int *v, int attr, int dev) {
    *v = (attr == 19 || attr == 41 || attr == 99) ? 1 : 0;
    return dev == 0 ? 0 : 101;
}

typedef struct { unsigned char bytes[64]; } handle_t;

int cudaIpcGetMemHandle(handle_t *h, void *p) {
    runtime_binds();
    int64_t pid = getpid();
    uint64_t ptr = (uintptr_t)p;
    memcpy(h->bytes, "FAKEIPC", 8);
    memcpy(h->bytes + 8, &pid, 8);
    memcpy(h->bytes + 16, &ptr, 8);
    for (int i = 24; i < 64; i++) h->bytes[i] = (unsigned char)(i * 7);
    return 0;
}

int cudaIpcOpenMemHandle(void **p, handle_t h, unsigned flags) {
    runtime_binds();
    int64_t pid;
    uint64_t ptr;
    fake_last_open_flags = flags;
    if (memcmp(h.bytes, "FAKEIPC", 8)) return 400;
    for (int i = 24; i < 64; i++)
        if (h.bytes[i] != (unsigned char)(i * 7)) return 400;
    memcpy(&pid, h.bytes + 8, 8);
    memcpy(&ptr, h.bytes + 16, 8);
    if (pid == getpid()) return 201;
    *p = (void *)(uintptr_t)ptr;
    return 0;
}

int cudaIpcCloseMemHandle(void *p) { (void)p; return 0; }

int cudaHostRegister(void *p, size_t n, unsigned flags) {
    runtime_binds();
    uintptr_t a = (uintptr_t)p;
    fake_last_register_flags = flags;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nregs; i++)
        if (a < regs[i].host + regs[i].size && regs[i].host < a + n) {
            pthread_mutex_unlock(&mu);
            return 712;
        }
    if (nregs == MAX_REG) { pthread_mutex_unlock(&mu); return 2; }
    regs[nregs].host = a;
    regs[nregs].size = n;
    nregs++;
    pthread_mutex_unlock(&mu);
    return 0;
}

int cudaHostUnregister(void *p) {
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nregs; i++)
        if (regs[i].host == (uintptr_t)p) {
            regs[i] = regs[--nregs];
            pthread_mutex_unlock(&mu);
            return 0;
        }
    pthread_mutex_unlock(&mu);
    return 713;
}

int cudaHostGetDevicePointer(void **d, void *h, unsigned flags) {
    if (flags) return 1;
    pthread_mutex_lock(&mu);
    for (int i = 0; i < nregs; i++)
        if ((uintptr_t)h >= regs[i].host && (uintptr_t)h < regs[i].host + regs[i].size) {
            *d = (void *)((uintptr_t)h + DEV_OFFSET);
            pthread_mutex_unlock(&mu);
            return 0;
        }
    pthread_mutex_unlock(&mu);
    return 1;
}

/* ---- driver -------------------------------------------------------------------------- */

int cuGetErrorString(int code, const char **s) { *s = code ? "fake driver error" : "no error"; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return ordinal == 0 ? 0 : 101; }
int cuDevicePrimaryCtxRetain(void **ctx, int dev) { *ctx = primary(dev); return 0; }
int cuCtxGetCurrent(void **ctx) { *ctx = current(); return 0; }

int cuCtxPushCurrent_v2(void *ctx) {
    if (ctx_depth == 16) return 1;
    ctx_stack[ctx_depth++] = ctx;
    return 0;
}

int cuCtxPopCurrent_v2(void **ctx) {
    if (!ctx_depth) return 201;
    *ctx = ctx_stack[--ctx_depth];
    return 0;
}

static void *run_ops(void *arg) {
    (void)arg;
    pthread_mutex_lock(&mu);
    for (;;) {
        while (op_head == op_tail) pthread_cond_wait(&cv, &mu);
        int kind = ops[op_head % MAX_OPS].kind;
        uint32_t *word = ops[op_head % MAX_OPS].word;
        uint32_t value = ops[op_head % MAX_OPS].value;
        op_head++;
        op_busy = 1;
        pthread_mutex_unlock(&mu);
        if (kind == 0) {
            if (!(mode & 2)) __atomic_store_n(word, value, __ATOMIC_SEQ_CST);
        } else if (!(mode & 1)) {
            while ((int32_t)(__atomic_load_n(word, __ATOMIC_SEQ_CST) - value) < 0) usleep(50);
        }
        pthread_mutex_lock(&mu);
        op_busy = 0;
    }
    return 0;
}

static int memop(int kind, void *stream, uint64_t addr, uint32_t value, unsigned flags) {
    (void)stream;
    fake_last_ctx = current();
    fake_last_addr = addr;
    fake_last_value = value;
    fake_last_flags = flags;
    if (!current()) return 201;
    if (flags) return 1;  /* cuda_ipc uses the defaults: GEQ, and a write with a barrier */
    pthread_mutex_lock(&mu);
    uint32_t *word = 0;
    for (int i = 0; i < nregs; i++)
        if (addr >= regs[i].host + DEV_OFFSET && addr + 4 <= regs[i].host + DEV_OFFSET + regs[i].size)
            word = (uint32_t *)(uintptr_t)(addr - DEV_OFFSET);
    if (!word) { pthread_mutex_unlock(&mu); return 1; }
    if (!worker_started) {
        pthread_create(&worker, 0, run_ops, 0);
        pthread_detach(worker);
        worker_started = 1;
    }
    ops[op_tail % MAX_OPS].kind = kind;
    ops[op_tail % MAX_OPS].word = word;
    ops[op_tail % MAX_OPS].value = value;
    op_tail++;
    fake_memops++;
    pthread_cond_signal(&cv);
    pthread_mutex_unlock(&mu);
    return 0;
}

int cuStreamWriteValue32_v2(void *stream, uint64_t addr, uint32_t value, unsigned flags) {
    return memop(0, stream, addr, value, flags);
}

int cuStreamWaitValue32_v2(void *stream, uint64_t addr, uint32_t value, unsigned flags) {
    return memop(1, stream, addr, value, flags);
}
