// nccl.h where no NVIDIA NCCL is installed (tools/perf/meson.build): the NCCL API as this tree
// declares it (common/nccl_api.h), which the CPU NCCL implements. dynamiq-perf and dynamiq-demo
// build on it and link the CPU NCCL; at run time any libnccl.so.2 on the library path serves them.
#pragma once
#include "common/nccl_api.h"
