// The ncclNet function tables of every supported ABI version, all over one backend.
// plugin/abi/ exports copies of them from libnccl-net-dynamiq.so; in-process users (tests, the
// CPU NCCL) may call them directly.
#pragma once

#include "plugin/net_abi.h"

namespace dq::net {

const dqNetV11& net_table_v11();
const dqNetV10& net_table_v10();
const dqNetV9& net_table_v9();
const dqNetV8& net_table_v8();

}  // namespace dq::net
