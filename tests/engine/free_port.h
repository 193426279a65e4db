// free_port: a TCP port on the loopback that nothing listens on now, for a test's TCPStore
// rendezvous (ranks as threads of the test). Test-only.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>

#include "common/check.h"

namespace zo::engine {

inline uint16_t free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ZO_CHECK(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ZO_CHECK(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  socklen_t len = sizeof a;
  ZO_CHECK(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0);
  close(fd);
  return ntohs(a.sin_port);
}

}  // namespace zo::engine
