// The plugin's sockets, left out of the children of fork().
//
// Jobs fork after their communicators are set up: PyTorch's DataLoader workers (Linux's default
// start method), a launcher's helpers. A child holds a copy of every descriptor, and the kernel
// ends a TCP connection only when its last copy is closed: a rank that crashed left its
// connections and its listening sockets open while its workers lived (PyTorch's notice a dead
// parent within about 5 s, other programs' never), so its peers saw no end of stream and waited
// for a timeout, and connects to it were still accepted. A child never uses the plugin (its
// threads did not survive the fork), so in the child each socket the plugin owns is replaced by
// /dev/null: a connection ends with the process that uses it. The descriptor's number stays taken
// by /dev/null until the child closes it through close_socket(), so no later file of the child is
// closed in its place.
//
// Every socket the plugin makes comes from open_socket() or accept_socket() and ends in
// close_socket(); making, closing and a fork exclude one another, so a fork never misses a socket
// being made nor copies one being closed.
#pragma once

#include <sys/socket.h>

namespace dq::net::sock {

// socket(2) with `type` as given (add SOCK_CLOEXEC): the descriptor, or -1 with errno set.
int open_socket(int family, int type);

// accept4(2) on `listen_fd`: the descriptor, or -1 with errno set.
int accept_socket(int listen_fd, sockaddr* addr, socklen_t* len, int flags);

// Closes *fd if it is one of the plugin's sockets (a child's /dev/null stand-in included) and
// marks it closed (-1); a descriptor the plugin does not hold is left alone.
void close_socket(int* fd);

}  // namespace dq::net::sock
