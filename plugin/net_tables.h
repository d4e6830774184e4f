// The ncclNet function tables of every supported ABI version, all over one backend.
// plugin/abi/ exports copies of them from libnccl-net-dynamiq.so; in-process users (tests, the
// CPU NCCL) may call them directly.
#pragma once

#include "plugin/net_abi.h"

namespace dq::net {

const dqNetV11& NetTableV11();
const dqNetV10& NetTableV10();
const dqNetV9& NetTableV9();
const dqNetV8& NetTableV8();

}  // namespace dq::net
