// The symbols NCCL looks up after dlopen("libnccl-net-dynamiq.so"): one table per ABI version,
// newest first. Everything else in the library stays hidden (exports.map).
#include "plugin/net_abi.h"
#include "plugin/net_tables.h"

#define DQNET_EXPORT __attribute__((visibility("default")))

extern "C" {
DQNET_EXPORT dqNetV11 ncclNetPlugin_v11 = dq::net::net_table_v11();
DQNET_EXPORT dqNetV10 ncclNetPlugin_v10 = dq::net::net_table_v10();
DQNET_EXPORT dqNetV9 ncclNetPlugin_v9 = dq::net::net_table_v9();
DQNET_EXPORT dqNetV8 ncclNetPlugin_v8 = dq::net::net_table_v8();
}
