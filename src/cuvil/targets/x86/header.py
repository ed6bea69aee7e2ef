"""Generator of the public C header ``lib<name>.h`` shipped next to an x86 artifact.

The header is self-contained (only <stddef.h> and <stdint.h>), usable from C and C++, and several headers of differently
prefixed models can be included in one translation unit: the shared types and constants are guarded.
"""
from __future__ import annotations

from cuvil.errors import CuvilError
from cuvil.targets.x86.model_c import c_comment_text, shape_text
from cuvil.targets.x86.model_info import ABI_DTYPES, ModelInfo, is_c_identifier

#: (name, code, message) of every status code; runtime.c holds the same table (tests check they agree).
ERROR_CODES = (
    ("CUVIL_OK", 0, "success"),
    ("CUVIL_ERR_NULL_SESSION", -1, "session is NULL"),
    ("CUVIL_ERR_NULL_INPUTS", -2, "inputs array is NULL"),
    ("CUVIL_ERR_NULL_OUTPUTS", -3, "outputs array is NULL"),
    ("CUVIL_ERR_NULL_DATA", -4, "tensor data pointer is NULL"),
    ("CUVIL_ERR_NULL_SHAPE", -5, "tensor shape pointer is NULL while ndim > 0"),
    ("CUVIL_ERR_DTYPE", -6, "tensor dtype does not match the model"),
    ("CUVIL_ERR_NDIM", -7, "tensor rank (ndim) does not match the model"),
    ("CUVIL_ERR_DIM", -8, "tensor dimension does not match the model"),
    ("CUVIL_ERR_ALIGN", -9, "tensor data is not aligned to its element size"),
    ("CUVIL_ERR_OVERLAP", -10, "an output buffer overlaps another input or output buffer"),
    ("CUVIL_ERR_INDEX", -11, "input/output index out of range"),
    ("CUVIL_ERR_NULL_ARGUMENT", -12, "a required pointer argument is NULL"),
    ("CUVIL_ERR_BUSY", -13, "session is already running (sessions are single-threaded)"),
    ("CUVIL_ERR_NUM_THREADS", -14, "invalid number of threads"),
    ("CUVIL_ERR_NOMEM", -15, "out of memory"),
    ("CUVIL_ERR_THREAD", -16, "could not create a worker thread"),
    ("CUVIL_ERR_ABI", -17, "model descriptor has an unsupported ABI version"),
    ("CUVIL_ERR_UNSUPPORTED", -18, "operation not supported by this artifact"),
    ("CUVIL_ERR_PROFILE", -19, "tensor dimension is outside the model's shape profile"),
    ("CUVIL_ERR_BAD_SESSION", -20, "not a live session of this library (destroyed, or never created by it)"),
    ("CUVIL_ERR_WEIGHTS_UNBOUND", -21, "the library's external weights are not bound (call bind_weights first)"),
    ("CUVIL_ERR_WEIGHTS_MISMATCH", -22, "the weights buffer does not match the library (size or SHA-256)"),
    ("CUVIL_ERR_ADAPTER_NAME", -23, "no adapter of that name is loaded"),
    ("CUVIL_ERR_ADAPTER_EXISTS", -24, "an adapter of that name is already loaded"),
    ("CUVIL_ERR_LORA_RANK", -25, "the adapter's rank is above the library's LoRA slot rank"),
    ("CUVIL_ERR_NO_LORA_SLOTS", -26, "the library has no LoRA slots (compiled without --lora-slots)"),
)


def _io_block(title: str, descs) -> list[str]:
    out = [f" * {title}:"]
    if not descs:
        out.append(" *   (none)")
    for k, d in enumerate(descs):
        out.append(f" *   {k}  \"{c_comment_text(d.name)}\"  {d.dtype_name} "
                   f"{c_comment_text(shape_text(d.dims or d.shape))}")
    return out


def _symbol_block(info: ModelInfo) -> list[str]:
    if not info.symbols:
        return []
    out = [" * Shape symbols (min <= value <= max at every run, and a multiple of the multiple given, else "
           "CUVIL_ERR_PROFILE; kernels tuned for opt):"]
    first_run_time = len(info.symbols) - info.num_run_time_symbols
    for k, sd in enumerate(info.symbols):
        if k >= first_run_time:
            out.append(f" *   {c_comment_text(sd.name)} in [0, {sd.max}], computed from the input values during the run:")
            out.append(f" *     allocate its outputs at {sd.max} (cuvil_output_shape); cuvil_run writes their actual dims")
            continue
        mult = f", multiples of {sd.multiple}" if sd.multiple > 1 else ""
        out.append(f" *   {c_comment_text(sd.name)} in [{sd.min}, {sd.max}]{mult}, opt {sd.opt}")
    return out


def _lora_block(info: ModelInfo, p: str, session: str) -> list[str]:
    """The LoRA adapter calls (docs/c-abi.md), with the slots this library has."""
    slots = [f" *   {k}  {c_comment_text(m)}  in {i}, out {o}, rank <= {r}" for k, (m, i, o, r) in
             enumerate(info.lora_slots)] or [" *   (none: compiled without --lora-slots; the calls return "
                                             "CUVIL_ERR_NO_LORA_SLOTS)"]
    return [
        "/* Extension: LoRA adapters swapped at run time (docs/c-abi.md). Slots of this library:",
        *slots,
        " * adapter_load copies A[e] float [r, in] and B[e] float [out, r] (PEFT's layout) for slot slots[e], with",
        " * y += scales[e] * (x A^T) B^T (scales NULL: 1); slots it does not name stay off. load/unload: any",
        " * thread, any time. activate(s, NULL) = the base model, bit for bit; a session running elsewhere gets",
        " * CUVIL_ERR_BUSY. An adapter unloaded while active in sessions is freed when the last switches away. */",
        f"int            {p}_num_lora_slots(void);",
        f"int            {p}_lora_slot_info(int k, const char **module, int64_t *in, int64_t *out, int64_t *rank);",
        f"int            {p}_adapter_load(const char *name, int32_t n, const int32_t *slots, const cuvil_tensor *A,",
        "                               const cuvil_tensor *B, const float *scales);",
        f"int            {p}_adapter_activate({session} *s, const char *name);",
        f"int            {p}_adapter_unload(const char *name);",
        f"int64_t        {p}_adapter_bytes(const char *name);   /* bytes held, or a negative code */",
    ]


def generate_header(model_info: ModelInfo, prefix: str | None = None) -> str:
    """The public header for ``model_info``; ``prefix`` (default: ``model_info.prefix``) names the functions."""
    p = model_info.prefix if prefix is None else prefix
    if not is_c_identifier(p):
        raise CuvilError(f"prefix must be a C identifier, got {p!r}")
    guard = f"CUVIL_MODEL_{p}_H_"

    lines = [
        f"/* Generated by Cuvil: the C API of a compiled model (function prefix '{p}'). Do not edit.",
        " *",
        *_io_block("Inputs", model_info.inputs),
        *_io_block("Outputs", model_info.outputs),
        *_symbol_block(model_info),
        " *",
        " * Shapes: ? marks a symbolic dim (-1 in the *_info functions). dtype values are ONNX TensorProto codes",
        " * (CUVIL_DTYPE_* below). Link with -l<name> (the library needs only libc, libm and libpthread).",
        " *",
        " * Usage:",
        f" *   {p}_session *s = {p}_session_create(0);           (0 = all cores; NULL on failure: see {p}_last_error())",
        f" *   cuvil_tensor in[{max(1, len(model_info.inputs))}] = {{...}}, out[{max(1, len(model_info.outputs))}] = {{...}};"
        "     (caller-owned data and shapes)",
        f" *   int rc = {p}_run(s, in, out);                       (0, or a negative CUVIL_ERR_* code)",
        f" *   if (rc) fprintf(stderr, \"%s: %s\\n\", {p}_strerror(rc), {p}_last_error());",
        f" *   {p}_session_destroy(s);",
        " *",
        f" * {p}_run checks every tensor (NULL pointers, dtype, ndim, each dim, element alignment, output overlap)",
        " * before touching any output, and never crashes on bad input. A session must not be used by two threads",
        " * at once (it reports CUVIL_ERR_BUSY); different sessions are independent. */",
        f"#ifndef {guard}",
        f"#define {guard}",
        "",
        "#include <stddef.h>",
        "#include <stdint.h>",
        "",
        "#ifdef __cplusplus",
        'extern "C" {',
        "#endif",
        "",
        "#ifndef CUVIL_TENSOR_DEFINED",
        "#define CUVIL_TENSOR_DEFINED",
        "/* dtype: ONNX TensorProto code; shape: ndim entries (may be NULL when ndim == 0); data: dense, row-major,",
        " * aligned to the element size. */",
        "typedef struct { void *data; int32_t dtype; int32_t ndim; int64_t *shape; } cuvil_tensor;",
        "typedef struct cuvil_session cuvil_session;",
        "#endif",
        "",
        "#ifndef CUVIL_DTYPE_CODES_DEFINED",
        "#define CUVIL_DTYPE_CODES_DEFINED",
        *[f"#define CUVIL_DTYPE_{name.upper()} {code}" for code, name in sorted(ABI_DTYPES.items())],
        "#endif",
        "",
        "#ifndef CUVIL_ERROR_CODES_DEFINED",
        "#define CUVIL_ERROR_CODES_DEFINED",
        *[f"#define {name} ({code})  /* {msg} */" for name, code, msg in ERROR_CODES],
        "#endif",
        "",
    ]
    if p != "cuvil":
        lines += [f"typedef cuvil_tensor {p}_tensor;", f"typedef cuvil_session {p}_session;", ""]
    session = "cuvil_session"
    lines += [
        f"int            {p}_num_inputs(void);",
        f"int            {p}_num_outputs(void);",
        "/* NULL for i out of range */",
        f"const char    *{p}_input_name(int i);",
        f"const char    *{p}_output_name(int i);",
        "/* Any out pointer may be NULL (shape NULL to query ndim first); -1 marks a symbolic dim.",
        " * 0, or CUVIL_ERR_INDEX for a bad i. */",
        f"int            {p}_input_info(int i, int32_t *dtype, int32_t *ndim, int64_t *shape);",
        f"int            {p}_output_info(int i, int32_t *dtype, int32_t *ndim, int64_t *shape);",
        "/* num_threads: 0 = all cores available to the process, 1 = no worker threads. NULL on failure. */",
        f"{session} *{p}_session_create(int num_threads);",
        "/* Shape of output i for these inputs (inputs may be NULL when the model has no symbolic dims). */",
        f"int            {p}_output_shape({session} *s, const cuvil_tensor *inputs, int i, int64_t *shape);",
        "/* Runs the model; the caller owns every buffer. Does not allocate. 0 or a negative CUVIL_ERR_* code. */",
        f"int            {p}_run({session} *s, const cuvil_tensor *inputs, cuvil_tensor *outputs);",
        "/* Fixed message for a status code (every non-zero return has one). */",
        f"const char    *{p}_strerror(int code);",
        "/* Extension: the specifics of the last failing call on the calling thread, e.g.",
        " * \"input 0 'data': dim 2 is 225, expected 224\" (\"\" if none yet). Valid until the next failing call. */",
        f"const char    *{p}_last_error(void);",
        "/* Frees s. Afterwards s is dead: any call with it returns CUVIL_ERR_BAD_SESSION, a second destroy frees",
        " * nothing (so does one of a pointer this library never returned); NULL is ignored. */",
        f"void           {p}_session_destroy({session} *s);",
        f"int            {p}_profile({session} *s, int64_t *step_ns, int32_t capacity);  /* per-step time of later runs */",
        "/* Extension: the shape symbols (number; i's name and profile). 0, or CUVIL_ERR_INDEX for a bad i. */",
        f"int            {p}_num_symbols(void);",
        f"int            {p}_symbol_info(int i, const char **name, int64_t *min, int64_t *opt, int64_t *max);",
        "/* Extension: external weights (docs/weights.md). weights_info: 1 when the weights are in libNAME.weights",
        " * and must be bound before the first session_create (nbytes, sha256[32] filled; either may be NULL), 0 when",
        " * they are embedded. bind_weights: data = the file's payload (64-byte aligned, kept alive and unchanged),",
        " * nbytes = weights_info's; 0, or CUVIL_ERR_WEIGHTS_MISMATCH (size or SHA-256), CUVIL_ERR_ALIGN,",
        " * CUVIL_ERR_BUSY (sessions live), CUVIL_ERR_UNSUPPORTED (embedded weights). Without it, session_create",
        " * returns NULL (CUVIL_ERR_WEIGHTS_UNBOUND in last_error). */",
        f"int            {p}_weights_info(int64_t *nbytes, uint8_t *sha256);",
        f"int            {p}_bind_weights(const void *data, size_t nbytes);",
        *_lora_block(model_info, p, session),
        "",
        "#ifdef __cplusplus",
        "}",
        "#endif",
        "",
        f"#endif /* {guard} */",
        "",
    ]
    return "\n".join(lines)
