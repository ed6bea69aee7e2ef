/* Cuvil x86-64 runtime: the internal interface between the generated pieces of an artifact
 * (kernels.o, weights.S, model.c) and the static runtime (runtime.c).
 *
 * This header is NOT installed for users: they get the generated lib<name>.h. It is included by
 * runtime.c and by the generated model.c, both compiled with -fvisibility=hidden and
 * -DCUVIL_PREFIX=<prefix>.
 *
 * Contract (abi_version 8):
 *   At run time the runtime builds, for each thread t of the session, void *bufs[4 + num_inputs + num_outputs]:
 *     bufs[0]                       the session's arena (arena_bytes, 64-byte aligned, NULL if 0 bytes)
 *     bufs[1]                       model.weights, or the weights bound by bind_weights when the model's are
 *                                   external (NULL if the model has no weights)
 *     bufs[2 + i]                   inputs[i].data    (caller memory, element-aligned, read only)
 *     bufs[2 + num_inputs + j]      outputs[j].data   (caller memory, element-aligned)
 *     bufs[2 + num_inputs + num_outputs]  thread t's own scratch (scratch_bytes, 64-byte aligned, NULL if
 *                                   0 bytes; contents undefined at the start of every call)
 *     bufs[3 + num_inputs + num_outputs]  the run's symbol values: int64_t[num_symbols], bound from the
 *                                   input shapes (input dims whose dim_syms entry is k >= 0 give symbol k)
 *                                   and checked against [min, max] before any step runs; the run-time
 *                                   symbols among them (see num_run_time_symbols) are written by steps
 *     bufs[4 + num_inputs + num_outputs + 3k ..]  LoRA slot k (num_lora_slots): the active adapter's
 *                                   A_pad float[in, rank], B_pad float[rank, out] (NULL when the slot is
 *                                   off) and a pointer to one bool, true when the slot is on (its steps
 *                                   are guarded by it)
 *   and executes the steps in order. For a step {fn, extent, grain}, with extent -1 replaced by the value
 *   evaluate(symbols, out) computed for it (out[k] for step k; then the outputs' dims, in order):
 *     extent <= 0   skipped;
 *     otherwise     [0, extent) is split into n = min(num_threads, max(1, extent / grain)) chunks whose
 *                   boundaries are multiples of grain (the last chunk ends at extent), so every chunk has
 *                   >= grain iterations unless extent < grain; fn(bufs, begin, end) is called once per
 *                   chunk by whichever thread claims it first (the calling thread claims too, so a worker
 *                   the OS has not scheduled never delays a step), with that thread's bufs. n == 1 means
 *                   one call fn(bufs, 0, extent) on the calling thread with no synchronisation at all.
 *   All chunks of a step finish (with release/acquire ordering) before any chunk of the next one starts.
 *   grain <= 0 is treated as 1.
 */
#ifndef CUVIL_RUNTIME_H_
#define CUVIL_RUNTIME_H_

#include <stdint.h>

#ifndef CUVIL_PREFIX
#define CUVIL_PREFIX cuvil
#endif

#define CUVIL_CAT_(a, b) a##_##b
#define CUVIL_CAT(a, b) CUVIL_CAT_(a, b)
/* CUVIL_API(run) -> <prefix>_run ; CUVIL_MODEL -> <prefix>__model */
#define CUVIL_API(name) CUVIL_CAT(CUVIL_PREFIX, name)
#define CUVIL_MODEL CUVIL_CAT(CUVIL_PREFIX, _model)

#define CUVIL_ABI_VERSION 8
#define CUVIL_HIDDEN __attribute__((visibility("hidden")))
#define CUVIL_EXPORT __attribute__((visibility("default")))

typedef void (*cuvil_kernel_fn)(void **bufs, int64_t begin, int64_t end);

/* run fn over [0, extent) split into chunks of >= grain iterations across threads, at most split chunks per
 * thread (chunks are claimed, so a thread that starts late or runs slower takes fewer). guard_buf > 0: the
 * step runs only when the bool at bufs[guard_buf - 1] + guard_off, written by an earlier step or an input,
 * equals guard_value (a branch of a run-time If); guard_buf == 0: always. jump_to > 0: after the step runs
 * (not when skipped), the run goes on at step jump_to - 1 when jump_buf == 0 or the bool at
 * bufs[jump_buf - 1] + jump_off equals jump_value (a run-time loop's exit test and back edge). */
typedef struct {
  cuvil_kernel_fn fn; int64_t extent; int64_t grain; int64_t split;
  int32_t guard_buf; int32_t guard_value; int64_t guard_off;
  int32_t jump_to; int32_t jump_buf; int32_t jump_value; int64_t jump_off;
} cuvil_step;

/* dtype = ONNX TensorProto code; shape entries -1 = symbolic; shape may be NULL if ndim == 0.
 * dim_syms (inputs; NULL when every dim is static): per dim, the symbol it binds, or -1. */
typedef struct {
  const char *name; int32_t dtype; int32_t ndim; const int64_t *shape; const int32_t *dim_syms;
} cuvil_io_desc;

/* A shape symbol and its profile: every run must have min <= value <= max and value % multiple == 0. */
typedef struct { const char *name; int64_t min, opt, max, multiple; } cuvil_symbol;

/* A LoRA slot: the module it adapts and the dims of y = x W (in, out); an adapter of rank r <= rank fits. */
typedef struct { const char *module; int64_t in, out, rank; } cuvil_lora_slot;

/* Fills out[0, num_evaluated) from the symbol values: step extents, then output dims. */
typedef void (*cuvil_eval_fn)(const int64_t *symbols, int64_t *out);

typedef struct {
  int32_t abi_version;            /* CUVIL_ABI_VERSION */
  int32_t num_inputs, num_outputs;
  const cuvil_io_desc *inputs, *outputs;
  int64_t arena_bytes;            /* scratch memory per session, 64-byte aligned allocation */
  int32_t num_steps; const cuvil_step *steps;
  const void *weights;            /* address of the embedded weights symbol, or NULL */
  int64_t scratch_bytes;          /* per-thread scratch (packed GEMM panels), 64-byte aligned allocation */
  int32_t num_symbols; const cuvil_symbol *symbols;
  cuvil_eval_fn evaluate; int32_t num_evaluated;   /* NULL, 0 when the model has no symbols */
  /* Steps specialised for the symbols' opt values (static extents; 0, NULL if none), run instead of steps
   * when every symbol equals its opt; they read opt_weights as bufs[1]. */
  int32_t num_opt_steps; const cuvil_step *opt_steps;
  const void *opt_weights;
  /* The last num_run_time_symbols symbols are sizes that depend on tensor values (NonZero's count): no input
   * binds them; they hold their max (the bound outputs are allocated at) until the step computing one stores
   * its value into bufs[3 + num_inputs + num_outputs][k]; extents are then evaluated again, and after the run
   * every output's dims are written back into its cuvil_tensor.shape. */
  int32_t num_run_time_symbols;
  /* External weights (--external-weights): > 0 when weights and opt_weights are NULL and the weights, this many
   * bytes with this SHA-256, are handed over at run time by bind_weights (from libNAME.weights); the opt
   * steps' weights start external_opt_weights_offset bytes into them (-1: the opt steps read none). */
  int64_t external_weights_bytes;
  const uint8_t *external_weights_sha256;
  int64_t external_opt_weights_offset;
  int32_t num_lora_slots; const cuvil_lora_slot *lora_slots;   /* 0, NULL without --lora-slots */
  /* Batch slices: every row along symbol batch_symbol (-1: none) is computed on its own, so a run whose value
   * of it is a multiple q of its opt, every other symbol at its opt, runs the opt steps q times, slice i with
   * input j at inputs[j].data + i * batch_slice_bytes[j] and output j at outputs[j].data + i *
   * batch_slice_bytes[num_inputs + j]. */
  int32_t batch_symbol; const int64_t *batch_slice_bytes;
  /* The embedded weights' and opt_weights' sizes in bytes (0 where NULL): session creation asks for their pages
   * in 2 MB folios (runtime.c, advise_weights). */
  int64_t weights_bytes, opt_weights_bytes;
} cuvil_model;

/* The public tensor type, identical to the one in the generated lib<name>.h. */
#ifndef CUVIL_TENSOR_DEFINED
#define CUVIL_TENSOR_DEFINED
typedef struct { void *data; int32_t dtype; int32_t ndim; int64_t *shape; } cuvil_tensor;
typedef struct cuvil_session cuvil_session;
#endif

/* Defined (hidden) by the generated model.c. */
extern CUVIL_HIDDEN const cuvil_model CUVIL_MODEL;
/* The first ISA feature the kernels were compiled for that this CPU lacks (its name, as __builtin_cpu_supports
 * spells it), or NULL: session creation refuses such a CPU instead of dying of SIGILL in the first step. */
#define CUVIL_MISSING_ISA CUVIL_CAT(CUVIL_PREFIX, _missing_isa)
extern CUVIL_HIDDEN const char *CUVIL_MISSING_ISA(void);

#endif /* CUVIL_RUNTIME_H_ */
