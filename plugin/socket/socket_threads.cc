// The I/O threads of a socket connection. A send comm runs one writer per socket, each writing
// its part of every message in seq order (socket 0 with the message header). A receive comm runs
// one reader per socket: socket 0 reads the headers, matches each message to a posted receive
// by tag (or stages it in host memory until one is posted) and reads part 0; socket k reads part
// k of the message its part header names. Every wait is bounded (socket_io.h) by the stop flag
// and the stall bound (DYNAMIQ_NET_TIMEOUT_MS).
#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "plugin/socket/socket_comms.h"

namespace dq::net::sock {

void SendComm::run(int k) {
  int fd = fds[static_cast<size_t>(k)];
  // Bounded by stop/failure; each pass sends one message part or waits one slice.
  for (;;) {
    SendRequest* req = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu);
      while (queues[static_cast<size_t>(k)].empty()) {
        if (stop.load() || failed) return;
        cv.wait_for(lock, std::chrono::milliseconds(kPollSliceMs));
      }
      if (failed) return;
      req = queues[static_cast<size_t>(k)].front();
    }
    const char* body = req->data + req->split.offset(k);
    size_t body_len = req->split.len(k, req->size);
    int err = 0;
    IoEnd end;
    if (k == 0) {
      wire::MsgHeader h{wire::kMsgMagic, req->tag, req->seq, req->size};
      end = write_full(fd, &h, sizeof(h), body, body_len, stop, timeout_ms, &err);
    } else {
      wire::PartHeader h{wire::kPartMagic, static_cast<uint32_t>(k), req->seq, req->split.offset(k),
                         body_len};
      end = write_full(fd, &h, sizeof(h), body, body_len, stop, timeout_ms, &err);
    }
    std::lock_guard<std::mutex> lock(mu);
    if (end != IoEnd::kDone) {
      if (end != IoEnd::kStopped) {
        fail(std::string("socket ") + std::to_string(k) + ": " + io_end_name(end) +
             (err != 0 ? std::string(" (") + std::strerror(err) + ")" : ""));
      }
      return;
    }
    queues[static_cast<size_t>(k)].pop_front();
    if (--req->parts_left == 0) req->done = true;
  }
}

RecvComm::~RecvComm() {
  for (auto& [seq, msg] : active) {
    (void)seq;
    if (msg->slot == nullptr) continue;  // owned by `unexpected`
    std::free(msg->staging);
    delete msg;
  }
  for (RecvMsg* msg : unexpected) {
    std::free(msg->staging);
    delete msg;
  }
  for (RecvRequest* r : requests) delete r;
}

void RecvComm::fail(const std::string& why, bool warn) {  // mu held
  if (failed) return;
  failed = true;
  if (warn) {
    NET_WARN("receive connection from %s failed: %s", peer.c_str(), why.c_str());
  } else {
    NET_INFO("receive connection from %s ended: %s", peer.c_str(), why.c_str());
  }
  for (int fd : fds) shutdown(fd, SHUT_RDWR);
  cv.notify_all();
}

void RecvComm::malformed(const std::string& why) {  // mu held
  if (failed) return;
  fail("malformed frame: " + why);
  fail_status = Status::kMalformedPayload;
}

void RecvComm::bind_message(RecvMsg* msg, RecvSlot* slot) {  // mu held; size already checked
  msg->slot = slot;
  if (msg->complete) finish(msg);
}

void RecvComm::finish(RecvMsg* msg) {  // mu held; msg complete and bound
  RecvSlot* slot = msg->slot;
  if (msg->staging != nullptr) {
    if (msg->size > 0) std::memcpy(slot->data, msg->staging, msg->size);
    std::free(msg->staging);
  }
  slot->received = msg->size;
  slot->done = true;
  slot->req->remaining--;
  delete msg;
}

void RecvComm::part_done(RecvMsg* msg) {  // mu held
  if (--msg->parts_left > 0) return;
  msg->complete = true;
  active.erase(msg->seq);
  if (msg->slot != nullptr) finish(msg);
}

bool RecvComm::oversized(const RecvMsg* msg, const RecvSlot* slot) {  // mu held
  if (msg->size <= slot->capacity) return false;
  fail("message " + std::to_string(msg->seq) + " with tag " + std::to_string(msg->tag) +
       " carries " + std::to_string(msg->size) + " bytes but the posted receive holds only " +
       std::to_string(slot->capacity));
  return true;
}

void RecvComm::end_of_stream(int k, IoEnd end, bool mid_message, int err) {
  std::lock_guard<std::mutex> lock(mu);
  if (end == IoEnd::kStopped || failed) return;
  if (end == IoEnd::kEof && !mid_message && k == 0) {
    headers_closed = true;
    cv.notify_all();  // parts waiting for a header
  }
  if (end == IoEnd::kEof && !mid_message) {
    if (++clean_eofs < static_cast<int>(fds.size())) return;
    bool waiting = !posted.empty() || !active.empty();
    fail("peer closed the connection", /*warn=*/waiting);
    return;
  }
  fail(std::string("socket ") + std::to_string(k) + ": " + io_end_name(end) +
       (mid_message ? " in the middle of a message" : "") +
       (err != 0 ? std::string(" (") + std::strerror(err) + ")" : ""));
}

void RecvComm::run_headers() {
  int fd = fds[0];
  // Bounded by stop/failure/end of stream; each pass receives one message header + part 0.
  for (;;) {
    wire::MsgHeader h{};
    bool began = false;
    int err = 0;
    IoEnd end = read_full(fd, &h, sizeof(h), /*idle_ok=*/true, stop, timeout_ms, &began, &err);
    if (end != IoEnd::kDone) return end_of_stream(0, end, began, err);
    RecvMsg* msg = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu);
      if (failed) return;
      switch (wire::check_msg_header(h, next_seq)) {
        case wire::MsgCheck::kOk:
          break;
        case wire::MsgCheck::kBadMagic:
          return malformed("bad message magic");
        case wire::MsgCheck::kTooLarge:
          return malformed("message size " + std::to_string(h.size) + " exceeds the 1 TiB limit");
        case wire::MsgCheck::kBadSeq:
          return malformed("sequence " + std::to_string(h.seq) + ", expected " +
                           std::to_string(next_seq));
      }
      ++next_seq;
      msg = new RecvMsg{
          h.seq,   h.tag,   h.size,  wire::split_message(h.size, static_cast<int>(fds.size())),
          nullptr, nullptr, nullptr, 0,
          false,   1u};
      msg->parts_left = msg->split.parts;
      auto it = std::find_if(posted.begin(), posted.end(),
                             [&](const RecvSlot* s) { return s->tag == h.tag; });
      if (it != posted.end()) {
        RecvSlot* slot = *it;
        posted.erase(it);
        if (oversized(msg, slot)) {
          delete msg;
          return;
        }
        msg->slot = slot;
        msg->dest = slot->data;
      } else {
        msg->staging = static_cast<char*>(std::malloc(std::max<size_t>(h.size, 1)));
        if (msg->staging == nullptr) {
          delete msg;
          return fail("cannot stage an unexpected message of " + std::to_string(h.size) +
                      " bytes: out of memory");
        }
        msg->dest = msg->staging;
        unexpected.push_back(msg);
      }
      active[msg->seq] = msg;
      headers_busy = true;
      cv.notify_all();
    }
    end = read_full(fd, msg->dest, msg->split.len(0, msg->size), false, stop, timeout_ms, &began,
                    &err);
    if (end != IoEnd::kDone) return end_of_stream(0, end, true, err);
    std::lock_guard<std::mutex> lock(mu);
    headers_busy = false;
    part_done(msg);
  }
}

void RecvComm::run_parts(int k) {
  int fd = fds[static_cast<size_t>(k)];
  for (;;) {  // bounded like run_headers
    wire::PartHeader h{};
    bool began = false;
    int err = 0;
    IoEnd end = read_full(fd, &h, sizeof(h), /*idle_ok=*/true, stop, timeout_ms, &began, &err);
    if (end != IoEnd::kDone) return end_of_stream(k, end, began, err);
    RecvMsg* msg = nullptr;
    {
      std::unique_lock<std::mutex> lock(mu);
      if (!wire::part_header_valid(h, k)) {
        return malformed("bad part header on socket " + std::to_string(k));
      }
      // The header for this seq comes on socket 0; wait for it, bounded by the timeout.
      Clock::time_point start = Clock::now();
      for (;;) {
        if (failed || stop.load()) return;
        auto it = active.find(h.seq);
        if (it != active.end()) {
          msg = it->second;
          break;
        }
        if (h.seq < next_seq) {
          return malformed("part for message " + std::to_string(h.seq) + " which is not in flight");
        }
        if (headers_closed) {
          return fail("the peer closed the connection before the header of message " +
                      std::to_string(h.seq) + ", whose part " + std::to_string(k) + " arrived");
        }
        if (headers_busy) start = Clock::now();
        if (ms_since(start) > timeout_ms) {
          return fail("timed out waiting for the header of message " + std::to_string(h.seq));
        }
        cv.wait_for(lock, std::chrono::milliseconds(kPollSliceMs));
      }
      if ((msg->parts_seen >> k) & 1u) {
        return malformed("part " + std::to_string(k) + " of message " + std::to_string(h.seq) +
                         " arrived twice");
      }
      if (!wire::part_matches(h, k, msg->split, msg->size, msg->parts_seen)) {
        return malformed("part " + std::to_string(k) + " of message " + std::to_string(h.seq) +
                         " has offset/length " + std::to_string(h.offset) + "/" +
                         std::to_string(h.len));
      }
      msg->parts_seen |= 1u << k;
    }
    end = read_full(fd, msg->dest + h.offset, h.len, false, stop, timeout_ms, &began, &err);
    if (end != IoEnd::kDone) return end_of_stream(k, end, true, err);
    std::lock_guard<std::mutex> lock(mu);
    part_done(msg);
  }
}

}  // namespace dq::net::sock
