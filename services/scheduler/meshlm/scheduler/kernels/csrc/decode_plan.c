/* One decode forward's kernel calls, replayed from C: the CPU counterpart of a CUDA graph.
 *
 * A decode step of a small model on two cores is ~270 calls of our C kernels (30 layers x
 * norm, qkv, RoPE, attention, o, norm, gate_up, SiLU*mul, down); from Python each costs a
 * module call, argument checks, a torch allocation and a ctypes conversion, together ~20 us,
 * which is 5-8 ms a step. Here the calls are a list of ops, each a kernel's address and its
 * arguments, built once by Python over fixed buffers (model_executor/cpu_graph_runner.py), and
 * meshlm_decode_plan_run makes the whole list in one call.
 *
 * An op's arguments are the kernel's own, in the kernel's order, as int64 slots a[] (pointers
 * and integers) and one float f; the row count (the batch) and the thread count are given to
 * the run, not stored. An op runs for batches of min_rows .. max_rows rows only, so a linear can
 * name one kernel for small batches and another for the rest.
 *
 * The kernels live in their own libraries; this file knows their signatures (the kinds below),
 * not their code.
 */
#include <omp.h>
#include <stddef.h>
#include <stdint.h>

enum {
    OP_ADD_RMSNORM = 0, /* kernels/csrc/cpu_ops.c */
    OP_ROPE_NEOX = 1,
    OP_SILU_MUL = 2,
    OP_GEMM_AMX = 3,   /* kernels/csrc/gemm_amx.c */
    OP_GEMM_PANEL = 4, /* kernels/csrc/gemm_bf16.c */
    OP_GEMV_BF16 = 5,  /* kernels/csrc/gemv_bf16.c */
    OP_DECODE_ATTN = 6, /* attention/csrc/decode_attention.c */
    OP_GEMV_F32 = 7,    /* kernels/csrc/gemv.c */
    OP_GEMV_Q4_1 = 8,
    OP_GEMV_Q8_0 = 9,
    OP_GEMM_Q = 10 /* kernels/csrc/gemm_q.c */
};

#define OP_ARGS 26

typedef struct {
    int32_t kind;
    int32_t min_rows, max_rows;
    int32_t reserved;
    void *fn;
    int64_t a[OP_ARGS];
    float f;
} meshlm_op;

typedef int (*add_rmsnorm_fn)(const void *, void *, const void *, void *, int, int64_t, int, int64_t, int64_t,
                              int64_t, float, int, int);
typedef int (*rope_fn)(void *, int, int64_t, int64_t, int, int, int, const int64_t *, const float *, const float *,
                       int64_t, int);
typedef int (*silu_fn)(const void *, void *, int, int64_t, int, int64_t, int64_t, int);
typedef int (*gemm_amx_fn)(const uint16_t *, int64_t, int64_t, const uint16_t *, int64_t, int64_t, const float *,
                           uint16_t *, int);
typedef int (*gemm_panel_fn)(const uint16_t *, int64_t, const int32_t *, const float *, uint16_t *, int64_t, int64_t,
                             int64_t, int);
typedef int (*gemv_bf16_fn)(const uint16_t *, int64_t, const float *, const float *, const void *, int,
                            const float *, uint16_t *, int, int64_t, int, int);
typedef int (*decode_attn_fn)(const void *, int, int64_t, const void *, const void *, int, int64_t, int64_t,
                              const int64_t *, int64_t, int64_t, const int64_t *, const int64_t *, int64_t, int, int,
                              int, float, void *, int, int, const void *, int64_t, const void *, int64_t,
                              const int64_t *, int, int);

typedef int (*gemv_f32_fn)(const float *, int64_t, const float *, const float *, float *, int, int64_t, int, int);
typedef int (*gemv_q4_1_fn)(const float *, int64_t, const float *, const float *, const uint8_t *, const float *,
                            float *, int, int64_t, int, int);
typedef int (*gemv_q8_0_fn)(const float *, int64_t, const float *, const int8_t *, const float *, float *, int,
                            int64_t, int, int);
typedef int (*gemm_q_fn)(int, const float *, int64_t, int64_t, const uint8_t *, const float *, const float *,
                         const float *, float *, int64_t, int64_t, int);

#define P(i) ((void *)(intptr_t)a[i])

static int run_op(const meshlm_op *op, int64_t m, int nt) {
    const int64_t *a = op->a;
    switch (op->kind) {
    case OP_ADD_RMSNORM:
        return ((add_rmsnorm_fn)op->fn)(P(0), P(1), P(2), P(3), (int)a[4], m, (int)a[5], a[6], a[7], a[8], op->f,
                                        (int)a[9], nt);
    case OP_ROPE_NEOX:
        return ((rope_fn)op->fn)(P(0), (int)a[1], m, a[2], (int)a[3], (int)a[4], (int)a[5], P(6), P(7), P(8), a[9],
                                 nt);
    case OP_SILU_MUL:
        return ((silu_fn)op->fn)(P(0), P(1), (int)a[2], m, (int)a[3], a[4], a[5], nt);
    case OP_GEMM_AMX:
        return ((gemm_amx_fn)op->fn)(P(0), a[1], m, P(2), a[3], a[4], P(5), P(6), nt);
    case OP_GEMM_PANEL:
        return ((gemm_panel_fn)op->fn)(P(0), a[1], P(2), P(3), P(4), m, a[5], a[6], nt);
    case OP_GEMV_BF16:
        return ((gemv_bf16_fn)op->fn)(P(0), a[1], P(2), P(3), P(4), (int)a[5], P(6), P(7), (int)m, a[8], (int)a[9],
                                      nt);
    case OP_DECODE_ATTN:
        return ((decode_attn_fn)op->fn)(P(0), (int)a[1], a[2], P(3), P(4), (int)a[5], a[6], a[7], P(8), a[9], a[10],
                                        P(11), P(12), m, (int)a[13], (int)a[14], (int)a[15], op->f, P(16),
                                        (int)a[17], nt, P(19), a[20], P(21), a[22], P(23), (int)a[24], (int)a[25]);
    case OP_GEMV_F32:
        return ((gemv_f32_fn)op->fn)(P(0), a[1], P(2), P(3), P(4), (int)m, a[5], (int)a[6], nt);
    case OP_GEMV_Q4_1:
        return ((gemv_q4_1_fn)op->fn)(P(0), a[1], P(2), P(3), P(4), P(5), P(6), (int)m, a[7], (int)a[8], nt);
    case OP_GEMV_Q8_0:
        return ((gemv_q8_0_fn)op->fn)(P(0), a[1], P(2), P(3), P(4), P(5), (int)m, a[6], (int)a[7], nt);
    case OP_GEMM_Q:
        return ((gemm_q_fn)op->fn)((int)a[0], P(1), a[2], m, P(3), P(4), P(5), P(6), P(7), a[8], a[9], nt);
    default:
        return -1;
    }
}

/* The size of one op, so Python can check its mirror of the struct. */
int64_t meshlm_decode_plan_op_size(void) { return (int64_t)sizeof(meshlm_op); }

/* Runs ops[0 .. n) that take batches of m rows, in order, on num_threads threads; with `seconds`
 * (n doubles, or NULL) adds each op's wall time to seconds[i] (0 for an op skipped at m rows).
 * Returns 0, or (i + 1) * 256 + (rc & 255) for the first op i whose kernel returned rc != 0
 * (nothing after it runs; -1 as rc: an unknown kind). */
static int64_t run_ops(const meshlm_op *ops, int64_t n, int64_t m, int num_threads, double *seconds) {
    for (int64_t i = 0; i < n; i++) {
        if (m < ops[i].min_rows || m > ops[i].max_rows) continue;
        const double t0 = seconds != NULL ? omp_get_wtime() : 0.0;
        const int rc = run_op(&ops[i], m, num_threads);
        if (seconds != NULL) seconds[i] += omp_get_wtime() - t0;
        if (rc != 0) return (i + 1) * 256 + (rc & 255);
    }
    return 0;
}

/* Runs the ops that take batches of m rows (run_ops); the decode step's call. */
int64_t meshlm_decode_plan_run(const meshlm_op *ops, int64_t n, int64_t m, int num_threads) {
    return run_ops(ops, n, m, num_threads, NULL);
}

/* meshlm_decode_plan_run that also adds each op's wall time to seconds[0 .. n): a profile of
 * the plan as it runs (bench/profile_engine.py --cpu-graph). */
int64_t meshlm_decode_plan_run_timed(const meshlm_op *ops, int64_t n, int64_t m, int num_threads, double *seconds) {
    return run_ops(ops, n, m, num_threads, seconds);
}
