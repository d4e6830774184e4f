/* dynamiq's public C API, exported by libdynamiq.so next to the interposed NCCL functions.
 * Frameworks that load the library (LD_PRELOAD, or dlopen before NCCL) can find these with
 * dlsym(RTLD_DEFAULT, "dynamiqCommRegister"). */
#ifndef DYNAMIQ_SHIM_DYNAMIQ_H_
#define DYNAMIQ_SHIM_DYNAMIQ_H_

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Opts communicator `comm` (an ncclComm_t) in (enable = 1) or out (enable = 0) of compression,
 * overriding DYNAMIQ_COMMS. Call it on every rank of the communicator, before its first
 * ncclAllReduce. Returns an ncclResult_t value: 0 on success, 4 (ncclInvalidArgument) for a
 * communicator this process did not create after loading dynamiq, 5 (ncclInvalidUsage) after
 * the first all-reduce. */
int dynamiqCommRegister(void* comm, int enable);

/* Calls on `comm` so far: compressed (rerouted) and passed through to NCCL. Returns 0, or 4 for
 * an unknown communicator. Tools use it to say which calls were compressed. */
int dynamiqCommCounters(void* comm, unsigned long long* rerouted, unsigned long long* passed);

/* Bytes of the caller's buffers in compressed calls on `comm`, and bytes this rank sent for them
 * (every chunk message, plus the statistics as a ring all-reduce would send them). */
int dynamiqCommBytes(void* comm, unsigned long long* bytes_in, unsigned long long* wire_bytes);

/* The budget of compressed DynamiQ calls on `comm` (docs/ENGINE.md section 10), without any
 * communication: `widths` (4 entries, may be NULL) receives the super-groups at 2, 4, 8 and 16
 * bits of every call whose statistics were read (one call of its bucket late), `predicted_calls`
 * their count, `predicted_vnmse_mean` and `predicted_vnmse_last` their mean and latest predicted
 * vNMSE (-1 when none yet), `mean_bits` the mean budget of compressed DynamiQ calls in bits per
 * coordinate (0 when none). Any pointer may be NULL. Returns 0, or 4 for an unknown communicator.
 */
int dynamiqCommBudget(void* comm, unsigned long long* widths, unsigned long long* predicted_calls,
                      double* predicted_vnmse_mean, double* predicted_vnmse_last,
                      double* mean_bits);

/* Auto's MX fallback and the sampled check on `comm` (DYNAMIQ_BITS=auto, DYNAMIQ_CHECK_EVERY;
 * docs/ENGINE.md section 10), without any communication: `mx_calls` the compressed calls auto
 * sent as MXFP8 or MXFP6, `checked_calls` the calls the sampled check measured,
 * `sampled_vnmse` their vNMSE over all samples (-1 when none yet), `paired_calls` the checked
 * calls whose prediction is known and `paired_predicted_mean` / `paired_sampled_mean` the means
 * of their predicted and sampled vNMSE (-1 when none). Any pointer may be NULL. Returns 0, or 4
 * for an unknown communicator. */
int dynamiqCommCheck(void* comm, unsigned long long* mx_calls, unsigned long long* checked_calls,
                     double* sampled_vnmse, unsigned long long* paired_calls,
                     double* paired_predicted_mean, double* paired_sampled_mean);

/* Rewrites DYNAMIQ_METRICS_FILE now. Returns 0 (also when no file is configured), or 2
 * (ncclSystemError) when it could not be written (a warning says why). */
int dynamiqMetricsFlush(void);

/* The metrics file the shim writes (DYNAMIQ_METRICS_FILE expanded: %j, %h, %r, %p, a directory's
   file name) into `path`, NUL-terminated. Returns 0; ncclInvalidArgument (4), with "" in a
   non-empty buffer, when no metrics file is configured or `bytes` cannot hold the path. */
int dynamiqMetricsPath(char* path, size_t bytes);

#ifdef __cplusplus
}
#endif

#endif /* DYNAMIQ_SHIM_DYNAMIQ_H_ */
