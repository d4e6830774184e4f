// Blocking socket I/O with bounded waits: sockets carry SO_RCVTIMEO/SO_SNDTIMEO of one poll
// slice, so every call returns at least once a slice to look at the stop flag and the stall
// deadline. No call spins: an idle socket sleeps in the kernel.
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace dq::net {

enum class IoEnd {
  kDone,     // every byte moved
  kEof,      // peer closed (orderly) before or during the transfer
  kStopped,  // our own stop flag was raised
  kTimeout,  // no progress for `stall_ms` while bytes were outstanding
  kError,    // errno says why (saved in *err)
};

inline constexpr int kPollSliceMs = 250;

// Blocking mode, TCP_NODELAY, CLOEXEC, send/receive timeouts of one slice.
bool configure_data_socket(int fd);

// Reads exactly `len` bytes. While nothing has been read yet and `idle_ok`, waiting is not a
// stall (an idle connection); *began tells whether any byte arrived.
IoEnd read_full(int fd, void* buf, size_t len, bool idle_ok, const std::atomic<bool>& stop,
                int64_t stall_ms, bool* began, int* err);

// Writes `head` then `body` (either may be empty) with MSG_NOSIGNAL.
IoEnd write_full(int fd, const void* head, size_t head_len, const void* body, size_t body_len,
                 const std::atomic<bool>& stop, int64_t stall_ms, int* err);

const char* io_end_name(IoEnd end);

// 64 random bits from the kernel (getrandom); never zero.
uint64_t random_u64();

}  // namespace dq::net
