/* Runs a Cuvil-compiled model from C: reads each input from a raw little-endian file whose size must
 * match the model's (static) input shape, runs once, prints every output's shape, first values and argmax.
 *
 *   cuvil compile --input model.onnx --output build/libmodel.so
 *   cc -O2 examples/c/run_model.c -Ibuild -Lbuild -lmodel -Wl,-rpath,"$PWD/build" -o run_model
 *   ./run_model input0.bin [input1.bin ...]
 *
 * The model's header is included as "model.h"; compile with -DMODEL_HEADER='"libNAME.h"' for another. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MODEL_HEADER
#define MODEL_HEADER "libmodel.h"
#endif
#include MODEL_HEADER

static size_t elem_size(int32_t dtype) {
    switch (dtype) {
    case 1: case 6: case 12: return 4;      /* float, int32, uint32 */
    case 7: case 11: case 13: return 8;     /* int64, double, uint64 */
    case 2: case 3: case 9: return 1;       /* uint8, int8, bool */
    case 4: case 5: case 10: case 16: return 2;
    default: return 0;
    }
}

int main(int argc, char **argv) {
    int ni = cuvil_num_inputs(), no = cuvil_num_outputs();
    if (argc != ni + 1) {
        fprintf(stderr, "usage: %s", argv[0]);
        for (int i = 0; i < ni; i++) fprintf(stderr, " %s.bin", cuvil_input_name(i));
        fprintf(stderr, "\n");
        return 2;
    }
    cuvil_tensor *in = calloc((size_t)ni, sizeof *in), *out = calloc((size_t)no, sizeof *out);
    for (int i = 0; i < ni; i++) {
        int32_t ndim = 0;
        cuvil_input_info(i, &in[i].dtype, &ndim, NULL);
        in[i].ndim = ndim;
        in[i].shape = calloc((size_t)ndim + 1, sizeof(int64_t));
        cuvil_input_info(i, &in[i].dtype, &in[i].ndim, in[i].shape);
        size_t n = elem_size(in[i].dtype);
        for (int d = 0; d < ndim; d++) n *= (size_t)in[i].shape[d];
        in[i].data = malloc(n ? n : 1);
        FILE *f = fopen(argv[i + 1], "rb");
        if (!f || fread(in[i].data, 1, n, f) != n) {
            fprintf(stderr, "%s: cannot read %zu bytes for input '%s'\n", argv[i + 1], n, cuvil_input_name(i));
            return 1;
        }
        fclose(f);
    }
    for (int j = 0; j < no; j++) {
        int32_t ndim = 0;
        cuvil_output_info(j, &out[j].dtype, &ndim, NULL);
        out[j].ndim = ndim;
        out[j].shape = calloc((size_t)ndim + 1, sizeof(int64_t));
        cuvil_output_info(j, &out[j].dtype, &out[j].ndim, out[j].shape);
        size_t n = elem_size(out[j].dtype);
        for (int d = 0; d < ndim; d++) n *= (size_t)out[j].shape[d];
        out[j].data = malloc(n ? n : 1);
    }
    cuvil_session *s = cuvil_session_create(0);
    if (!s) { fprintf(stderr, "session: %s\n", cuvil_last_error()); return 1; }
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
