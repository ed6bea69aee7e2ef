/* Runs a Cuvil-compiled model from C: reads each input from a file, runs once, prints every output's shape,
 * argmax and first values.
 *
 *   cuvil compile model.onnx -o build/libmodel.so
 *   cc -O2 examples/c/run_model.c -DMODEL_HEADER='"libmodel.h"' -Ibuild -Lbuild -lmodel -Wl,-rpath,"$PWD/build" -o run_model
 *   ./run_model x.npy [more inputs, in the model's order]
 *
 * An input file is either a .npy (numpy.save: its header's dtype must be the input's, C order, and its shape
 * must have the input's rank and fixed dims; symbolic dims take the file's values, which the library checks
 * against its profile) or raw little-endian data of the input's element type, whose size must be exactly the
 * input's (only for inputs without symbolic dims: raw data carry no shape). Bad input: a message naming the
 * file and what it should be, exit status 2; a failed run: the library's message, exit status 1.
 *
 * A library compiled with --external-weights has its weights in libNAME.weights beside it: this program
 * maps that file read-only and shared (every process running the model shares its pages) and hands the
 * weights to the library with cuvil_bind_weights before creating a session (bind_weights, below; the file's
 * format is in docs/weights.md). Encrypted weights are decrypted by Python's cuvil.load(..., weights_key=).
 *
 * The model's header is included as "libmodel.h"; compile with -DMODEL_HEADER='"libNAME.h"' for another. */
#define _GNU_SOURCE 1                                  /* dladdr: where the library was loaded from */
#include <dlfcn.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MODEL_HEADER
#define MODEL_HEADER "libmodel.h"
#endif
#include MODEL_HEADER

#define MAX_DIMS 16

/* ONNX TensorProto codes this program reads and prints, with numpy's descr for each (little-endian host). */
static const struct { int32_t dtype; size_t size; const char *descr, *name; } DTYPES[] = {
    {1, 4, "<f4", "float32"}, {2, 1, "|u1", "uint8"},  {3, 1, "|i1", "int8"},   {4, 2, "<u2", "uint16"},
    {5, 2, "<i2", "int16"},   {6, 4, "<i4", "int32"},  {7, 8, "<i8", "int64"},  {9, 1, "|b1", "bool"},
    {10, 2, "<f2", "float16"}, {11, 8, "<f8", "float64"}, {12, 4, "<u4", "uint32"}, {13, 8, "<u8", "uint64"},
};

static int dtype_index(int32_t dtype) {
    for (size_t k = 0; k < sizeof DTYPES / sizeof DTYPES[0]; k++) if (DTYPES[k].dtype == dtype) return (int)k;
    return -1;
}

static void print_shape(FILE *f, int ndim, const int64_t *shape) {
    fprintf(f, "[");
    for (int d = 0; d < ndim; d++) fprintf(f, d ? ", %lld" : "%lld", (long long)shape[d]);
    fprintf(f, "]");
}

static long file_size(FILE *f) {
    if (fseek(f, 0, SEEK_END) != 0) return -1;
    long n = ftell(f);
    return fseek(f, 0, SEEK_SET) == 0 ? n : -1;
}

/* The value text after 'key': in a .npy header dict, or NULL. */
static const char *npy_field(const char *header, const char *key) {
    char quoted[32];
    snprintf(quoted, sizeof quoted, "'%s'", key);
    const char *p = strstr(header, quoted);
    if (!p) return NULL;
    p += strlen(quoted);
    while (*p == ' ' || *p == ':') p++;
    return p;
}

/* Parses a .npy header (format versions 1 to 3) from f, positioned after it on success. Returns 0, or 2
 * after printing what is wrong with the file. */
static int read_npy_header(FILE *f, const char *path, char *descr, size_t descr_cap, int *fortran,
                           int *ndim, int64_t *shape) {
    unsigned char pre[10];
    if (fread(pre, 1, 8, f) != 8) goto bad;
    int major = pre[6];
    size_t len;
    if (major == 1) {
        if (fread(pre + 8, 1, 2, f) != 2) goto bad;
        len = (size_t)pre[8] | (size_t)pre[9] << 8;
    } else if (major == 2 || major == 3) {
        unsigned char l4[4];
        if (fread(l4, 1, 4, f) != 4) goto bad;
        len = (size_t)l4[0] | (size_t)l4[1] << 8 | (size_t)l4[2] << 16 | (size_t)l4[3] << 24;
    } else {
        fprintf(stderr, "%s: .npy format version %d.%d is not one this program reads (1.0 to 3.0)\n", path, pre[6], pre[7]);
        return 2;
    }
    if (len > (1u << 20)) goto bad;
    char *header = malloc(len + 1);
    if (!header || fread(header, 1, len, f) != len) { free(header); goto bad; }
    header[len] = 0;
    const char *d = npy_field(header, "descr"), *fo = npy_field(header, "fortran_order"), *sh = npy_field(header, "shape");
    if (!d || *d != '\'' || !fo || !sh || *sh != '(') { free(header); goto bad; }
    size_t n = strcspn(d + 1, "'");
    if (n >= descr_cap) n = descr_cap - 1;
    memcpy(descr, d + 1, n);
    descr[n] = 0;
    *fortran = strncmp(fo, "True", 4) == 0;
    *ndim = 0;
    for (const char *p = sh + 1; *p && *p != ')';) {
        char *end;
        long long v = strtoll(p, &end, 10);
        if (end == p) { if (*p == ',' || *p == ' ') { p++; continue; } free(header); goto bad; }
        if (*ndim == MAX_DIMS) { free(header); goto bad; }
        shape[(*ndim)++] = v;
        p = end;
    }
    free(header);
    return 0;
bad:
    fprintf(stderr, "%s: starts like a .npy file but its header cannot be read (write it with numpy.save)\n", path);
    return 2;
}

/* Reads input i from path into t (data and shape allocated here). Returns 0, or 2 after printing why. */
static int read_input(int i, const char *path, cuvil_tensor *t) {
    const char *name = cuvil_input_name(i);
    int32_t ndim = 0;
    int64_t want[MAX_DIMS];
    cuvil_input_info(i, &t->dtype, &ndim, NULL);
    if (ndim > MAX_DIMS) { fprintf(stderr, "input '%s' has %d dims, more than this program handles\n", name, ndim); return 2; }
    cuvil_input_info(i, &t->dtype, &ndim, want);
    int k = dtype_index(t->dtype);
    if (k < 0) { fprintf(stderr, "input '%s' has element type %d, which this program does not read\n", name, t->dtype); return 2; }
    t->ndim = ndim;
    t->shape = calloc((size_t)ndim + 1, sizeof(int64_t));
    memcpy(t->shape, want, (size_t)ndim * sizeof(int64_t));
    FILE *f = fopen(path, "rb");
    if (!f) { perror(path); return 2; }
    long size = file_size(f);
    unsigned char magic[6] = {0};
    size_t got = fread(magic, 1, 6, f);
    rewind(f);
    long data_bytes = size;
    if (got == 6 && memcmp(magic, "\x93NUMPY", 6) == 0) {
        char descr[16];
        int fortran = 0, fndim = 0;
        int64_t fshape[MAX_DIMS];
        if (read_npy_header(f, path, descr, sizeof descr, &fortran, &fndim, fshape)) { fclose(f); return 2; }
        int ok = fndim == ndim;
        for (int d = 0; ok && d < ndim; d++) ok = want[d] < 0 ? fshape[d] >= 0 : fshape[d] == want[d];
        if (strcmp(descr, DTYPES[k].descr) != 0) {
            fprintf(stderr, "%s: dtype '%s', but input '%s' is %s ('%s'): save it with .astype('%s')\n",
                    path, descr, name, DTYPES[k].name, DTYPES[k].descr, DTYPES[k].name);
            fclose(f);
            return 2;
        }
        if (fortran) {
            fprintf(stderr, "%s: Fortran order; input '%s' needs C order: save numpy.ascontiguousarray(x)\n", path, name);
            fclose(f);
            return 2;
        }
        if (!ok) {
            fprintf(stderr, "%s: shape ", path);
            print_shape(stderr, fndim, fshape);
            fprintf(stderr, ", but input '%s' is ", name);
            print_shape(stderr, ndim, want);
            int symbolic = 0;
            for (int d = 0; d < ndim; d++) symbolic |= want[d] < 0;
            fprintf(stderr, symbolic ? " (-1: any size the library's profile allows)\n" : "\n");
            fclose(f);
            return 2;
        }
        memcpy(t->shape, fshape, (size_t)ndim * sizeof(int64_t));
        data_bytes = size - ftell(f);
    } else {
        for (int d = 0; d < ndim; d++) {
            if (want[d] < 0) {
                fprintf(stderr, "%s: raw data carry no shape, and input '%s' ", path, name);
                print_shape(stderr, ndim, want);
                fprintf(stderr, " has symbolic dims (-1): give a .npy file (numpy.save)\n");
                fclose(f);
                return 2;
            }
        }
    }
    size_t n = DTYPES[k].size;
    for (int d = 0; d < ndim; d++) n *= (size_t)t->shape[d];
    if (data_bytes != (long)n) {
        fprintf(stderr, "%s: %ld bytes of data, but input '%s' ", path, data_bytes, name);
        print_shape(stderr, ndim, t->shape);
        fprintf(stderr, " %s needs exactly %zu (%s)\n", DTYPES[k].name, n,
                data_bytes < (long)n ? "truncated file?" : "trailing bytes: a different shape or dtype?");
        fclose(f);
        return 2;
    }
    t->data = malloc(n ? n : 1);
    size_t read = fread(t->data, 1, n, f);
    fclose(f);
    if (read != n) { fprintf(stderr, "%s: cannot read %zu bytes\n", path, n); return 2; }
    return 0;
}

/* For a library compiled with --external-weights: maps libNAME.weights (found beside the library) and binds
 * its payload. Returns 0 (also when the library embeds its weights), or 1 after printing why. The mapping
 * stays until the process exits: the library reads it for as long as sessions run. */
static int bind_weights(void) {
  int64_t nbytes = 0;
  if (cuvil_weights_info(&nbytes, NULL) != 1) return 0;          /* embedded */
  Dl_info where;
  if (!dladdr((void *)cuvil_weights_info, &where) || !where.dli_fname) {
    fprintf(stderr, "cannot find where the model library was loaded from\n");
    return 1;
  }
  char path[4096];
  size_t len = strlen(where.dli_fname);
  if (len < 3 || len + 6 >= sizeof path || strcmp(where.dli_fname + len - 3, ".so") != 0) {
    fprintf(stderr, "%s: not a libNAME.so path\n", where.dli_fname);
    return 1;
  }
  memcpy(path, where.dli_fname, len - 3);
  strcpy(path + len - 3, ".weights");
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  struct stat st;
  if (fd < 0 || fstat(fd, &st) != 0) { perror(path); return 1; }
  /* header: "CUVILWTS", u32 version, u32 flags (1 = encrypted), u64 header_bytes, u64 plain_bytes, ... */
  unsigned char head[40];
  uint32_t version, flags;
  uint64_t header_bytes, plain_bytes;
  if (st.st_size < (off_t)sizeof head || pread(fd, head, sizeof head, 0) != (ssize_t)sizeof head ||
      memcmp(head, "CUVILWTS", 8) != 0) {
    fprintf(stderr, "%s: not a Cuvil weights file\n", path);
    return 1;
  }
  memcpy(&version, head + 8, 4);
  memcpy(&flags, head + 12, 4);
  memcpy(&header_bytes, head + 16, 8);
  memcpy(&plain_bytes, head + 24, 8);
  if (version != 1 || (flags & 1)) {
    fprintf(stderr, "%s: %s\n", path, version != 1 ? "weights format version is not 1"
                                                    : "encrypted weights: load them with cuvil.load(..., weights_key=)");
    return 1;
  }
  if (header_bytes > (uint64_t)st.st_size || plain_bytes != (uint64_t)st.st_size - header_bytes) {
    fprintf(stderr, "%s: %lld bytes, the header says %llu (truncated?)\n", path, (long long)st.st_size,
            (unsigned long long)(header_bytes + plain_bytes));
    return 1;
  }
  void *map = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_SHARED, fd, 0);
  close(fd);
  if (map == MAP_FAILED) { perror(path); return 1; }
  /* the library checks the size and the SHA-256 it embeds: another model's weights are refused */
  int rc = cuvil_bind_weights((const char *)map + header_bytes, (size_t)plain_bytes);
  if (rc) { fprintf(stderr, "%s: %s: %s\n", path, cuvil_strerror(rc), cuvil_last_error()); return 1; }
  return 0;
}

int main(int argc, char **argv) {
    int ni = cuvil_num_inputs(), no = cuvil_num_outputs();
    if (argc != ni + 1) {
        fprintf(stderr, "usage: %s", argv[0]);
        for (int i = 0; i < ni; i++) fprintf(stderr, " %s.npy", cuvil_input_name(i));
        fprintf(stderr, "\n  each input a .npy file (numpy.save) or raw little-endian data of the input's exact size\n");
        return 2;
    }
    cuvil_tensor *in = calloc((size_t)ni, sizeof *in), *out = calloc((size_t)no, sizeof *out);
    for (int i = 0; i < ni; i++)
        if (read_input(i, argv[i + 1], &in[i])) return 2;
    if (bind_weights()) return 1;
    cuvil_session *s = cuvil_session_create(0);
    if (!s) { fprintf(stderr, "session: %s\n", cuvil_last_error()); return 1; }
    for (int j = 0; j < no; j++) {
        int32_t ndim = 0;
        cuvil_output_info(j, &out[j].dtype, &ndim, NULL);
        out[j].ndim = ndim;
        out[j].shape = calloc((size_t)ndim + 1, sizeof(int64_t));
        /* the dims these inputs give (symbolic dims bound, run-time sizes at their bound) */
        int rc = cuvil_output_shape(s, in, j, out[j].shape);
        if (rc) { fprintf(stderr, "%s: %s\n", cuvil_strerror(rc), cuvil_last_error()); return 1; }
        int k = dtype_index(out[j].dtype);
        size_t n = k < 0 ? 8 : DTYPES[k].size;
        for (int d = 0; d < ndim; d++) n *= (size_t)out[j].shape[d];
        out[j].data = malloc(n ? n : 1);
    }
    int rc = cuvil_run(s, in, out);
    if (rc) { fprintf(stderr, "run failed: %s: %s\n", cuvil_strerror(rc), cuvil_last_error()); return 1; }
    for (int j = 0; j < no; j++) {
        size_t n = 1;
        printf("%s shape [", cuvil_output_name(j));
        for (int d = 0; d < out[j].ndim; d++) { printf(d ? ",%lld" : "%lld", (long long)out[j].shape[d]); n *= (size_t)out[j].shape[d]; }
        printf("]");
        if (out[j].dtype == 1) {
            const float *y = out[j].data;
            size_t best = 0;
            for (size_t k = 0; k < n; k++) if (y[k] > y[best]) best = k;
            printf(" argmax %zu values", best);
            for (size_t k = 0; k < n && k < 10; k++) printf(" %.6g", y[k]);
        }
        printf("\n");
    }
    cuvil_session_destroy(s);
    for (int i = 0; i < ni; i++) { free(in[i].data); free(in[i].shape); }
    for (int j = 0; j < no; j++) { free(out[j].data); free(out[j].shape); }
    free(in);
    free(out);
    return 0;
}
