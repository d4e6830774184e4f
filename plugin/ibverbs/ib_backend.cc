// ibverbs backend of the net plugin: RC queue pairs, the receiver posting its buffers into a
// remote-writable FIFO on the sender, the sender writing with RDMA WRITE (+ immediate). Wire
// formats and the protocol: ib_wire.h; the backend's types: ib_internal.h, which lists the files
// its calls live in. This file: the close calls and the backend's instance.
#include "plugin/ibverbs/ib_internal.h"

namespace dq::net {
namespace ib {

Status IbNet::close_send(void* send_comm) {
  return close_comm(static_cast<SendComm*>(send_comm), kSendMagic,
                    "closeSend: not a verbs send comm", [](SendComm* sc) { sc->close(); });
}

Status IbNet::close_recv(void* recv_comm) {
  return close_comm(static_cast<RecvComm*>(recv_comm), kRecvMagic,
                    "closeRecv: not a verbs receive comm", [](RecvComm* rc) { rc->close(); });
}

Status IbNet::close_listen(void* listen_comm) {
  // The pending accepts and the side-channel listener close in ~ListenComm.
  return close_comm(static_cast<ListenComm*>(listen_comm), kListenMagic,
                    "closeListen: not a verbs listen comm", [](ListenComm*) {});
}

IbNet& ib_net() {
  static IbNet* backend = new IbNet;  // never destroyed: comms may outlive statics
  return *backend;
}

}  // namespace ib

NetBackend& ib_backend() {
  return ib::ib_net();
}

bool ib_usable(std::string* why) {
  if (ib::ib_net().init() == Status::kOk) return true;
  *why = ib::ib_net().why();
  return false;
}

}  // namespace dq::net
