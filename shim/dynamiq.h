/* dynamiq's public C API, exported by libdynamiq.so next to the interposed NCCL functions.
 * Frameworks that load the library (LD_PRELOAD, or dlopen before NCCL) can find these with
 * dlsym(RTLD_DEFAULT, "dynamiqCommRegister"). */
#ifndef DYNAMIQ_SHIM_DYNAMIQ_H_
#define DYNAMIQ_SHIM_DYNAMIQ_H_

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

/* Rewrites DYNAMIQ_METRICS_FILE now. Returns 0. */
int dynamiqMetricsFlush(void);

#ifdef __cplusplus
}
#endif

#endif /* DYNAMIQ_SHIM_DYNAMIQ_H_ */
