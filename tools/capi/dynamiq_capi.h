/* C API over the core library for Python (ctypes) and other foreign callers: runs one
 * all-reduce of n worker rows through a codec and schedule exactly as the simulator and the
 * engine do. Every function returns 0 on success or a dq::Status code (see dq_status_name);
 * no C++ exception crosses this boundary. */
#ifndef DYNAMIQ_TOOLS_CAPI_DYNAMIQ_CAPI_H_
#define DYNAMIQ_TOOLS_CAPI_DYNAMIQ_CAPI_H_
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Bumped whenever a signature or dq_sim_stats changes. */
#define DQ_CAPI_ABI_VERSION 2 /* 2: dq_auto_choose */

typedef struct dq_sim_stats {
  double vnmse;               /* ||result - exact||^2 / ||exact||^2, exact in FP64 */
  double bits_per_coord;      /* one compressed copy of the vector, statistics included */
  double wire_bits_per_coord; /* bytes each worker sends over all hops, per coordinate, x8 */
  double seconds;             /* wall time of the simulated all-reduce */
  int32_t budget_honest;      /* 0 when the tensor is too small for the codec's budget */
} dq_sim_stats;

int dq_capi_abi_version(void);

/* Name of a result code ("ok", "invalid-argument", ...); never NULL. */
const char* dq_status_name(int code);

/* Caps the worker threads the core library uses (0 = no cap). Process-wide. */
int dq_set_max_threads(int threads, char* err, size_t err_len);

/* All-reduces rows[0..n_workers-1] (d floats each) with codec_spec ("dynamiq:5", "mxfp8",
 * "mxfp6", "mxfp4", "bf16", "uniform:5", ...) over topo ("ring" or "butterfly").
 * average != 0 divides the sum by n_workers. out (d floats) receives the decoded result every
 * worker would hold; it may be NULL when only the statistics are wanted. stats may be NULL.
 * seed and call key the rounding randomness (use call = training step). On failure err
 * (err_len bytes, may be NULL) receives a message naming what was wrong. */
int dq_allreduce_sim(const char* codec_spec, const char* topo, int n_workers,
                     const float* const* rows, size_t d, uint64_t seed, uint64_t call, int average,
                     float* out, dq_sim_stats* stats, char* err, size_t err_len);

/* The codec DYNAMIQ_BITS=auto with DYNAMIQ_TARGET=target ("mxfp8", "mxfp6", "vnmse:X") chooses
 * for the next call of a bucket whose previous call all-reduced rows[0..n_workers-1] (d floats
 * each) over topo, from that call's all-reduced statistics as the engine does: spec_out
 * (spec_len bytes) receives "dynamiq:<bits>", "mxfp6" or "mxfp8"; predicted_vnmse (may be NULL)
 * the model's vNMSE for it. invalid-argument when a statistic is not finite (the engine then
 * keeps the fixed budget). */
int dq_auto_choose(const char* target, const char* topo, int n_workers, const float* const* rows,
                   size_t d, char* spec_out, size_t spec_len, double* predicted_vnmse, char* err,
                   size_t err_len);

#ifdef __cplusplus
}
#endif
#endif /* DYNAMIQ_TOOLS_CAPI_DYNAMIQ_CAPI_H_ */
