/* Cuvil x86-64 runtime: the public C ABI of an artifact, its validation and its thread pool.
 *
 * Static source, shipped in the package and compiled into every lib<name>.so together with the
 * generated model.c (the model descriptor <prefix>__model), kernels.o and weights.S:
 *
 *   cc -O2 -fPIC -fvisibility=hidden -DCUVIL_PREFIX=<prefix> -shared ... -lm -lpthread
 *
 * Only the CUVIL_API(...) functions are exported (default visibility, named <prefix>_<name>); every
 * other symbol is static or hidden, so several artifacts load into one process without clashes. Exported
 * functions never call each other (no interposable internal calls). Uses libc/libpthread only.
 *
 * See cuvil_runtime.h for the bufs/step contract with the kernels.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE 1
#endif

#include "cuvil_runtime.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------------------------------------ */
/* Error codes (kept in sync with cuvil/targets/x86/header.py ERROR_CODES; a test checks it).        */

enum {
  CUVIL_OK = 0,
  CUVIL_ERR_NULL_SESSION = -1,
  CUVIL_ERR_NULL_INPUTS = -2,
  CUVIL_ERR_NULL_OUTPUTS = -3,
  CUVIL_ERR_NULL_DATA = -4,
  CUVIL_ERR_NULL_SHAPE = -5,
  CUVIL_ERR_DTYPE = -6,
  CUVIL_ERR_NDIM = -7,
  CUVIL_ERR_DIM = -8,
  CUVIL_ERR_ALIGN = -9,
  CUVIL_ERR_OVERLAP = -10,
  CUVIL_ERR_INDEX = -11,
  CUVIL_ERR_NULL_ARGUMENT = -12,
  CUVIL_ERR_BUSY = -13,
  CUVIL_ERR_NUM_THREADS = -14,
  CUVIL_ERR_NOMEM = -15,
  CUVIL_ERR_THREAD = -16,
  CUVIL_ERR_ABI = -17,
  CUVIL_ERR_UNSUPPORTED = -18,
  CUVIL_ERR_PROFILE = -19,
  CUVIL_ERR_BAD_SESSION = -20,
  CUVIL_ERR_WEIGHTS_UNBOUND = -21,
  CUVIL_ERR_WEIGHTS_MISMATCH = -22,
  CUVIL_ERR_ADAPTER_NAME = -23,
  CUVIL_ERR_ADAPTER_EXISTS = -24,
  CUVIL_ERR_LORA_RANK = -25,
  CUVIL_ERR_NO_LORA_SLOTS = -26,
};

static const char *const cuvil_messages[] = {
  "success",                                                        /*   0 */
  "session is NULL",                                                /*  -1 */
  "inputs array is NULL",                                           /*  -2 */
  "outputs array is NULL",                                          /*  -3 */
  "tensor data pointer is NULL",                                    /*  -4 */
  "tensor shape pointer is NULL while ndim > 0",                    /*  -5 */
  "tensor dtype does not match the model",                          /*  -6 */
  "tensor rank (ndim) does not match the model",                    /*  -7 */
  "tensor dimension does not match the model",                      /*  -8 */
  "tensor data is not aligned to its element size",                 /*  -9 */
  "an output buffer overlaps another input or output buffer",       /* -10 */
  "input/output index out of range",                                /* -11 */
  "a required pointer argument is NULL",                            /* -12 */
  "session is already running (sessions are single-threaded)",      /* -13 */
  "invalid number of threads",                                      /* -14 */
  "out of memory",                                                  /* -15 */
  "could not create a worker thread",                               /* -16 */
  "model descriptor has an unsupported ABI version",                /* -17 */
  "operation not supported by this artifact",                       /* -18 */
  "tensor dimension is outside the model's shape profile",          /* -19 */
  "not a live session of this library (destroyed, or never created by it)",  /* -20 */
  "the library's external weights are not bound (call bind_weights first)",  /* -21 */
  "the weights buffer does not match the library (size or SHA-256)",        /* -22 */
  "no adapter of that name is loaded",                              /* -23 */
  "an adapter of that name is already loaded",                      /* -24 */
  "the adapter's rank is above the library's LoRA slot rank",       /* -25 */
  "the library has no LoRA slots (compiled without --lora-slots)",  /* -26 */
};
#define CUVIL_NUM_MESSAGES ((int)(sizeof cuvil_messages / sizeof cuvil_messages[0]))

/* Thread-local detail of the last failing call on this thread. */
static __thread char cuvil_detail[512];

__attribute__((format(printf, 2, 3)))
static int fail(int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cuvil_detail, sizeof cuvil_detail, fmt, ap);
  va_end(ap);
  return code;
}

/* ------------------------------------------------------------------------------------------------ */
/* dtypes                                                                                           */

static const char *dtype_name(int32_t code) {
  static const char *const names[] = {
    "undefined", "float", "uint8", "int8", "uint16", "int16", "int32", "int64", "string", "bool",
    "float16", "double", "uint32", "uint64", "complex64", "complex128", "bfloat16", "float8e4m3fn",
    "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz", "uint4", "int4", "float4e2m1", "float8e8m0", "uint2", "int2",
  };
  if (code >= 0 && code < (int32_t)(sizeof names / sizeof names[0])) return names[code];
  return "unknown";
}

static int64_t dtype_size(int32_t code) {
  switch (code) {
    case 2: case 3: case 9: return 1;                 /* uint8 int8 bool */
    case 17: case 18: case 19: case 20: case 24: return 1;  /* float8 formats (bit patterns) */
    case 21: case 22: case 23: case 25: case 26: return 1;  /* 4- and 2-bit types: one per byte, low bits */
    case 4: case 5: case 10: case 16: return 2;       /* uint16 int16 float16 bfloat16 */
    case 1: case 6: case 12: return 4;                /* float int32 uint32 */
    case 7: case 11: case 13: case 14: return 8;      /* int64 double uint64 complex64 */
    case 15: return 16;                               /* complex128 */
    default: return 0;
  }
}

/* Required alignment of data: the element size (a complex number: the size of one component). */
static uintptr_t dtype_align(int32_t code) {
  int64_t n = dtype_size(code);
  if (code == 14 || code == 15) n /= 2;
  return n > 0 ? (uintptr_t)n : 1;
}

/* ------------------------------------------------------------------------------------------------ */
/* Thread pool                                                                                      */

#define CUVIL_CACHELINE 64
#define CUVIL_WORKER_SPINS (1 << 16)   /* pause iterations before a worker sleeps (~1-2 ms) */
#define CUVIL_MASTER_SPINS (1 << 12)   /* pause iterations before the caller starts yielding */

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#else
  __asm__ __volatile__("" ::: "memory");
#endif
}

struct cuvil_session;

/* The unclaimed chunks [lo, hi) of one thread's share of a step: (step << 32) | (lo << 16) | hi. The owner
 * claims from lo, other threads (stealing) from hi, both by CAS, so each chunk runs once. */
typedef struct {
  _Alignas(CUVIL_CACHELINE) _Atomic uint64_t w;
} chunk_range;

#define CUVIL_MAX_CHUNKS 0xFFFF

typedef struct {
  struct cuvil_session *s;
  int id;                                             /* 1 .. num_threads-1 */
} worker_arg;

struct cuvil_session {
  /* written by the caller before each generation, read by workers after acquiring gen */
  cuvil_kernel_fn fn;
  int64_t extent, grain, nunits;
  int nchunks;
  uint32_t steps;                                     /* steps handed to workers so far (names a step) */
  atomic_int stop;                                    /* set before the last gen bump: workers exit */
  int num_threads;
  void **bufs;                                        /* the buffer table: [nbufs] per thread, thread-major */
  size_t nbufs;                                       /* 4 + inputs + outputs (then scratch, symbol values) */
  int64_t *symv;                                      /* the run's symbol values (num_symbols), then the run-time
                                                       * ones as last evaluated (num_symbols more), or NULL */
  int64_t *evals;                                     /* sizes evaluated from them (num_evaluated), or NULL */
  void *arena;
  size_t arena_mapped;                                /* > 0: a symbolic model's arena, its own mapping */
  void *mem;                                          /* one mapping: a static model's arena, then each */
  size_t mem_bytes;                                   /* thread's scratch region (pre-faulted: prefault) */
  _Alignas(CUVIL_CACHELINE) atomic_int prefault_next; /* parts of mem claimed for pre-faulting */
  atomic_int prefault_done;                           /* parts pre-faulted */
  int64_t *profile;                                   /* per-step nanoseconds accumulated by runs, or NULL */
  const void *weights, *opt_weights;                  /* the model's (embedded or bound when created) */
  struct lora_adapter *adapter;                       /* the active LoRA adapter (a reference), or NULL */

  _Alignas(CUVIL_CACHELINE) atomic_uint gen;          /* bumped (seq_cst) to wake workers for a step */
  chunk_range *ranges;                                /* [num_threads]: each thread's chunks of the open step */
  _Alignas(CUVIL_CACHELINE) atomic_int done;          /* chunks of the current step finished */
  _Alignas(CUVIL_CACHELINE) atomic_int sleepers;      /* workers blocked on cv */

  pthread_mutex_t mu;
  pthread_cond_t cv;
  int num_workers;                                    /* workers actually started */
  int pin;                                            /* pin workers to CPUs (see place_workers) */
  int caller_cpu;                                     /* the caller's CPU when the workers were placed */
  int *worker_cpu;                                    /* each worker's CPU (-1: not pinned yet) */
  pthread_t *threads;
  worker_arg *args;
};

/* Chunk t of nchunks: units [t*q + min(t, r), ...) with q, r = divmod(nunits, nchunks); the last ends at
 * extent. It runs with the buffer table of thread `tid` (its own scratch), whichever chunk it is. */
static void run_chunk(struct cuvil_session *s, int t, int tid) {
  int64_t q = s->nunits / s->nchunks, r = s->nunits % s->nchunks;
  int64_t lo = (t * q + (t < r ? t : r)) * s->grain;
  int64_t hi = (t == s->nchunks - 1) ? s->extent : ((t + 1) * q + (t + 1 < r ? t + 1 : r)) * s->grain;
  s->fn(s->bufs + (size_t)tid * s->nbufs, lo, hi);
}

/* One chunk of thread u's share, its first (own: the owner claims in order) or its last (stolen); -1 when
 * none is left. A claim is a CAS on the share's word, whose high half names the step: a claim loaded in an
 * earlier step fails. Every chunk of a step is claimed and finished before the caller writes the next step's
 * fields, so a successful claim always reads the fields of its step. */
static int take_chunk(struct cuvil_session *s, int u, int own) {
  _Atomic uint64_t *w = &s->ranges[u].w;
  uint64_t v = atomic_load_explicit(w, memory_order_acquire);
  for (;;) {
    uint32_t lo = (uint32_t)(v >> 16) & 0xFFFFu, hi = (uint32_t)v & 0xFFFFu;
    if (lo >= hi) return -1;
    uint64_t nv = own ? v + (1u << 16) : v - 1;
    if (atomic_compare_exchange_weak_explicit(w, &v, nv, memory_order_acq_rel, memory_order_acquire))
      return (int)(own ? lo : hi - 1);
  }
}

/* Run chunks of the open step until none is left: thread tid's own share first, in order, then the others'
 * from their ends. Thread t's share is the t-th contiguous part of the step's range, so consecutive steps
 * cut the same way (the panels of one layer and the next, a producer's channels and a transform's) find
 * what this core wrote in its own cache (a read from the other core's L2 ran at 36-122 GB/s against ~130
 * locally on the 2-core VM, depending on where the host placed the vCPUs: bench/cross_core.c; ResNet-50's
 * Winograd transforms 3-7% and SqueezeNet 2-8% faster at 2 threads than with chunks claimed in one global
 * order). Nothing waits for a thread either: a worker that the OS has not scheduled yet
 * (another process holds its core) never holds up the step, the others run its share. */
static void claim_chunks(struct cuvil_session *s, int tid) {
  for (int k = 0; k < s->num_threads; ++k) {          /* k = 0: its own share, in order; then the others' */
    int u = (tid + k) % s->num_threads, c;
    while ((c = take_chunk(s, u, k == 0)) >= 0) {
      run_chunk(s, c, tid);
      atomic_fetch_add_explicit(&s->done, 1, memory_order_release);
    }
  }
}

/* Pin the workers to the CPUs of the caller's affinity mask other than the one the caller runs on now, one
 * each, in order (workers beyond those CPUs stay unpinned); at a session's first run and again at a run
 * whose caller has moved to another CPU (the caller's thread is the application's: it is never pinned). Unpinned, a worker woken after the process
 * idled (~100 ms here) was often placed on the caller's own CPU and the two then took turns: 2-thread runs
 * after a pause were no faster than 1-thread ones (SqueezeNet 13-15 ms vs 7.5-9.6 ms pinned:
 * `python3 bench/pause_effect.py squeezenet`, with and without CUVIL_PIN_THREADS=0; docs/c-abi.md
 * "Threads"); pinned once at start-up, the caller itself was sometimes woken on the worker's CPU after a
 * pause, with the same effect (ShuffleNet at 2 threads, p99 5.4 -> 1.65 ms: `python3 bench/ab_libs.py` on
 * the libraries built before and after). */
static void place_workers(struct cuvil_session *s) {
  if (!s->pin || s->num_workers == 0) return;
  int me = sched_getcpu();
  if (me == s->caller_cpu) return;
  cpu_set_t allowed, one;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0 || CPU_COUNT(&allowed) < 2) return;
  s->caller_cpu = me;
  int k = 0;
  for (int cpu = 0; cpu < CPU_SETSIZE && k < s->num_workers; ++cpu) {
    if (!CPU_ISSET(cpu, &allowed) || cpu == me) continue;
    if (s->worker_cpu[k] != cpu) {
      CPU_ZERO(&one);
      CPU_SET(cpu, &one);
      if (pthread_setaffinity_np(s->threads[k], sizeof one, &one) == 0) s->worker_cpu[k] = cpu;  /* best effort */
    }
    ++k;
  }
}

/* Pre-fault the session's memory (zeroed anonymous pages) in CUVIL_PREFAULT_PARTS parts per thread, each
 * thread taking parts in order until none is left: the caller once it has started the workers, each worker
 * as it starts. A page's first touch costs ~1.1 us on the 2-core VM (a fault, the kernel zeroing it);
 * MADV_POPULATE_WRITE takes the pages without a fault each, and the threads share the work. ResNet-50's
 * session create (7.7 MB of arena, 1.75 MB of scratch per thread), memset before: 3.8 ms at 1 thread, 4.5
 * at 2; now 2.7-3.0 and 2.7-4.3 (the worker starts late; bench/first_run.c prints it).
 * Nothing waits for a worker that has not started: the caller takes its parts. */
#define CUVIL_PREFAULT_PARTS 4
#define CUVIL_PAGE ((size_t)4096)
static void prefault(struct cuvil_session *s) {
  const size_t page = CUVIL_PAGE, pages = s->mem_bytes / page;
  const int parts = CUVIL_PREFAULT_PARTS * s->num_threads;
  int k;
  while ((k = atomic_fetch_add(&s->prefault_next, 1)) < parts) {
    size_t lo = pages * (size_t)k / (size_t)parts * page, hi = pages * (size_t)(k + 1) / (size_t)parts * page;
    if (hi > lo) {
      int done = 0;
#ifdef MADV_POPULATE_WRITE
      done = madvise((char *)s->mem + lo, hi - lo, MADV_POPULATE_WRITE) == 0;   /* Linux >= 5.14 */
#endif
      for (size_t off = lo; !done && off < hi; off += page) ((volatile char *)s->mem)[off] = 0;
    }
    atomic_fetch_add(&s->prefault_done, 1);
  }
}

/* The session's memory (arena and scratch) in transparent huge pages where it spans at least
 * CUVIL_HUGE_MIN_BYTES: a convolution at 56 x 56 reads its input as hundreds of channel rows ~6 KB apart, a
 * 4 KB page each, more pages than the first-level TLB holds. The mapping is then rounded up to whole 2 MB pages
 * and aligned to one (a larger reservation, its ends unmapped), and MADV_HUGEPAGE asks for them before the
 * prefault touches it (Linux's default THP mode, "madvise", gives them only on request). The resident memory
 * grows by less than one huge page (a symbolic model's reserved arena, MAP_NORESERVE, by less than one per
 * region its shapes touch). CUVIL_HUGE_PAGES=0 in the environment keeps 4 KB pages; a kernel without
 * THP ignores the request. *bytes is updated to the mapping's length. */
#define CUVIL_HUGE_PAGE ((size_t)2 << 20)
#define CUVIL_HUGE_MIN_BYTES ((size_t)4 << 20)
/* The embedded weights in 2 MB folios of the page cache, whichever way their pages got there. They are part of
 * the library file, mapped by the dynamic loader; the kernels stream them (a decode step reads all of GPT-2's
 * 500 MB once per token). A page-cache page of the file that the kernel holds in a 2 MB folio is mapped whole by
 * one page-table entry (write_library, link.py, writes the compiled library 2 MiB at a time for that). But a
 * page read back after the file left the cache (memory pressure, a reboot, a copy by another tool) comes in
 * readahead-sized folios and is mapped 4 KB a page-table entry, unless the mapping asked for huge pages before
 * the fault: then the kernel reads 2 MB folios (a kernel with transparent huge pages, on a file system that
 * caches large folios: xfs, ext4 since Linux 6.16). GPT-2's decode step on a 2-core Zen 4, its library evicted
 * and read back by the first run: 916 of 951 MB mapped in 2 MB pages with the request, 220 MB without
 * (/proc/PID/smaps FilePmdMapped; bench/weights_pages.py). Only whole 2 MB pages inside [p, p + n) are advised;
 * one is mapped whole where the mapping's addresses are congruent to its file offsets modulo 2 MB (the kernel
 * places a large file mapping on a 2 MB boundary, and the library's read-only segments keep addresses equal to
 * file offsets). Limits: pages read before the first session, as a read() of the file (the audit log's digest,
 * the artifact cache's check), are cached in small folios first and stay so on this kernel (one built with
 * READ_ONLY_THP_FOR_FS may collapse them later); a sparsely read table (an embedding looked up a few rows at a
 * time) becomes resident 2 MB per row touched, as in a freshly written library. A kernel without THP refuses
 * the request; CUVIL_HUGE_PAGES=0 in the environment leaves the mapping alone. Once per process (the caller
 * holds weights_mu): the request takes the address space's lock for writing. */
static void advise_weights(const void *p, int64_t n) {
#ifdef MADV_HUGEPAGE
  const char *env = getenv("CUVIL_HUGE_PAGES");
  if (p == NULL || n < (int64_t)CUVIL_HUGE_PAGE || (env && *env == '0')) return;
  uintptr_t lo = ((uintptr_t)p + CUVIL_HUGE_PAGE - 1) & ~(uintptr_t)(CUVIL_HUGE_PAGE - 1);
  uintptr_t hi = ((uintptr_t)p + (uintptr_t)n) & ~(uintptr_t)(CUVIL_HUGE_PAGE - 1);
  if (hi > lo) madvise((void *)lo, hi - lo, MADV_HUGEPAGE);   /* a hint: refused, nothing changes */
#else
  (void)p, (void)n;
#endif
}

static void *map_session_memory(size_t *bytes, int more_flags) {
  const int prot = PROT_READ | PROT_WRITE, flags = MAP_PRIVATE | MAP_ANONYMOUS | more_flags;
#ifdef MADV_HUGEPAGE
  const char *env = getenv("CUVIL_HUGE_PAGES");
  if (*bytes >= CUVIL_HUGE_MIN_BYTES && *bytes <= SIZE_MAX - 2 * CUVIL_HUGE_PAGE && !(env && *env == '0')) {
    size_t len = (*bytes + CUVIL_HUGE_PAGE - 1) & ~(CUVIL_HUGE_PAGE - 1);
    char *r = (char *)mmap(NULL, len + CUVIL_HUGE_PAGE, prot, flags, -1, 0);
    if (r != (char *)MAP_FAILED) {
      char *a = (char *)(((uintptr_t)r + CUVIL_HUGE_PAGE - 1) & ~(uintptr_t)(CUVIL_HUGE_PAGE - 1));
      if (a > r) munmap(r, (size_t)(a - r));                        /* the head before the aligned start */
      munmap(a + len, CUVIL_HUGE_PAGE - (size_t)(a - r));           /* the tail: never empty, a - r < 2 MB */
      madvise(a, len, MADV_HUGEPAGE);      /* a hint: refused, the pages stay 4 KB */
      *bytes = len;
      return a;
    }
  }
#endif
  return mmap(NULL, *bytes, prot, flags, -1, 0);
}

static void *worker_main(void *p) {
  worker_arg *a = (worker_arg *)p;
  struct cuvil_session *s = a->s;
  const int id = a->id;
  unsigned seen = 0;                                  /* gen at creation: a late starter must not skip a step */
  prefault(s);
  for (;;) {
    unsigned g;
    int spins = 0;
    while ((g = atomic_load_explicit(&s->gen, memory_order_acquire)) == seen && spins < CUVIL_WORKER_SPINS) {
      cpu_relax();
      ++spins;
    }
    if (g == seen) {
      pthread_mutex_lock(&s->mu);
      atomic_fetch_add(&s->sleepers, 1);              /* seq_cst: pairs with the caller's gen store */
      while ((g = atomic_load(&s->gen)) == seen) pthread_cond_wait(&s->cv, &s->mu);
      atomic_fetch_sub(&s->sleepers, 1);
      pthread_mutex_unlock(&s->mu);
    }
    seen = g;
    if (atomic_load_explicit(&s->stop, memory_order_acquire)) break;
    claim_chunks(s, id);
  }
  return NULL;
}

/* Open the step whose fields were just written, and wake the workers. */
static void publish(struct cuvil_session *s, uint32_t step) {
  atomic_store_explicit(&s->done, 0, memory_order_relaxed);
  int T = s->num_threads, n = s->nchunks;
  for (int t = 0; t < T; ++t) {
    uint64_t lo = (uint64_t)((int64_t)t * n / T), hi = (uint64_t)((int64_t)(t + 1) * n / T);
    atomic_store_explicit(&s->ranges[t].w, ((uint64_t)step << 32) | (lo << 16) | hi, memory_order_release);
  }
  atomic_fetch_add(&s->gen, 1u);                      /* seq_cst: pairs with a sleeper's check */
  if (atomic_load(&s->sleepers) > 0) {
    pthread_mutex_lock(&s->mu);
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
  }
}

/* Wait for chunks other threads claimed and are still running. */
static void finish_step(struct cuvil_session *s) {
  int spins = 0;
  while (atomic_load_explicit(&s->done, memory_order_acquire) != s->nchunks) {
    if (spins < CUVIL_MASTER_SPINS) {
      cpu_relax();
      ++spins;
    } else {
      sched_yield();
    }
  }
}

static void run_step(struct cuvil_session *s, const cuvil_step *st, int64_t extent) {
  if (extent <= 0) return;
  int64_t grain = st->grain > 0 ? st->grain : 1;
  int64_t nunits = extent / grain;
  int64_t n = nunits < 1 ? 1 : nunits;
  int64_t cap = (int64_t)s->num_threads * (st->split > 0 ? st->split : 1);
  if (n > cap) n = cap;
  if (n > CUVIL_MAX_CHUNKS) n = CUVIL_MAX_CHUNKS;
  if (n <= 1 || s->num_workers == 0) {
    st->fn(s->bufs, 0, extent);
    return;
  }
  uint32_t step = ++s->steps;                         /* every share is empty: the fields are ours */
  s->fn = st->fn;
  s->extent = extent;
  s->grain = grain;
  s->nunits = nunits;
  s->nchunks = (int)n;
  publish(s, step);
  claim_chunks(s, 0);
  finish_step(s);
}

static void stop_workers(struct cuvil_session *s) {
  if (s->num_workers == 0) return;
  atomic_store_explicit(&s->stop, 1, memory_order_release);
  s->nchunks = 0;
  atomic_fetch_add(&s->gen, 1u);
  pthread_mutex_lock(&s->mu);
  pthread_cond_broadcast(&s->cv);
  pthread_mutex_unlock(&s->mu);
  for (int i = 0; i < s->num_workers; ++i) pthread_join(s->threads[i], NULL);
  s->num_workers = 0;
}

static int online_cores(void) {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) {
    int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

static void adapter_release(struct lora_adapter *a);

static void free_session(struct cuvil_session *s) {
  stop_workers(s);
  adapter_release(s->adapter);
  pthread_cond_destroy(&s->cv);
  pthread_mutex_destroy(&s->mu);
  free(s->threads);
  free(s->worker_cpu);
  free(s->args);
  free(s->bufs);
  free(s->ranges);
  if (s->arena_mapped) munmap(s->arena, s->arena_mapped);
  if (s->mem) munmap(s->mem, s->mem_bytes);
  free(s->symv);
  free(s->evals);
  free(s);
}

/* ------------------------------------------------------------------------------------------------ */
/* LoRA adapters (a library compiled with --lora-slots)                                             */

/* A loaded adapter: per slot k, A_pad [in, rank] (= A^T, zero-padded) and B_pad [rank, out] (= scale * B^T,
 * zero-padded) in one allocation, or NULL where the adapter leaves slot k alone. Adapters belong to the
 * library (every session may activate one); refs counts the registry's reference (while the name is loaded)
 * and each session's that has it active, so an adapter unloaded while sessions use it lives until the last
 * one switches away or is destroyed: a run never reads freed memory. */
struct lora_adapter {
  char *name;
  int64_t refs;
  float **a, **b;
  void *mem;
  size_t bytes;
  struct lora_adapter *next;
};

static struct lora_adapter *adapters;                 /* the loaded ones, by name */
static pthread_mutex_t adapters_mu = PTHREAD_MUTEX_INITIALIZER;
static const uint8_t lora_on = 1, lora_off = 0;       /* the slots' guard flags point at one of these */

static void adapter_free(struct lora_adapter *a) {
  free(a->name);
  free(a->a);
  free(a->b);
  free(a->mem);
  free(a);
}

/* Drops one reference (under adapters_mu or not: takes it). */
static void adapter_release(struct lora_adapter *a) {
  if (a == NULL) return;
  pthread_mutex_lock(&adapters_mu);
  int last = --a->refs == 0;
  pthread_mutex_unlock(&adapters_mu);
  if (last) adapter_free(a);
}

static struct lora_adapter *adapter_find(const char *name) {
  for (struct lora_adapter *a = adapters; a != NULL; a = a->next)
    if (strcmp(a->name, name) == 0) return a;
  return NULL;
}

/* Points every thread's slot buffers at adapter a's tensors (NULL: every slot off, the base model). */
static void lora_point(struct cuvil_session *s, const struct lora_adapter *a) {
  const cuvil_model *m = &CUVIL_MODEL;
  const size_t first = 4 + (size_t)m->num_inputs + (size_t)m->num_outputs;
  for (int t = 0; t < s->num_threads; ++t) {
    void **bufs = s->bufs + (size_t)t * s->nbufs + first;
    for (int k = 0; k < m->num_lora_slots; ++k) {
      int on = a != NULL && a->a[k] != NULL;
      bufs[3 * k] = on ? (void *)a->a[k] : NULL;
      bufs[3 * k + 1] = on ? (void *)a->b[k] : NULL;
      bufs[3 * k + 2] = (void *)(on ? &lora_on : &lora_off);
    }
  }
}

/* Checks entry e of an adapter_load call against slot k: its rank, or a negative code. */
static int64_t check_lora_pair(const cuvil_lora_slot *slot, int e, int k, const cuvil_tensor *A, const cuvil_tensor *B,
                               float scale) {
  const cuvil_tensor *ts[2] = {A, B};
  const char *which[2] = {"A", "B"};
  for (int q = 0; q < 2; ++q) {
    const cuvil_tensor *t = ts[q];
    if (t->dtype != 1)
      return fail(CUVIL_ERR_DTYPE, "adapter_load: entry %d (slot %d '%s'): %s is %s, expected float", e, k,
                  slot->module, which[q], dtype_name(t->dtype));
    if (t->ndim != 2)
      return fail(CUVIL_ERR_NDIM, "adapter_load: entry %d (slot %d '%s'): %s has %d dims, expected 2", e, k,
                  slot->module, which[q], (int)t->ndim);
    if (t->shape == NULL) return fail(CUVIL_ERR_NULL_SHAPE, "adapter_load: entry %d: %s's shape is NULL", e, which[q]);
  }
  int64_t r = A->shape[0];
  if (A->shape[1] != slot->in || B->shape[0] != slot->out || B->shape[1] != r || r < 1)
    return fail(CUVIL_ERR_DIM, "adapter_load: entry %d (slot %d '%s'): A is [%lld, %lld] and B [%lld, %lld], expected "
                "A [r, %lld] and B [%lld, r] with 1 <= r <= %lld", e, k, slot->module, (long long)A->shape[0],
                (long long)A->shape[1], (long long)B->shape[0], (long long)B->shape[1], (long long)slot->in,
                (long long)slot->out, (long long)slot->rank);
  if (r > slot->rank)
    return fail(CUVIL_ERR_LORA_RANK, "adapter_load: entry %d (slot %d '%s'): rank %lld is above the library's slot "
                "rank %lld: recompile the model with --lora-slots %lld (or more)", e, k, slot->module, (long long)r,
                (long long)slot->rank, (long long)r);
  if (A->data == NULL || B->data == NULL)
    return fail(CUVIL_ERR_NULL_DATA, "adapter_load: entry %d (slot %d '%s'): %s's data is NULL", e, k, slot->module,
                A->data == NULL ? "A" : "B");
  if (((uintptr_t)A->data | (uintptr_t)B->data) % 4 != 0)
    return fail(CUVIL_ERR_ALIGN, "adapter_load: entry %d: A or B is not aligned to 4 bytes", e);
  if (!(scale - scale == 0.0f))
    return fail(CUVIL_ERR_DIM, "adapter_load: entry %d (slot %d '%s'): the scale is not finite", e, k, slot->module);
  return r;
}

#define CUVIL_MAX_THREADS 4096

static struct cuvil_session *session_create(int num_threads, const void *weights, const void *opt_weights) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (m->abi_version != CUVIL_ABI_VERSION) {
    fail(CUVIL_ERR_ABI, "model abi_version %d, runtime expects %d", (int)m->abi_version, CUVIL_ABI_VERSION);
    return NULL;
  }
  const char *missing = CUVIL_MISSING_ISA();
  if (missing != NULL) {
    fail(CUVIL_ERR_UNSUPPORTED, "this CPU lacks %s, which the library's kernels were compiled for: recompile the "
         "model on this machine (cuvil compile MODEL -o OUT --cpu native) or with --cpu x86-64-v3", missing);
    return NULL;
  }
  if (num_threads < 0 || num_threads > CUVIL_MAX_THREADS) {
    fail(CUVIL_ERR_NUM_THREADS, "num_threads is %d, expected 0 (all cores) to %d", num_threads, CUVIL_MAX_THREADS);
    return NULL;
  }
  if (num_threads == 0) num_threads = online_cores();

  struct cuvil_session *s;
  if (posix_memalign((void **)&s, CUVIL_CACHELINE, sizeof *s) != 0) {
    fail(CUVIL_ERR_NOMEM, "could not allocate a session (%zu bytes)", sizeof *s);
    return NULL;
  }
  memset(s, 0, sizeof *s);
  atomic_init(&s->gen, 0u);
  atomic_init(&s->done, 0);
  atomic_init(&s->sleepers, 0);
  atomic_init(&s->stop, 0);
  atomic_init(&s->prefault_next, 0);
  atomic_init(&s->prefault_done, 0);
  s->num_threads = num_threads;
  s->weights = weights;
  s->opt_weights = opt_weights;
  pthread_mutex_init(&s->mu, NULL);
  pthread_cond_init(&s->cv, NULL);

  if (posix_memalign((void **)&s->ranges, CUVIL_CACHELINE, sizeof(chunk_range) * (size_t)num_threads) != 0) {
    s->ranges = NULL;
    fail(CUVIL_ERR_NOMEM, "could not allocate %d chunk ranges", num_threads);
    free_session(s);
    return NULL;
  }
  for (int t = 0; t < num_threads; ++t) atomic_init(&s->ranges[t].w, 0);   /* empty */

  const size_t fixed = 4 + (size_t)m->num_inputs + (size_t)m->num_outputs;   /* then the LoRA slots' buffers */
  size_t nbufs = fixed + 3 * (size_t)m->num_lora_slots;
  s->nbufs = nbufs;
  s->bufs = (void **)calloc(nbufs * (size_t)num_threads, sizeof(void *));
  if (m->num_symbols > 0) {
    s->symv = (int64_t *)calloc((size_t)m->num_symbols * 2, sizeof(int64_t));
    s->evals = (int64_t *)calloc((size_t)(m->num_evaluated > 0 ? m->num_evaluated : 1), sizeof(int64_t));
  }
  if (!s->bufs || (m->num_symbols > 0 && (!s->symv || !s->evals))) {
    fail(CUVIL_ERR_NOMEM, "could not allocate the buffer table");
    free_session(s);
    return NULL;
  }
  for (int t = 0; t < num_threads; ++t) s->bufs[(size_t)t * nbufs + fixed - 1] = s->symv;
  lora_point(s, NULL);                                /* the base model: every slot off */
  /* One mapping holds a static model's arena and then each thread's scratch, page-aligned; the pages are
   * zero (deterministic contents) and pre-faulted by prefault() below, so a first run takes no page faults
   * on them. A symbolic model's arena is planned for the profile's maxima: it gets its own mapping, reserved
   * without committing memory (MAP_NORESERVE), whose pages fault in as the shapes actually run touch them. */
  const size_t page = CUVIL_PAGE;
  size_t arena_bytes = (m->arena_bytes > 0 && m->num_symbols == 0) ? ((size_t)m->arena_bytes + page - 1) & ~(page - 1) : 0;
  size_t stride = m->scratch_bytes > 0 ? ((size_t)m->scratch_bytes + page - 1) & ~(page - 1) : 0;
  if (stride > 0 && (size_t)num_threads > (SIZE_MAX - arena_bytes) / stride) {
    fail(CUVIL_ERR_NOMEM, "session memory for %d threads overflows the address space (arena %zu, %zu scratch each); "
         "create the session with fewer threads", num_threads, arena_bytes, stride);
    free_session(s);
    return NULL;
  }
  if (arena_bytes + stride > 0) {
    s->mem_bytes = arena_bytes + stride * (size_t)num_threads;
    void *p = map_session_memory(&s->mem_bytes, 0);
    if (p == MAP_FAILED) {
      fail(CUVIL_ERR_NOMEM, "could not allocate %zu bytes of session memory (arena %zu, %d x %zu scratch): %s",
           s->mem_bytes, arena_bytes, num_threads, stride, strerror(errno));
      free_session(s);
      return NULL;
    }
    s->mem = p;
    if (arena_bytes > 0) s->arena = p;
    for (int t = 0; stride > 0 && t < num_threads; ++t)
      s->bufs[(size_t)t * nbufs + fixed - 2] = (char *)p + arena_bytes + (size_t)t * stride;
  }
  if (m->arena_bytes > 0 && m->num_symbols > 0) {
    size_t reserved = (size_t)m->arena_bytes;
    void *p = map_session_memory(&reserved, MAP_NORESERVE);
    if (p == MAP_FAILED) {
      fail(CUVIL_ERR_NOMEM, "could not reserve the arena (%lld bytes, planned for the profile's maxima): %s",
           (long long)m->arena_bytes, strerror(errno));
      free_session(s);
      return NULL;
    }
    s->arena = p;
    s->arena_mapped = reserved;
  }
  for (int t = 0; t < num_threads; ++t) s->bufs[(size_t)t * nbufs + 1] = (void *)s->weights;
  for (int t = 0; t < num_threads; ++t) s->bufs[(size_t)t * nbufs] = s->arena;

  if (num_threads > 1) {
    int nw = num_threads - 1;
    /* Pinned when the session uses every CPU the process may run on (nothing else of ours competes for
     * them); CUVIL_PIN_THREADS=0 never pins, =1 always does. */
    const char *pin = getenv("CUVIL_PIN_THREADS");
    s->pin = pin && *pin ? (*pin != '0') : (num_threads >= online_cores());
    s->threads = (pthread_t *)calloc((size_t)nw, sizeof(pthread_t));
    s->args = (worker_arg *)calloc((size_t)nw, sizeof(worker_arg));
    s->worker_cpu = (int *)malloc((size_t)nw * sizeof(int));
    s->caller_cpu = -2;                               /* never a CPU: the first placement always runs */
    if (s->worker_cpu)
      for (int i = 0; i < nw; ++i) s->worker_cpu[i] = -1;
    if (!s->threads || !s->args || !s->worker_cpu) {
      fail(CUVIL_ERR_NOMEM, "could not allocate %d worker descriptors", nw);
      free_session(s);
      return NULL;
    }
    /* Workers block all signals: signals keep going to the application's own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int err = 0;
    for (int i = 0; i < nw; ++i) {
      s->args[i].s = s;
      s->args[i].id = i + 1;
      err = pthread_create(&s->threads[i], NULL, worker_main, &s->args[i]);
      if (err != 0) break;
      s->num_workers = i + 1;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (err != 0) {
      fail(CUVIL_ERR_THREAD, "pthread_create failed for worker %d of %d: %s", s->num_workers + 1, nw, strerror(err));
      free_session(s);
      return NULL;
    }
  }
  prefault(s);
  while (atomic_load(&s->prefault_done) < CUVIL_PREFAULT_PARTS * num_threads) sched_yield();  /* workers' parts */
  return s;
}

/* ------------------------------------------------------------------------------------------------ */
/* External weights: the buffer bind_weights accepted, checked against the SHA-256 the library embeds    */

static pthread_mutex_t weights_mu = PTHREAD_MUTEX_INITIALIZER;   /* bound_weights and live_sessions */
static int weights_advised;                                        /* advise_weights ran (under weights_mu) */
static const void *bound_weights;
static long live_sessions;

/* SHA-256 (FIPS 180-4) of the weights bind_weights is given: with the SHA extensions where the CPU has them
 * (cpuid; a few times faster), else in plain C. No library beyond libc: the runtime links libc, libm and
 * libpthread only. tests/test_external_weights.py compiles this section alone (from here to the next rule)
 * and checks both paths against hashlib. */
#include <cpuid.h>
#include <immintrin.h>

static const uint32_t sha256_k[64] = {
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

#define SHA_ROR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_blocks_c(uint32_t h[8], const uint8_t *p, size_t blocks) {
  for (; blocks > 0; --blocks, p += 64) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
      w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
      uint32_t s0 = SHA_ROR(w[i - 15], 7) ^ SHA_ROR(w[i - 15], 18) ^ (w[i - 15] >> 3);
      uint32_t s1 = SHA_ROR(w[i - 2], 17) ^ SHA_ROR(w[i - 2], 19) ^ (w[i - 2] >> 10);
      w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; ++i) {
      uint32_t t1 = k + (SHA_ROR(e, 6) ^ SHA_ROR(e, 11) ^ SHA_ROR(e, 25)) + ((e & f) ^ (~e & g)) + sha256_k[i] + w[i];
      uint32_t t2 = (SHA_ROR(a, 2) ^ SHA_ROR(a, 13) ^ SHA_ROR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
    }
    h[0] += a; h[1] += b; h[2] += c; h[3] += d; h[4] += e; h[5] += f; h[6] += g; h[7] += k;
  }
}

/* The SHA extensions: the state as ABEF/CDGH vectors, two rounds per sha256rnds2, the message schedule four
 * words at a time (W[j] = msg2(msg1(W[j-4], W[j-3]) + W[4j-7 .. 4j-4], W[j-1]), W[j] the words 4j .. 4j+3). */
__attribute__((target("sha,sse4.1,ssse3")))
static void sha256_blocks_ni(uint32_t h[8], const uint8_t *p, size_t blocks) {
  const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bULL, 0x0405060700010203ULL);
  __m128i tmp = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[0]), 0xB1);     /* CDAB */
  __m128i st1 = _mm_shuffle_epi32(_mm_loadu_si128((const __m128i *)&h[4]), 0x1B);     /* EFGH */
  __m128i st0 = _mm_alignr_epi8(tmp, st1, 8);                                          /* ABEF */
  st1 = _mm_blend_epi16(st1, tmp, 0xF0);                                               /* CDGH */
  for (; blocks > 0; --blocks, p += 64) {
    __m128i abef = st0, cdgh = st1, w[4];
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      __m128i m;
      if (j < 4) {
        m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(p + 16 * j)), bswap);
      } else {
        m = _mm_sha256msg1_epu32(w[j & 3], w[(j + 1) & 3]);
        m = _mm_add_epi32(m, _mm_alignr_epi8(w[(j + 3) & 3], w[(j + 2) & 3], 4));
        m = _mm_sha256msg2_epu32(m, w[(j + 3) & 3]);
      }
      w[j & 3] = m;
      __m128i wk = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)&sha256_k[4 * j]));
      st1 = _mm_sha256rnds2_epu32(st1, st0, wk);
      st0 = _mm_sha256rnds2_epu32(st0, st1, _mm_shuffle_epi32(wk, 0x0E));
    }
    st0 = _mm_add_epi32(st0, abef);
    st1 = _mm_add_epi32(st1, cdgh);
  }
  tmp = _mm_shuffle_epi32(st0, 0x1B);                                                  /* FEBA */
  st1 = _mm_shuffle_epi32(st1, 0xB1);                                                  /* DCHG */
  _mm_storeu_si128((__m128i *)&h[0], _mm_blend_epi16(tmp, st1, 0xF0));                 /* DCBA */
  _mm_storeu_si128((__m128i *)&h[4], _mm_alignr_epi8(st1, tmp, 8));                    /* HGFE */
}

/* 1 when the CPU has the SHA extensions, SSE4.1 and SSSE3; CUVIL_SHA256=portable takes the plain C path. */
static int sha256_has_ni(void) {
  const char *env = getenv("CUVIL_SHA256");
  if (env && strcmp(env, "portable") == 0) return 0;
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_1) || !(c & bit_SSSE3)) return 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 0;
  return (b & (1u << 29)) != 0;
}

static void sha256(const void *data, size_t n, uint8_t out[32]) {
  uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  void (*blocks)(uint32_t *, const uint8_t *, size_t) = sha256_has_ni() ? sha256_blocks_ni : sha256_blocks_c;
  const uint8_t *p = (const uint8_t *)data;
  blocks(h, p, n / 64);
  size_t left = n % 64;
  uint8_t tail[128] = {0};
  memcpy(tail, p + (n - left), left);
  tail[left] = 0x80;
  size_t end = left < 56 ? 64 : 128;
  uint64_t bits = (uint64_t)n * 8;
  for (int i = 0; i < 8; ++i) tail[end - 1 - i] = (uint8_t)(bits >> (8 * i));
  blocks(h, tail, end / 64);
  for (int i = 0; i < 8; ++i) {
    out[4 * i] = (uint8_t)(h[i] >> 24); out[4 * i + 1] = (uint8_t)(h[i] >> 16);
    out[4 * i + 2] = (uint8_t)(h[i] >> 8); out[4 * i + 3] = (uint8_t)h[i];
  }
}

/* ------------------------------------------------------------------------------------------------ */
/* Session handles                                                                                  */

/* A cuvil_session * handed to the caller is not the session's address but a handle, (gen << 32) | (slot + 1),
 * naming a slot of this library's registry and the generation the slot had when the session was created.
 * Every ABI call that takes a session validates the handle against the slot before touching the session, so
 * a destroyed session (the slot's generation has moved on, even if its slot or its memory were reused), a
 * double destroy, or a pointer this library never handed out gets CUVIL_ERR_BAD_SESSION instead of a read of
 * freed memory. A slot's state word holds (generation << 32) | state, and the calls that use a session move it
 * FREE -> IDLE (create), IDLE -> BUSY -> IDLE (run, output_shape, profile) and IDLE -> DYING -> FREE with the
 * next generation (destroy), each claim one CAS: the check, the single-thread guard (CUVIL_ERR_BUSY) and the claim of
 * the session are one atomic operation, as cheap as the busy flag they replace. Slots live in chunks that are
 * allocated once and never freed or moved, so reading a slot is always defined; each slot has its own cache
 * line, so sessions run by different threads do not share one. Generations start at a per-library random
 * value, so a handle of another Cuvil library loaded in the same process is rejected too (but for a 2^-32
 * chance); a slot's generation wraps after 2^32 sessions created in it. */
#define CUVIL_SLOTS_PER_CHUNK 256
#define CUVIL_MAX_CHUNKS_OF_SLOTS 1024                 /* 262,144 live sessions per library */
enum { SLOT_FREE = 0, SLOT_IDLE = 1, SLOT_BUSY = 2, SLOT_DYING = 3 };

typedef struct {
  _Alignas(CUVIL_CACHELINE) _Atomic uint64_t word;   /* (generation << 32) | SLOT_* */
  struct cuvil_session *s;                            /* valid while the state is not FREE */
} session_slot;

static session_slot *_Atomic registry_chunks[CUVIL_MAX_CHUNKS_OF_SLOTS];
static pthread_mutex_t registry_mu = PTHREAD_MUTEX_INITIALIZER;   /* serialises slot allocation only */

static inline uint64_t slot_word(uint32_t gen, unsigned state) { return ((uint64_t)gen << 32) | state; }

static session_slot *slot_of(uintptr_t handle) {
  uint64_t idx = (uint64_t)(handle & 0xFFFFFFFFu);
  if (idx == 0) return NULL;
  idx -= 1;
  if (idx >= (uint64_t)CUVIL_SLOTS_PER_CHUNK * CUVIL_MAX_CHUNKS_OF_SLOTS) return NULL;
  session_slot *chunk = atomic_load_explicit(&registry_chunks[idx / CUVIL_SLOTS_PER_CHUNK], memory_order_acquire);
  return chunk ? &chunk[idx % CUVIL_SLOTS_PER_CHUNK] : NULL;
}

/* Claims the session of handle h for one call (IDLE -> BUSY): the session, or NULL with *rc set. */
static struct cuvil_session *session_claim(cuvil_session *h, const char *what, int *rc) {
  if (h == NULL) {
    *rc = fail(CUVIL_ERR_NULL_SESSION, "%s: session is NULL", what);
    return NULL;
  }
  uintptr_t handle = (uintptr_t)h;
  session_slot *slot = slot_of(handle);
  uint64_t idle = slot_word((uint32_t)(handle >> 32), SLOT_IDLE);
  uint64_t seen = idle;
  if (slot != NULL &&
      atomic_compare_exchange_strong_explicit(&slot->word, &seen, idle + (SLOT_BUSY - SLOT_IDLE),
                                              memory_order_acquire, memory_order_relaxed))
    return slot->s;
  if (slot != NULL && seen == idle + (SLOT_BUSY - SLOT_IDLE))
    *rc = fail(CUVIL_ERR_BUSY, "%s: session %p is in use by another thread", what, (void *)h);
  else
    *rc = fail(CUVIL_ERR_BAD_SESSION, "%s: %p is not a live session of this library (destroyed, or never created "
               "by it)", what, (void *)h);
  return NULL;
}

/* Ends the call that claimed handle h (BUSY -> IDLE). */
static void session_release(cuvil_session *h) {
  uintptr_t handle = (uintptr_t)h;
  atomic_store_explicit(&slot_of(handle)->word, slot_word((uint32_t)(handle >> 32), SLOT_IDLE), memory_order_release);
}

static uint32_t registry_seed(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  uint64_t x = (uint64_t)(uintptr_t)&registry_mu ^ ((uint64_t)t.tv_nsec << 20) ^ (uint64_t)t.tv_sec ^
               ((uint64_t)getpid() << 40);
  x ^= x >> 33;                                       /* splitmix64 finaliser */
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return (uint32_t)x;
}

/* Registers s in a free slot (IDLE): its handle, or NULL with the error recorded. */
static cuvil_session *session_register(struct cuvil_session *s) {
  pthread_mutex_lock(&registry_mu);
  for (int c = 0; c < CUVIL_MAX_CHUNKS_OF_SLOTS; ++c) {
    session_slot *chunk = atomic_load_explicit(&registry_chunks[c], memory_order_relaxed);
    if (chunk == NULL) {
      if (posix_memalign((void **)&chunk, CUVIL_CACHELINE, sizeof(session_slot) * CUVIL_SLOTS_PER_CHUNK) != 0) break;
      uint32_t seed = registry_seed();
      for (int k = 0; k < CUVIL_SLOTS_PER_CHUNK; ++k) {
        atomic_init(&chunk[k].word, slot_word(seed + 0x9E3779B9u * (uint32_t)k, SLOT_FREE));
        chunk[k].s = NULL;
      }
      atomic_store_explicit(&registry_chunks[c], chunk, memory_order_release);
    }
    for (int k = 0; k < CUVIL_SLOTS_PER_CHUNK; ++k) {
      uint64_t w = atomic_load_explicit(&chunk[k].word, memory_order_acquire);   /* after the destroy's read of s */
      if ((w & 0xFFFFFFFFu) != SLOT_FREE) continue;
      chunk[k].s = s;
      atomic_store_explicit(&chunk[k].word, slot_word((uint32_t)(w >> 32), SLOT_IDLE), memory_order_release);
      pthread_mutex_unlock(&registry_mu);
      uintptr_t idx = (uintptr_t)c * CUVIL_SLOTS_PER_CHUNK + (uintptr_t)k;
      return (cuvil_session *)(((uintptr_t)(w >> 32) << 32) | (idx + 1));
    }
  }
  pthread_mutex_unlock(&registry_mu);
  fail(CUVIL_ERR_NOMEM, "could not register the session: %d sessions of this library are live",
       CUVIL_SLOTS_PER_CHUNK * CUVIL_MAX_CHUNKS_OF_SLOTS);
  return NULL;
}

/* Unregisters handle h (non-NULL), waiting for a call in progress on another thread to end: the session, or
 * NULL with the error recorded (a stale or foreign handle, or a destroy already under way). Two steps: IDLE ->
 * DYING claims the slot (a racing run then gets CUVIL_ERR_BAD_SESSION, a racing destroy the same), the session
 * pointer is read while the slot is still ours, and only then the release store of FREE with the next
 * generation hands the slot to session_register. Reading the pointer after FREE was published would race
 * with a create reusing the slot: the destroy could free the new session (ThreadSanitizer showed the race). */
static struct cuvil_session *session_unregister(cuvil_session *h) {
  uintptr_t handle = (uintptr_t)h;
  session_slot *slot = slot_of(handle);
  uint32_t gen = (uint32_t)(handle >> 32);
  for (;;) {
    uint64_t seen = slot_word(gen, SLOT_IDLE);
    if (slot != NULL && atomic_compare_exchange_strong_explicit(&slot->word, &seen, slot_word(gen, SLOT_DYING),
                                                                memory_order_acquire, memory_order_relaxed)) {
      struct cuvil_session *s = slot->s;
      slot->s = NULL;
      atomic_store_explicit(&slot->word, slot_word(gen + 1, SLOT_FREE), memory_order_release);
      return s;
    }
    if (slot == NULL || seen != slot_word(gen, SLOT_BUSY)) {
      fail(CUVIL_ERR_BAD_SESSION, "session_destroy: %p is not a live session of this library (destroyed already, "
           "or never created by it); nothing was freed", (void *)h);
      return NULL;
    }
    sched_yield();                                    /* a call on another thread still uses it */
  }
}

/* ------------------------------------------------------------------------------------------------ */
/* Validation                                                                                       */

/* Checks one caller tensor against its descriptor; with check_data also its data pointer/alignment. A
 * symbolic dim is bound into sym (entries -1: not bound yet; checked against the symbol's profile and any
 * earlier binding) when the descriptor names its symbol, else required to equal expect[k] when expect is
 * given (outputs: the dims the inputs imply), else only required to be >= 0. */
static int check_tensor(const cuvil_model *m, const char *kind, int i, const cuvil_io_desc *d, const cuvil_tensor *t,
                        int check_data, int64_t *sym, const int64_t *expect, int64_t *bytes) {
  if (t->dtype != d->dtype)
    return fail(CUVIL_ERR_DTYPE, "%s %d '%s': dtype is %d (%s), expected %d (%s)", kind, i, d->name, (int)t->dtype,
                dtype_name(t->dtype), (int)d->dtype, dtype_name(d->dtype));
  if (t->ndim != d->ndim)
    return fail(CUVIL_ERR_NDIM, "%s %d '%s': ndim is %d, expected %d", kind, i, d->name, (int)t->ndim, (int)d->ndim);
  if (d->ndim > 0 && t->shape == NULL)
    return fail(CUVIL_ERR_NULL_SHAPE, "%s %d '%s': shape is NULL, expected %d dims", kind, i, d->name, (int)d->ndim);
  int64_t n = 1;
  for (int k = 0; k < d->ndim; ++k) {
    int64_t want = d->shape[k], got = t->shape[k];
    if (want >= 0 ? got != want : got < 0) {
      if (want >= 0)
        return fail(CUVIL_ERR_DIM, "%s %d '%s': dim %d is %lld, expected %lld", kind, i, d->name, k, (long long)got,
                    (long long)want);
      return fail(CUVIL_ERR_DIM, "%s %d '%s': dim %d is %lld, expected >= 0", kind, i, d->name, k, (long long)got);
    }
    if (want < 0 && expect != NULL && got != expect[k])
      return fail(CUVIL_ERR_DIM, "%s %d '%s': dim %d is %lld, expected %lld for these inputs", kind, i, d->name, k,
                  (long long)got, (long long)expect[k]);
    if (want < 0 && sym != NULL && d->dim_syms != NULL && d->dim_syms[k] >= 0) {
      const int32_t sk = d->dim_syms[k];
      const cuvil_symbol *y = &m->symbols[sk];
      if (got < y->min || got > y->max)
        return fail(CUVIL_ERR_PROFILE, "%s %d '%s': dim %d is %s = %lld, outside the profile %s in [%lld, %lld]", kind,
                    i, d->name, k, y->name, (long long)got, y->name, (long long)y->min, (long long)y->max);
      if (y->multiple > 1 && got % y->multiple != 0)
        return fail(CUVIL_ERR_PROFILE, "%s %d '%s': dim %d is %s = %lld, not a multiple of %lld (the profile %s in "
                    "[%lld, %lld], multiples of %lld)", kind, i, d->name, k, y->name, (long long)got,
                    (long long)y->multiple, y->name, (long long)y->min, (long long)y->max, (long long)y->multiple);
      if (sym[sk] >= 0 && sym[sk] != got)
        return fail(CUVIL_ERR_DIM, "%s %d '%s': dim %d is %s = %lld, but an earlier dim bound %s = %lld", kind, i,
                    d->name, k, y->name, (long long)got, y->name, (long long)sym[sk]);
      sym[sk] = got;
    }
    if (n != 0 && got > INT64_MAX / n / 16)
      return fail(CUVIL_ERR_DIM, "%s %d '%s': dim %d is %lld, total size overflows", kind, i, d->name, k,
                  (long long)got);
    n *= got;
  }
  int64_t esize = dtype_size(d->dtype);
  *bytes = n * esize;
  if (check_data) {
    if (t->data == NULL && *bytes != 0)
      return fail(CUVIL_ERR_NULL_DATA, "%s %d '%s': data is NULL", kind, i, d->name);
    uintptr_t align = dtype_align(d->dtype);
    if (((uintptr_t)t->data % align) != 0)
      return fail(CUVIL_ERR_ALIGN, "%s %d '%s': data %p is not aligned to %u bytes", kind, i, d->name, t->data,
                  (unsigned)align);
  }
  return CUVIL_OK;
}

/* Checks the inputs; for a symbolic model binds sym[num_symbols] from them and evaluates every symbolic
 * size into evals[num_evaluated]. */
static int check_inputs(const cuvil_model *m, const cuvil_tensor *inputs, int check_data, int64_t *sym,
                        int64_t *evals) {
  if (m->num_inputs > 0 && inputs == NULL)
    return fail(CUVIL_ERR_NULL_INPUTS, "inputs is NULL, the model has %d input(s)", (int)m->num_inputs);
  int64_t bytes;
  for (int k = 0; k < m->num_symbols; ++k) sym[k] = -1;
  for (int i = 0; i < m->num_inputs; ++i) {
    int rc = check_tensor(m, "input", i, &m->inputs[i], &inputs[i], check_data, sym, NULL, &bytes);
    if (rc) return rc;
  }
  /* sizes that a step computes (NonZero's count) are at their bound until then: outputs are allocated there */
  for (int k = m->num_symbols - m->num_run_time_symbols; k < m->num_symbols; ++k) sym[k] = m->symbols[k].max;
  for (int k = 0; k < m->num_symbols; ++k)
    if (sym[k] < 0) return fail(CUVIL_ERR_DIM, "symbol %s is bound by no input dim", m->symbols[k].name);
  if (m->evaluate != NULL) m->evaluate(sym, evals);
  return CUVIL_OK;
}

/* Offset, in evals, of output j's dims. */
static const int64_t *output_dims(const cuvil_model *m, const int64_t *evals, int j) {
  if (evals == NULL) return NULL;
  int64_t off = m->num_steps;
  for (int k = 0; k < j; ++k) off += m->outputs[k].ndim;
  return evals + off;
}

/* Byte size of a tensor whose shape was already validated against d. */
static int64_t tensor_bytes(const cuvil_io_desc *d, const cuvil_tensor *t) {
  int64_t n = dtype_size(d->dtype);
  for (int k = 0; k < d->ndim; ++k) n *= t->shape[k];
  return n;
}

static int overlaps(const void *a, int64_t na, const void *b, int64_t nb) {
  if (na <= 0 || nb <= 0) return 0;
  uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
  return x < y + (uintptr_t)nb && y < x + (uintptr_t)na;
}

static int validate_run(const cuvil_model *m, const cuvil_tensor *inputs, const cuvil_tensor *outputs, int64_t *sym,
                        int64_t *evals) {
  int rc = check_inputs(m, inputs, 1, sym, evals);
  if (rc) return rc;
  if (m->num_outputs > 0 && outputs == NULL)
    return fail(CUVIL_ERR_NULL_OUTPUTS, "outputs is NULL, the model has %d output(s)", (int)m->num_outputs);
  for (int j = 0; j < m->num_outputs; ++j) {
    int64_t oj;
    if (m->evaluate == NULL)
      for (int k = 0; k < m->outputs[j].ndim; ++k)
        if (m->outputs[j].shape[k] < 0)
          return fail(CUVIL_ERR_UNSUPPORTED, "output %d '%s' has symbolic dims that no symbol determines", j,
                      m->outputs[j].name);
    rc = check_tensor(m, "output", j, &m->outputs[j], &outputs[j], 1, NULL, output_dims(m, evals, j), &oj);
    if (rc) return rc;
    for (int i = 0; i < m->num_inputs; ++i) {
      if (overlaps(outputs[j].data, oj, inputs[i].data, tensor_bytes(&m->inputs[i], &inputs[i])))
        return fail(CUVIL_ERR_OVERLAP, "output %d '%s' overlaps input %d '%s'", j, m->outputs[j].name, i,
                    m->inputs[i].name);
    }
    for (int k = 0; k < j; ++k) {
      if (overlaps(outputs[j].data, oj, outputs[k].data, tensor_bytes(&m->outputs[k], &outputs[k])))
        return fail(CUVIL_ERR_OVERLAP, "output %d '%s' overlaps output %d '%s'", j, m->outputs[j].name, k,
                    m->outputs[k].name);
    }
  }
  return CUVIL_OK;
}

/* After a step: a run-time symbol it stored (NonZero's count, TopK's k read from data) is checked against
 * its range, and the extents and output dims are evaluated again when one changed. */
static int refresh_run_time_sizes(const cuvil_model *m, struct cuvil_session *s) {
  int changed = 0;
  for (int k = m->num_symbols - m->num_run_time_symbols; k < m->num_symbols; ++k) {
    const cuvil_symbol *y = &m->symbols[k];
    int64_t v = s->symv[k], *last = &s->symv[m->num_symbols + k];
    if (v < y->min || v > y->max)
      return fail(CUVIL_ERR_PROFILE, "run: size %s computed from the input values is invalid (%lld; at most %lld "
                  "in this profile): e.g. TopK's k outside [0, its axis length]", y->name, (long long)v,
                  (long long)y->max);
    changed |= v != *last;
    *last = v;
  }
  if (changed) m->evaluate(s->symv, s->evals);
  return CUVIL_OK;
}

/* After a run with run-time sizes: every output's actual dims into its caller tensor's shape. */
static void write_output_dims(const cuvil_model *m, const int64_t *evals, cuvil_tensor *outputs) {
  for (int j = 0; j < m->num_outputs; ++j) {
    const int64_t *dims = output_dims(m, evals, j);
    for (int k = 0; k < m->outputs[j].ndim; ++k)
      if (m->outputs[j].shape[k] < 0) outputs[j].shape[k] = dims[k];
  }
}

static int io_info(const char *kind, int count, const cuvil_io_desc *descs, int i, int32_t *dtype, int32_t *ndim,
                   int64_t *shape) {
  if (i < 0 || i >= count) return fail(CUVIL_ERR_INDEX, "%s index %d out of range [0, %d)", kind, i, count);
  const cuvil_io_desc *d = &descs[i];
  if (dtype) *dtype = d->dtype;
  if (ndim) *ndim = d->ndim;
  if (shape)
    for (int k = 0; k < d->ndim; ++k) shape[k] = d->shape[k];
  return CUVIL_OK;
}

/* ------------------------------------------------------------------------------------------------ */
/* Public ABI (the only exported symbols)                                                           */

CUVIL_EXPORT int CUVIL_API(num_inputs)(void) { return CUVIL_MODEL.num_inputs; }

CUVIL_EXPORT int CUVIL_API(num_outputs)(void) { return CUVIL_MODEL.num_outputs; }

CUVIL_EXPORT const char *CUVIL_API(input_name)(int i) {
  const cuvil_model *m = &CUVIL_MODEL;
  return (i >= 0 && i < m->num_inputs) ? m->inputs[i].name : NULL;
}

CUVIL_EXPORT const char *CUVIL_API(output_name)(int i) {
  const cuvil_model *m = &CUVIL_MODEL;
  return (i >= 0 && i < m->num_outputs) ? m->outputs[i].name : NULL;
}

CUVIL_EXPORT int CUVIL_API(input_info)(int i, int32_t *dtype, int32_t *ndim, int64_t *shape) {
  const cuvil_model *m = &CUVIL_MODEL;
  return io_info("input", m->num_inputs, m->inputs, i, dtype, ndim, shape);
}

CUVIL_EXPORT int CUVIL_API(output_info)(int i, int32_t *dtype, int32_t *ndim, int64_t *shape) {
  const cuvil_model *m = &CUVIL_MODEL;
  return io_info("output", m->num_outputs, m->outputs, i, dtype, ndim, shape);
}

CUVIL_EXPORT cuvil_session *CUVIL_API(session_create)(int num_threads) {
  const cuvil_model *m = &CUVIL_MODEL;
  const void *weights = m->weights, *opt_weights = m->opt_weights;
  pthread_mutex_lock(&weights_mu);
  if (m->external_weights_bytes > 0) {
    if (bound_weights == NULL) {
      pthread_mutex_unlock(&weights_mu);
      fail(CUVIL_ERR_WEIGHTS_UNBOUND, "session_create: the weights of this library are in its libNAME.weights "
           "file (compiled with --external-weights): map that file and call bind_weights before creating a session");
      return NULL;
    }
    weights = bound_weights;
    opt_weights = m->external_opt_weights_offset >= 0
                      ? (const void *)((const char *)bound_weights + m->external_opt_weights_offset) : NULL;
  } else if (!weights_advised) {
    advise_weights(m->weights, m->weights_bytes);
    if (m->opt_weights != m->weights) advise_weights(m->opt_weights, m->opt_weights_bytes);
    weights_advised = 1;
  }
  struct cuvil_session *s = session_create(num_threads, weights, opt_weights);
  cuvil_session *h = s != NULL ? session_register(s) : NULL;
  if (s != NULL && h == NULL) free_session(s);
  if (h != NULL) live_sessions++;
  pthread_mutex_unlock(&weights_mu);
  return h;
}

/* Extension: external weights. 1 when the library's weights are in a separate libNAME.weights file and must be
 * bound with bind_weights before a session is created (nbytes: their size; sha256: their 32-byte SHA-256;
 * either may be NULL); 0 when they are embedded (or the model has none), nbytes then 0. */
CUVIL_EXPORT int CUVIL_API(weights_info)(int64_t *nbytes, uint8_t *sha256) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (nbytes) *nbytes = m->external_weights_bytes;
  if (m->external_weights_bytes == 0) return 0;
  if (sha256) memcpy(sha256, m->external_weights_sha256, 32);
  return 1;
}

/* Extension: hands the library its external weights: data (64-byte aligned, read only, unchanged and alive
 * until every session created while it is bound is destroyed) must be exactly the weights_info bytes with the
 * SHA-256 embedded in the library. Allowed only while no session is live: binding again replaces the buffer,
 * and (NULL, 0) unbinds it (session_create then refuses again). */
CUVIL_EXPORT int CUVIL_API(bind_weights)(const void *data, size_t nbytes) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (m->external_weights_bytes == 0)
    return fail(CUVIL_ERR_UNSUPPORTED, "bind_weights: this library embeds its weights (compiled without "
                "--external-weights): there is nothing to bind");
  if (data == NULL && nbytes == 0) {
    pthread_mutex_lock(&weights_mu);
    long n = live_sessions;
    if (n == 0) bound_weights = NULL;
    pthread_mutex_unlock(&weights_mu);
    return n == 0 ? CUVIL_OK : fail(CUVIL_ERR_BUSY, "bind_weights: %ld session(s) of this library are live: "
                                    "destroy them before unbinding", n);
  }
  if (data == NULL) return fail(CUVIL_ERR_NULL_ARGUMENT, "bind_weights: data is NULL");
  if ((uintptr_t)data % 64 != 0)
    return fail(CUVIL_ERR_ALIGN, "bind_weights: data %p is not 64-byte aligned (map the file: the weights start "
                "at a page boundary of it)", data);
  if ((uint64_t)nbytes != (uint64_t)m->external_weights_bytes)
    return fail(CUVIL_ERR_WEIGHTS_MISMATCH, "bind_weights: %zu bytes given, the library's weights are %lld bytes: "
                "the weights of another model, or a truncated file", nbytes, (long long)m->external_weights_bytes);
  uint8_t digest[32];
  sha256(data, nbytes, digest);
  if (memcmp(digest, m->external_weights_sha256, 32) != 0) {
    char got[17], want[17];
    for (int k = 0; k < 8; ++k) {
      snprintf(got + 2 * k, 3, "%02x", digest[k]);
      snprintf(want + 2 * k, 3, "%02x", m->external_weights_sha256[k]);
    }
    return fail(CUVIL_ERR_WEIGHTS_MISMATCH, "bind_weights: the weights' SHA-256 is %s..., the library's %s...: the "
                "weights of another build of the model, or altered ones", got, want);
  }
  pthread_mutex_lock(&weights_mu);
  if (live_sessions > 0) {
    long n = live_sessions;
    pthread_mutex_unlock(&weights_mu);
    return fail(CUVIL_ERR_BUSY, "bind_weights: %ld session(s) of this library are live: destroy them first", n);
  }
  bound_weights = data;
  pthread_mutex_unlock(&weights_mu);
  return CUVIL_OK;
}

/* Extension: the model's shape symbols and their profiles (min <= value <= max at every run). */
CUVIL_EXPORT int CUVIL_API(num_symbols)(void) { return CUVIL_MODEL.num_symbols; }

CUVIL_EXPORT int CUVIL_API(symbol_info)(int i, const char **name, int64_t *min, int64_t *opt, int64_t *max) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (i < 0 || i >= m->num_symbols)
    return fail(CUVIL_ERR_INDEX, "symbol index %d out of range [0, %d)", i, (int)m->num_symbols);
  const cuvil_symbol *y = &m->symbols[i];
  if (name) *name = y->name;
  if (min) *min = y->min;
  if (opt) *opt = y->opt;
  if (max) *max = y->max;
  return CUVIL_OK;
}

static int output_shape(const cuvil_tensor *inputs, int i, int64_t *shape) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (i < 0 || i >= m->num_outputs)
    return fail(CUVIL_ERR_INDEX, "output index %d out of range [0, %d)", i, (int)m->num_outputs);
  const cuvil_io_desc *d = &m->outputs[i];
  if (shape == NULL && d->ndim > 0) return fail(CUVIL_ERR_NULL_ARGUMENT, "output_shape: shape is NULL");
  int symbolic = 0;
  for (int k = 0; k < d->ndim; ++k) symbolic |= d->shape[k] < 0;
  if (symbolic && m->evaluate == NULL)
    return fail(CUVIL_ERR_UNSUPPORTED, "output %d '%s' has symbolic dims that no symbol determines", i, d->name);
  /* Static shapes do not depend on the inputs: they may be NULL. Given ones are checked (not their data). */
  if (inputs != NULL || symbolic) {
    int64_t *sym = NULL, *evals = NULL;
    if (m->num_symbols > 0) {
      sym = (int64_t *)calloc((size_t)m->num_symbols, sizeof(int64_t));
      evals = (int64_t *)calloc((size_t)(m->num_evaluated > 0 ? m->num_evaluated : 1), sizeof(int64_t));
      if (!sym || !evals) {
        free(sym);
        free(evals);
        return fail(CUVIL_ERR_NOMEM, "output_shape: out of memory");
      }
    }
    int rc = check_inputs(m, inputs, 0, sym, evals);
    if (rc == CUVIL_OK) {
      const int64_t *dims = output_dims(m, evals, i);
      for (int k = 0; k < d->ndim; ++k) shape[k] = d->shape[k] >= 0 ? d->shape[k] : dims[k];
    }
    free(sym);
    free(evals);
    return rc;
  }
  for (int k = 0; k < d->ndim; ++k) shape[k] = d->shape[k];
  return CUVIL_OK;
}

CUVIL_EXPORT int CUVIL_API(output_shape)(cuvil_session *h, const cuvil_tensor *inputs, int i, int64_t *shape) {
  int rc;
  if (session_claim(h, "output_shape", &rc) == NULL) return rc;
  rc = output_shape(inputs, i, shape);
  session_release(h);
  return rc;
}

CUVIL_EXPORT int CUVIL_API(run)(cuvil_session *h, const cuvil_tensor *inputs, cuvil_tensor *outputs) {
  const cuvil_model *m = &CUVIL_MODEL;
  int rc;
  struct cuvil_session *s = session_claim(h, "run", &rc);
  if (s == NULL) return rc;
  rc = validate_run(m, inputs, outputs, s->symv, s->evals);
  if (rc) {
    session_release(h);
    return rc;
  }
  place_workers(s);
  const int ni = m->num_inputs, no = m->num_outputs;
  const cuvil_step *steps = m->steps;
  int nsteps = m->num_steps, first = 0;               /* first: the steps' slot in the profile */
  const int64_t *ext = s->evals;                      /* symbolic extents, evaluated for this run */
  int at_opt = m->num_opt_steps > 0;
  int64_t slices = 1;    /* batch slices: the opt steps once per slice of the batch symbol (cuvil_model) */
  for (int k = 0; k < m->num_symbols && at_opt; ++k) {
    const int64_t v = s->symv[k], opt = m->symbols[k].opt;
    if (k == m->batch_symbol && m->batch_slice_bytes != NULL && opt >= 1 && v > opt && v % opt == 0)
      slices = v / opt;
    else
      at_opt = v == opt;
  }
  if (!at_opt) slices = 1;
  const void *weights = at_opt ? s->opt_weights : s->weights;
  if (at_opt) {
    steps = m->opt_steps;
    nsteps = m->num_opt_steps;
    first = m->num_steps;
    ext = NULL;
  }
  if (s->bufs[1] != weights)
    for (int t = 0; t < s->num_threads; ++t) s->bufs[(size_t)t * s->nbufs + 1] = (void *)weights;
#define CUVIL_EXTENT(k) (steps[k].extent >= 0 ? steps[k].extent : ext[k])
  /* A guarded step whose condition says its branch is not taken is skipped: the previous step finished
   * (release/acquire) before this thread reads the condition, so it reads the value just written. */
#define CUVIL_SKIP(k) (steps[k].guard_buf > 0 && \
    (((const uint8_t *)s->bufs[steps[k].guard_buf - 1])[steps[k].guard_off] != 0) != (steps[k].guard_value != 0))
  /* A run-time loop: after its head step (go false) or its back-edge step (always), the run goes on at
   * another step; k = target - 1, then ++k. */
#define CUVIL_JUMP(k) (steps[k].jump_to > 0 && (steps[k].jump_buf == 0 || \
    ((((const uint8_t *)s->bufs[steps[k].jump_buf - 1])[steps[k].jump_off] != 0) == (steps[k].jump_value != 0))))
  const int sized = m->num_run_time_symbols > 0 && !at_opt;
  if (sized)
    for (int k = m->num_symbols - m->num_run_time_symbols; k < m->num_symbols; ++k)
      s->symv[m->num_symbols + k] = s->symv[k];
#define CUVIL_SIZES() \
  if (sized && (rc = refresh_run_time_sizes(m, s)) != CUVIL_OK) { session_release(h); return rc; }
  for (int64_t slice = 0; slice < slices; ++slice) {
    for (int t = 0; t < s->num_threads; ++t) {
      void **bufs = s->bufs + (size_t)t * s->nbufs;
      for (int i = 0; i < ni; ++i)
        bufs[2 + i] = slices > 1 ? (char *)inputs[i].data + slice * m->batch_slice_bytes[i] : inputs[i].data;
      for (int j = 0; j < no; ++j)
        bufs[2 + ni + j] = slices > 1 ? (char *)outputs[j].data + slice * m->batch_slice_bytes[ni + j]
                                      : outputs[j].data;
    }
    if (s->profile == NULL) {
      for (int k = 0; k < nsteps; ++k) {
        if (CUVIL_SKIP(k)) continue;
        run_step(s, &steps[k], CUVIL_EXTENT(k));
        CUVIL_SIZES();
        if (CUVIL_JUMP(k)) k = steps[k].jump_to - 2;
      }
    } else {
      struct timespec t0, t1;
      for (int k = 0; k < nsteps; ++k) {
        if (CUVIL_SKIP(k)) continue;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        run_step(s, &steps[k], CUVIL_EXTENT(k));
        clock_gettime(CLOCK_MONOTONIC, &t1);
        s->profile[first + k] += (int64_t)(t1.tv_sec - t0.tv_sec) * 1000000000 + (t1.tv_nsec - t0.tv_nsec);
        CUVIL_SIZES();
        if (CUVIL_JUMP(k)) k = steps[k].jump_to - 2;
      }
    }
  }
  if (sized) write_output_dims(m, s->evals, outputs);
  session_release(h);
  return CUVIL_OK;
}

/* Extension: time every step of the following runs of session s, adding nanoseconds into step_ns[k]
 * (capacity >= the number of steps: the generic ones, then those specialised for the opt point);
 * step_ns NULL stops. Returns the number of steps, or a negative code. */
CUVIL_EXPORT int CUVIL_API(profile)(cuvil_session *h, int64_t *step_ns, int32_t capacity) {
  const cuvil_model *m = &CUVIL_MODEL;
  int rc;
  struct cuvil_session *s = session_claim(h, "profile", &rc);
  if (s == NULL) return rc;
  const int total = m->num_steps + m->num_opt_steps;
  if (step_ns != NULL && capacity < total) {
    session_release(h);
    return fail(CUVIL_ERR_INDEX, "profile: capacity %d < %d steps", (int)capacity, total);
  }
  s->profile = step_ns;
  session_release(h);
  return total;
}

CUVIL_EXPORT const char *CUVIL_API(strerror)(int code) {
  if (code <= 0 && -code < CUVIL_NUM_MESSAGES) return cuvil_messages[-code];
  return "unknown error code";
}

/* Extension: the specifics of the last failing call on the calling thread ("" if none yet). */
CUVIL_EXPORT const char *CUVIL_API(last_error)(void) { return cuvil_detail; }

/* ------------------------------------------------------------------------------------------------ */
/* LoRA adapters: public calls                                                                      */

/* Extension: the LoRA slots (number; slot k's module, dims and rank). 0, or CUVIL_ERR_INDEX for a bad k. */
CUVIL_EXPORT int CUVIL_API(num_lora_slots)(void) { return CUVIL_MODEL.num_lora_slots; }

CUVIL_EXPORT int CUVIL_API(lora_slot_info)(int k, const char **module, int64_t *in, int64_t *out, int64_t *rank) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (k < 0 || k >= m->num_lora_slots)
    return fail(CUVIL_ERR_INDEX, "lora_slot_info: slot %d out of range [0, %d)", k, (int)m->num_lora_slots);
  const cuvil_lora_slot *y = &m->lora_slots[k];
  if (module) *module = y->module;
  if (in) *in = y->in;
  if (out) *out = y->out;
  if (rank) *rank = y->rank;
  return CUVIL_OK;
}

/* Loads adapter `name`: for each of its n entries, slots[e] (a slot index), A[e] float [r, in] and B[e] float
 * [out, r] (PEFT's layout: y += scales[e] * (x A^T) B^T) and scales[e] (NULL: all 1). The tensors are copied
 * (transposed, scale folded into B, zero-padded to the slot rank): the caller's buffers may go once it
 * returns. Slots no entry names stay off while the adapter is active. Any thread, any time. */
CUVIL_EXPORT int CUVIL_API(adapter_load)(const char *name, int32_t n, const int32_t *slots, const cuvil_tensor *A,
                                         const cuvil_tensor *B, const float *scales) {
  const cuvil_model *m = &CUVIL_MODEL;
  if (m->num_lora_slots == 0)
    return fail(CUVIL_ERR_NO_LORA_SLOTS, "adapter_load: this library has no LoRA slots: compile the model with "
                "--lora-slots RANK (Python: lora_slots=RANK)");
  if (name == NULL) return fail(CUVIL_ERR_NULL_ARGUMENT, "adapter_load: name is NULL");
  if (n < 0 || n > m->num_lora_slots)
    return fail(CUVIL_ERR_INDEX, "adapter_load: %d entries, expected 0 to %d (one per slot at most)", (int)n,
                (int)m->num_lora_slots);
  if (n > 0 && (slots == NULL || A == NULL || B == NULL))
    return fail(CUVIL_ERR_NULL_ARGUMENT, "adapter_load: slots, A or B is NULL");
  size_t floats = 0;
  int64_t *ranks = (int64_t *)calloc((size_t)m->num_lora_slots, sizeof(int64_t));
  if (ranks == NULL) return fail(CUVIL_ERR_NOMEM, "adapter_load: out of memory");
  for (int e = 0; e < n; ++e) {
    int k = slots[e];
    if (k < 0 || k >= m->num_lora_slots || ranks[k] != 0) {
      free(ranks);
      return fail(CUVIL_ERR_INDEX, k < 0 || k >= m->num_lora_slots ? "adapter_load: entry %d names slot %d, out of "
                  "range [0, %d)" : "adapter_load: entry %d names slot %d again (%d slots)", e, k,
                  (int)m->num_lora_slots);
    }
    int64_t r = check_lora_pair(&m->lora_slots[k], e, k, &A[e], &B[e], scales ? scales[e] : 1.0f);
    if (r < 0) {
      free(ranks);
      return (int)r;
    }
    ranks[k] = r;
    const cuvil_lora_slot *y = &m->lora_slots[k];
    floats += (size_t)((y->in + y->out) * y->rank + 16);   /* + 16: each slot's pair 64-byte aligned */
  }
  struct lora_adapter *a = (struct lora_adapter *)calloc(1, sizeof *a);
  if (a != NULL) {
    a->name = strdup(name);
    a->a = (float **)calloc((size_t)m->num_lora_slots, sizeof(float *));
    a->b = (float **)calloc((size_t)m->num_lora_slots, sizeof(float *));
    a->bytes = floats * sizeof(float);
    if (floats > 0 && posix_memalign(&a->mem, CUVIL_CACHELINE, a->bytes) != 0) a->mem = NULL;
  }
  if (a == NULL || !a->name || !a->a || !a->b || (floats > 0 && a->mem == NULL)) {
    free(ranks);
    if (a) adapter_free(a);
    return fail(CUVIL_ERR_NOMEM, "adapter_load: could not allocate %zu bytes for adapter '%s'", floats * sizeof(float),
                name);
  }
  if (a->mem != NULL) memset(a->mem, 0, a->bytes);
  float *p = (float *)a->mem;
  for (int e = 0; e < n; ++e) {
    int k = slots[e];
    const cuvil_lora_slot *y = &m->lora_slots[k];
    const int64_t R = y->rank, r = ranks[k], in = y->in, out = y->out;
    const float *src_a = (const float *)A[e].data, *src_b = (const float *)B[e].data;
    const float s = scales ? scales[e] : 1.0f;
    a->a[k] = p;
    for (int64_t i = 0; i < in; ++i)                    /* A_pad[i][j] = A[j][i] */
      for (int64_t j = 0; j < r; ++j) p[i * R + j] = src_a[j * in + i];
    p += in * R;
    a->b[k] = p;
    for (int64_t j = 0; j < r; ++j)                     /* B_pad[j][o] = s * B[o][j] */
      for (int64_t o = 0; o < out; ++o) p[j * out + o] = s * src_b[o * r + j];
    p += R * out;
    p = (float *)(((uintptr_t)p + CUVIL_CACHELINE - 1) & ~(uintptr_t)(CUVIL_CACHELINE - 1));
  }
  free(ranks);
  a->refs = 1;
  pthread_mutex_lock(&adapters_mu);
  if (adapter_find(name) != NULL) {
    pthread_mutex_unlock(&adapters_mu);
    adapter_free(a);
    return fail(CUVIL_ERR_ADAPTER_EXISTS, "adapter_load: an adapter named '%s' is already loaded: unload it first, "
                "or give another name", name);
  }
  a->next = adapters;
  adapters = a;
  pthread_mutex_unlock(&adapters_mu);
  return CUVIL_OK;
}

/* Makes adapter `name` the one session s runs with (NULL: none, the base model, bit for bit). Between runs:
 * a session running on another thread gets CUVIL_ERR_BUSY, never a half-switched run. */
CUVIL_EXPORT int CUVIL_API(adapter_activate)(cuvil_session *h, const char *name) {
  int rc;
  struct cuvil_session *s = session_claim(h, "adapter_activate", &rc);
  if (s == NULL) return rc;
  if (name != NULL && CUVIL_MODEL.num_lora_slots == 0) {
    session_release(h);
    return fail(CUVIL_ERR_NO_LORA_SLOTS, "adapter_activate: this library has no LoRA slots: compile the model with "
                "--lora-slots RANK (Python: lora_slots=RANK)");
  }
  struct lora_adapter *a = NULL;
  if (name != NULL) {
    pthread_mutex_lock(&adapters_mu);
    a = adapter_find(name);
    if (a != NULL) ++a->refs;
    pthread_mutex_unlock(&adapters_mu);
    if (a == NULL) {
      session_release(h);
      return fail(CUVIL_ERR_ADAPTER_NAME, "adapter_activate: no adapter named '%s' is loaded (adapter_load it first)",
                  name);
    }
  }
  struct lora_adapter *old = s->adapter;
  s->adapter = a;
  lora_point(s, a);
  session_release(h);
  adapter_release(old);
  return CUVIL_OK;
}

/* Unloads adapter `name`: the name is free at once; its memory goes when no session has it active any more
 * (sessions that do keep running with it until they activate another or are destroyed). Any thread. */
CUVIL_EXPORT int CUVIL_API(adapter_unload)(const char *name) {
  if (name == NULL) return fail(CUVIL_ERR_NULL_ARGUMENT, "adapter_unload: name is NULL");
  pthread_mutex_lock(&adapters_mu);
  struct lora_adapter **link = &adapters;
  while (*link != NULL && strcmp((*link)->name, name) != 0) link = &(*link)->next;
  struct lora_adapter *a = *link;
  if (a != NULL) *link = a->next;
  pthread_mutex_unlock(&adapters_mu);
  if (a == NULL) return fail(CUVIL_ERR_ADAPTER_NAME, "adapter_unload: no adapter named '%s' is loaded", name);
  adapter_release(a);
  return CUVIL_OK;
}

/* Extension: the bytes adapter `name` holds (its padded tensors), or a negative code. */
CUVIL_EXPORT int64_t CUVIL_API(adapter_bytes)(const char *name) {
  if (name == NULL) return fail(CUVIL_ERR_NULL_ARGUMENT, "adapter_bytes: name is NULL");
  pthread_mutex_lock(&adapters_mu);
  struct lora_adapter *a = adapter_find(name);
  int64_t n = a ? (int64_t)a->bytes : 0;
  pthread_mutex_unlock(&adapters_mu);
  return a ? n : fail(CUVIL_ERR_ADAPTER_NAME, "adapter_bytes: no adapter named '%s' is loaded", name);
}

/* NULL, a destroyed session (double destroy) or a foreign pointer: nothing happens but the error detail. */
CUVIL_EXPORT void CUVIL_API(session_destroy)(cuvil_session *h) {
  if (h == NULL) return;
  struct cuvil_session *s = session_unregister(h);
  if (s == NULL) return;
  free_session(s);
  pthread_mutex_lock(&weights_mu);
  live_sessions--;
  pthread_mutex_unlock(&weights_mu);
}
