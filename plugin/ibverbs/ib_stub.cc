// Built in place of the ibverbs backend (ib_*.cc) when rdma-core's headers were not found (meson
// option `ibverbs`): the verbs backend is never usable and the socket backend serves every
// request.
#include "plugin/net_backend.h"

namespace dq::net {

NetBackend& ib_backend() {
  return socket_backend();
}

bool ib_usable(std::string* why) {
  *why = "this build has no ibverbs backend (rdma-core headers were not found at configure time)";
  return false;
}

}  // namespace dq::net
