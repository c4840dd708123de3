// One linear y = x W^T through ggml's CPU backend, as stable-diffusion.cpp runs it, timed.
//
//   ggml_linear VARIANT T K N THREADS REPS DIR
//
// DIR holds x.f32 (T x K floats) and, per variant, w.f32 (N x K: one row per output) for f32 / f16 / q8_0,
// or wq.i8 (N x K int8, already rotated) + ws.f32 (N scales) for i8convrot. i8convrot is sd.cpp's int8
// ConvRot linear: ggml_quantize_i8_convrot (group-256 regular Hadamard + per-row int8, one op) then
// ggml_mul_mat_i8_tensorwise on the packed codes; it needs a ggml carrying those two ops (sd.cpp's ggml fork,
// or the same ops put into upstream ggml: see build.sh). i8quant times the quantize op alone.
// Writes DIR/y_VARIANT.f32 once and prints one line of JSON: every rep's milliseconds.
#include "ggml.h"
#include "ggml-cpu.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static void * read_all(const char * dir, const char * name, size_t bytes) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE * f = fopen(path, "rb");
    if (!f) { fprintf(stderr, "cannot open %s\n", path); exit(2); }
    void * buf = malloc(bytes);
    if (fread(buf, 1, bytes, f) != bytes) { fprintf(stderr, "short read %s\n", path); exit(2); }
    fclose(f);
    return buf;
}

static double now_ms(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

int main(int argc, char ** argv) {
    if (argc != 8) { fprintf(stderr, "usage: ggml_linear VARIANT T K N THREADS REPS DIR\n"); return 2; }
    const char * variant = argv[1];
    const int64_t T = atoll(argv[2]), K = atoll(argv[3]), N = atoll(argv[4]);
    const int threads = atoi(argv[5]), reps = atoi(argv[6]);
    const char * dir = argv[7];
    const int group = 256;  // H256: the group size the docs call the common one

    // weights + activations + output + packed codes, twice over for ggml's own padding and work buffer
    const size_t mem = (size_t)(T * K * 4 + N * K * 4 + T * N * 4 + (T + 8) * K + N * 4) * 2 + (64u << 20);
    struct ggml_init_params ip = { mem, NULL, false };
    struct ggml_context * ctx = ggml_init(ip);
    ggml_cpu_init();

    float * xs = read_all(dir, "x.f32", (size_t)T * K * 4);
    struct ggml_tensor * x = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, K, T);
    memcpy(x->data, xs, (size_t)T * K * 4);
    struct ggml_tensor * y = NULL;

    if (!strcmp(variant, "i8convrot") || !strcmp(variant, "i8quant")) {
        int8_t * wq = read_all(dir, "wq.i8", (size_t)N * K);
        float * ws = read_all(dir, "ws.f32", (size_t)N * 4);
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, GGML_TYPE_I8, K, N);
        struct ggml_tensor * s = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, N);
        memcpy(w->data, wq, (size_t)N * K);
        memcpy(s->data, ws, (size_t)N * 4);
        struct ggml_tensor * q = ggml_quantize_i8_convrot(ctx, x, group);
        y = !strcmp(variant, "i8quant") ? q : ggml_mul_mat_i8_tensorwise(ctx, w, q, s, NULL, group);
    } else {
        float * wf = read_all(dir, "w.f32", (size_t)N * K * 4);
        enum ggml_type t = !strcmp(variant, "f32") ? GGML_TYPE_F32 : !strcmp(variant, "f16") ? GGML_TYPE_F16
                         : !strcmp(variant, "q8_0") ? GGML_TYPE_Q8_0 : GGML_TYPE_COUNT;
        if (t == GGML_TYPE_COUNT) { fprintf(stderr, "unknown variant %s\n", variant); return 2; }
        struct ggml_tensor * w = ggml_new_tensor_2d(ctx, t, K, N);
        if (t == GGML_TYPE_F32) memcpy(w->data, wf, (size_t)N * K * 4);
        else if (t == GGML_TYPE_F16) ggml_fp32_to_fp16_row(wf, w->data, N * K);
        else ggml_quantize_chunk(t, wf, w->data, 0, N, K, NULL);
        y = ggml_mul_mat(ctx, w, x);
    }

    struct ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, y);
    printf("{\"variant\": \"%s\", \"tokens\": %lld, \"k\": %lld, \"n\": %lld, \"threads\": %d, \"ms\": [",
           variant, (long long)T, (long long)K, (long long)N, threads);
    for (int r = 0; r < reps; ++r) {
        const double t0 = now_ms();
        if (ggml_graph_compute_with_ctx(ctx, gf, threads) != GGML_STATUS_SUCCESS) { fprintf(stderr, "compute failed\n"); return 1; }
        printf("%s%.2f", r ? ", " : "", now_ms() - t0);
        fflush(stdout);
    }
    printf("]}\n");
    if (y->type == GGML_TYPE_F32) {
        char path[4096];
        snprintf(path, sizeof path, "%s/y_%s.f32", dir, variant);
        FILE * f = fopen(path, "wb");
        fwrite(y->data, 4, (size_t)T * N, f);
        fclose(f);
    }
    ggml_free(ctx);
    return 0;
}
