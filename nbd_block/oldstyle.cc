#include "nbd_block/oldstyle.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace imgtool::nbd_block {
namespace {

// "NBDMAGIC" and the oldstyle magic 0x00420281861253 (doc/proto.md,
// "Oldstyle negotiation").
constexpr uint8_t kOldstyleStart[kGreetingMagicsSize] = {
    'N', 'B', 'D', 'M', 'A', 'G', 'I', 'C',
    0x00, 0x00, 0x42, 0x02, 0x81, 0x86, 0x12, 0x53};

// NBD_FLAG_HAS_FLAGS: bit 0 of the transmission flags, the last byte of the
// big-endian 32-bit flags field.
constexpr size_t kHasFlagsByte = kOldstyleFlagsOffset + 3;
constexpr uint8_t kHasFlags = 0x01;

constexpr size_t kRelayBuffer = size_t{256} << 10;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

// One direction of the relay: bytes read from `from` not yet written to
// `to`.
struct Direction {
  int from = -1;
  int to = -1;
  std::unique_ptr<char[]> buf{new char[kRelayBuffer]};
  size_t begin = 0;
  size_t end = 0;
  bool eof = false;   // `from` reached its end of file
  bool shut = false;  // ... and `to` was shut down for writing after it
  bool flushed() const { return begin == end; }
};

// Reads what `from` has and fits; false at an error.
bool Fill(Direction& d) {
  if (d.eof || d.end == kRelayBuffer) return true;
  const ssize_t n = recv(d.from, d.buf.get() + d.end, kRelayBuffer - d.end, 0);
  if (n > 0) {
    d.end += static_cast<size_t>(n);
  } else if (n == 0) {
    d.eof = true;
  } else if (errno != EAGAIN && errno != EINTR) {
    return false;
  }
  return true;
}

// Writes what `to` takes; passes an end of file on; false at an error.
bool Drain(Direction& d) {
  if (!d.flushed()) {
    const ssize_t n = send(d.to, d.buf.get() + d.begin, d.end - d.begin,
                           MSG_NOSIGNAL);
    if (n < 0) return errno == EAGAIN || errno == EINTR;
    d.begin += static_cast<size_t>(n);
    if (d.flushed()) d.begin = d.end = 0;
  }
  if (d.eof && d.flushed() && !d.shut) {
    shutdown(d.to, SHUT_WR);
    d.shut = true;
  }
  return true;
}

// The relay thread's loop (see the header): `server` the server's socket,
// `client` the pair's end facing libnbd. Closes both when it ends.
void Relay(int server, int client) {
  Direction up;  // libnbd -> server
  up.from = client;
  up.to = server;
  Direction down;  // server -> libnbd
  down.from = server;
  down.to = client;
  // A side that hung up (POLLHUP/POLLERR; [0] the server, [1] libnbd)
  // takes nothing more; what it sent before is passed on, then the relay
  // ends.
  bool hung[2] = {false, false};
  Direction* reads[2] = {&down, &up};   // what side i's bytes go into
  Direction* writes[2] = {&up, &down};  // what side i is sent
  for (;;) {
    if (up.shut && down.shut) break;
    if ((hung[0] || hung[1]) && down.eof && down.flushed() && up.eof &&
        up.flushed()) {
      break;
    }
    pollfd p[2];
    for (int i = 0; i < 2; ++i) {
      const Direction& r = *reads[i];
      p[i] = {.fd = i == 0 ? server : client, .events = 0, .revents = 0};
      if (!r.eof && r.end < kRelayBuffer) p[i].events |= POLLIN;
      if (!hung[i] && !writes[i]->flushed()) p[i].events |= POLLOUT;
      // A hung-up side is polled only while it has bytes to give (poll
      // reports POLLHUP whatever the events).
      if (hung[i] && p[i].events == 0) p[i].fd = -1;
    }
    if (poll(p, 2, -1) < 0) {
      if (errno == EINTR) continue;
      break;
    }
    bool ok = true;
    for (int i = 0; i < 2; ++i) {
      if ((p[i].revents & (POLLHUP | POLLERR)) != 0 && !hung[i]) {
        hung[i] = true;
        Direction& w = *writes[i];
        w.begin = w.end = 0;
        w.eof = w.shut = true;
      }
      if ((p[i].revents & (POLLIN | POLLHUP | POLLERR)) != 0 &&
          !Fill(*reads[i])) {
        // A side that failed gives nothing more.
        reads[i]->eof = true;
        if (!hung[i]) ok = false;
      }
    }
    for (int i = 0; i < 2; ++i) {
      if (!hung[i]) ok = ok && Drain(*writes[i]);
    }
    if (!ok) break;
  }
  close(server);
  close(client);
}

void* RelayThread(void* arg) {
  std::unique_ptr<int[]> fds(static_cast<int*>(arg));
  Relay(fds[0], fds[1]);
  return nullptr;
}

// Peeks at up to `want` bytes of `fd` into `buf` and returns how many the
// server sent: `want`, or fewer when it closed (or failed) after them (0
// when it sent nothing). kUnavailable when `deadline_ms` (>= 0) passes
// first.
absl::StatusOr<size_t> Peek(int fd, uint8_t* buf, size_t want,
                            int64_t deadline_ms) {
  for (;;) {
    int timeout = -1;
    if (deadline_ms >= 0) {
      timeout = static_cast<int>(std::max<int64_t>(deadline_ms - NowMs(), 0));
    }
    pollfd p = {.fd = fd, .events = POLLIN | POLLRDHUP, .revents = 0};
    const int r = poll(&p, 1, timeout);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return 0;  // libnbd finds the error
    if (r == 0) {
      return absl::UnavailableError("no greeting from the server");
    }
    const ssize_t n = recv(fd, buf, want, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n <= 0 || static_cast<size_t>(n) >= want) {
      return n < 0 ? 0 : static_cast<size_t>(n);
    }
    // Part of it: the rest may follow, unless the server closed.
    if ((p.revents & (POLLRDHUP | POLLHUP | POLLERR)) != 0) {
      return static_cast<size_t>(n);
    }
    if (deadline_ms >= 0 && NowMs() >= deadline_ms) {
      return absl::UnavailableError("no greeting from the server");
    }
    usleep(2000);  // poll would return at once: the peeked bytes are there
  }
}

}  // namespace

bool IsOldstyleStart(absl::Span<const uint8_t> start) {
  return start.size() >= kGreetingMagicsSize &&
         std::memcmp(start.data(), kOldstyleStart, kGreetingMagicsSize) == 0;
}

bool HasNoTransmissionFlags(absl::Span<const uint8_t> greeting) {
  return greeting.size() >= kOldstyleGreetingSize &&
         greeting[kOldstyleFlagsOffset + 2] == 0 &&
         greeting[kOldstyleFlagsOffset + 3] == 0;
}

absl::StatusOr<int> AdaptOldstyle(int fd, int wait_ms) {
  const int64_t deadline = wait_ms >= 0 ? NowMs() + wait_ms : -1;
  uint8_t greeting[kOldstyleGreetingSize];
  absl::StatusOr<size_t> n = Peek(fd, greeting, kGreetingMagicsSize, deadline);
  if (n.ok() && *n == kGreetingMagicsSize &&
      IsOldstyleStart(absl::MakeConstSpan(greeting, *n))) {
    n = Peek(fd, greeting, kOldstyleGreetingSize, deadline);
  }
  if (!n.ok()) {
    close(fd);
    return n.status();
  }
  if (*n < kOldstyleGreetingSize ||
      !IsOldstyleStart(absl::MakeConstSpan(greeting, *n)) ||
      !HasNoTransmissionFlags(absl::MakeConstSpan(greeting, *n))) {
    return fd;  // libnbd reads the greeting itself
  }
  // The greeting is all there (peeked): read it.
  if (recv(fd, greeting, kOldstyleGreetingSize, MSG_WAITALL) !=
      static_cast<ssize_t>(kOldstyleGreetingSize)) {
    const int e = errno;
    close(fd);
    return absl::UnavailableError(
        absl::StrCat("Unable to read from socket: ", std::strerror(e)));
  }
  greeting[kHasFlagsByte] |= kHasFlags;
  int pair[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) != 0) {
    const int e = errno;
    close(fd);
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(e)));
  }
  // 152 bytes fit in an empty socket's buffer: this does not block.
  if (send(pair[1], greeting, sizeof greeting, MSG_NOSIGNAL) !=
      static_cast<ssize_t>(sizeof greeting)) {
    const int e = errno;
    close(fd);
    close(pair[0]);
    close(pair[1]);
    return absl::InternalError(absl::StrCat("socketpair: ", std::strerror(e)));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  fcntl(pair[1], F_SETFL, fcntl(pair[1], F_GETFL) | O_NONBLOCK);
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  pthread_t thread;
  int* fds = new int[2]{fd, pair[1]};
  const int e = pthread_create(&thread, &attr, RelayThread, fds);
  pthread_attr_destroy(&attr);
  if (e != 0) {
    delete[] fds;
    close(fd);
    close(pair[0]);
    close(pair[1]);
    return absl::InternalError(
        absl::StrCat("relay thread: ", std::strerror(e)));
  }
  return pair[0];
}

}  // namespace imgtool::nbd_block
