#include "nbd_server/nbd_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <coroutine>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/zero.h"
#include "io/chain_status.h"

namespace imgtool::nbd_server {
namespace {

// doc/proto.md, "Values".
constexpr uint64_t kNbdMagic = 0x4e42444d41474943;     // "NBDMAGIC"
constexpr uint64_t kOptMagic = 0x49484156454F5054;     // "IHAVEOPT"
constexpr uint64_t kOptReplyMagic = 0x0003e889045565a9;
constexpr uint32_t kRequestMagic = 0x25609513;
constexpr uint32_t kSimpleReplyMagic = 0x67446698;
constexpr uint32_t kStructuredReplyMagic = 0x668e33ef;

constexpr uint16_t kFlagFixedNewstyle = 1 << 0;
constexpr uint16_t kFlagNoZeroes = 1 << 1;

constexpr uint32_t kOptExportName = 1;
constexpr uint32_t kOptAbort = 2;
constexpr uint32_t kOptList = 3;
constexpr uint32_t kOptStartTls = 5;
constexpr uint32_t kOptInfo = 6;
constexpr uint32_t kOptGo = 7;
constexpr uint32_t kOptStructuredReply = 8;
constexpr uint32_t kOptListMetaContext = 9;
constexpr uint32_t kOptSetMetaContext = 10;

constexpr uint32_t kRepAck = 1;
constexpr uint32_t kRepServer = 2;
constexpr uint32_t kRepInfo = 3;
constexpr uint32_t kRepMetaContext = 4;
constexpr uint32_t kRepErrUnsup = 0x80000001;
constexpr uint32_t kRepErrPolicy = 0x80000002;
constexpr uint32_t kRepErrInvalid = 0x80000003;
constexpr uint32_t kRepErrUnknown = 0x80000006;
constexpr uint32_t kRepErrTlsReqd = 0x80000005;

constexpr uint16_t kInfoExport = 0;
constexpr uint16_t kInfoName = 1;
constexpr uint16_t kInfoDescription = 2;
constexpr uint16_t kInfoBlockSize = 3;

constexpr uint16_t kTxHasFlags = 1 << 0;
constexpr uint16_t kTxReadOnly = 1 << 1;
constexpr uint16_t kTxSendFlush = 1 << 2;
constexpr uint16_t kTxSendFua = 1 << 3;
constexpr uint16_t kTxSendTrim = 1 << 5;
constexpr uint16_t kTxSendWriteZeroes = 1 << 6;
constexpr uint16_t kTxSendDf = 1 << 7;
constexpr uint16_t kTxCanMultiConn = 1 << 8;
constexpr uint16_t kTxSendCache = 1 << 10;
constexpr uint16_t kTxSendFastZero = 1 << 11;

constexpr uint16_t kCmdRead = 0;
constexpr uint16_t kCmdWrite = 1;
constexpr uint16_t kCmdDisc = 2;
constexpr uint16_t kCmdFlush = 3;
constexpr uint16_t kCmdTrim = 4;
constexpr uint16_t kCmdCache = 5;
constexpr uint16_t kCmdWriteZeroes = 6;
constexpr uint16_t kCmdBlockStatus = 7;

constexpr uint16_t kCmdFlagFua = 1 << 0;
constexpr uint16_t kCmdFlagNoHole = 1 << 1;
constexpr uint16_t kCmdFlagDf = 1 << 2;
constexpr uint16_t kCmdFlagReqOne = 1 << 3;
constexpr uint16_t kCmdFlagFastZero = 1 << 4;

constexpr uint16_t kReplyFlagDone = 1 << 0;
constexpr uint16_t kReplyNone = 0;
constexpr uint16_t kReplyOffsetData = 1;
constexpr uint16_t kReplyOffsetHole = 2;
constexpr uint16_t kReplyBlockStatus = 5;
constexpr uint16_t kReplyError = 0x8001;

constexpr uint32_t kStateHole = 1 << 0;
constexpr uint32_t kStateZero = 1 << 1;

constexpr uint32_t kNbdEperm = 1;  // for errors of the block graph
constexpr uint32_t kNbdEio = 5;
constexpr uint32_t kNbdEnomem = 12;
constexpr uint32_t kNbdEinval = 22;
constexpr uint32_t kNbdEnospc = 28;
constexpr uint32_t kNbdEoverflow = 75;
constexpr uint32_t kNbdEnotsup = 95;

constexpr char kBaseAllocation[] = "base:allocation";
constexpr uint32_t kBaseAllocationId = 0;
constexpr char kAllocationDepth[] = "qemu:allocation-depth";
constexpr uint32_t kAllocationDepthId = 1;
constexpr char kDirtyBitmapPrefix[] = "qemu:dirty-bitmap:";
constexpr uint32_t kFirstBitmapId = 2;
constexpr uint32_t kStateDirty = 1 << 0;
// Names as qemu's NBD_MAX_STRING_SIZE; option data of known options as
// read into memory at most.
constexpr uint32_t kMaxName = 4096;
constexpr uint32_t kMaxOptionData = 64 * 1024;
// Extents in one BLOCK_STATUS reply (qemu's NBD_MAX_BLOCK_STATUS_EXTENTS).
constexpr size_t kMaxExtents = 1024 * 1024 / 8;
// A WRITE's payload is received in pieces of at most this many bytes.
constexpr uint32_t kPayloadPiece = 256 * 1024;
// A connection's receive buffer in transmission (Connection::rx): one recv()
// takes up to this many bytes of pipelined requests.
constexpr size_t kRxBuffer = 64 * 1024;
// Replies queued for a connection (Connection::tx) above which its reader
// reads no new request until the client has taken some.
constexpr size_t kTxHighWater = 1024 * 1024;

void Put16(std::string& s, uint16_t v) {
  s.push_back(static_cast<char>(v >> 8));
  s.push_back(static_cast<char>(v));
}
void Put32(std::string& s, uint32_t v) {
  Put16(s, static_cast<uint16_t>(v >> 16));
  Put16(s, static_cast<uint16_t>(v));
}
void Put64(std::string& s, uint64_t v) {
  Put32(s, static_cast<uint32_t>(v >> 32));
  Put32(s, static_cast<uint32_t>(v));
}
uint16_t Get16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] << 8 | p[1]);
}
uint32_t Get32(const uint8_t* p) {
  return static_cast<uint32_t>(Get16(p)) << 16 | Get16(p + 2);
}
uint64_t Get64(const uint8_t* p) {
  return static_cast<uint64_t>(Get32(p)) << 32 | Get32(p + 4);
}

// Extents of one BLOCK_STATUS chunk: (length, flags), a run of equal flags
// merged while it fits 32 bits, at most `max` of them (qemu's
// nbd_extent_array_add). Returns false when full.
bool AddExtent(std::vector<std::pair<uint32_t, uint32_t>>& extents,
               size_t max, uint64_t length, uint32_t flags) {
  while (length > 0) {
    if (!extents.empty() && extents.back().second == flags &&
        extents.back().first < UINT32_MAX) {
      const uint64_t n =
          std::min<uint64_t>(length, UINT32_MAX - extents.back().first);
      extents.back().first += static_cast<uint32_t>(n);
      length -= n;
      continue;
    }
    if (extents.size() >= max) return false;
    const uint64_t n = std::min<uint64_t>(length, UINT32_MAX);
    extents.emplace_back(static_cast<uint32_t>(n), flags);
    length -= n;
  }
  return true;
}

// The NBD error for a failed block request, as qemu's
// system_errno_to_nbd_errno over the errno the status carries.
uint32_t NbdErrno(const absl::Status& status) {
  int e = StatusErrno(status);
  if (e == 0) {
    switch (status.code()) {
      case absl::StatusCode::kPermissionDenied:
      case absl::StatusCode::kFailedPrecondition:
        e = EPERM;
        break;
      case absl::StatusCode::kResourceExhausted:
        e = ENOSPC;
        break;
      case absl::StatusCode::kInvalidArgument:
      case absl::StatusCode::kOutOfRange:
        e = EINVAL;
        break;
      case absl::StatusCode::kUnimplemented:
        e = ENOTSUP;
        break;
      default:
        e = EIO;
    }
  }
  switch (e) {
    case EPERM:
    case EROFS:
      return kNbdEperm;
    case EIO:
      return kNbdEio;
    case ENOMEM:
      return kNbdEnomem;
    case EDQUOT:
    case EFBIG:
    case ENOSPC:
      return kNbdEnospc;
    case EOVERFLOW:
      return kNbdEoverflow;
    case ENOTSUP:
      return kNbdEnotsup;
    default:
      return kNbdEinval;
  }
}

// The meta contexts a SET_META_CONTEXT selected, or a LIST matched (qemu's
// NBDExportMetaContexts).
struct MetaContexts {
  bool base_allocation = false;
  bool allocation_depth = false;
  std::vector<bool> bitmaps;  // by ExportOptions::bitmaps index

  // The selected contexts' ids, in qemu's order (ascending).
  std::vector<uint32_t> Ids() const {
    std::vector<uint32_t> ids;
    if (base_allocation) ids.push_back(kBaseAllocationId);
    if (allocation_depth) ids.push_back(kAllocationDepthId);
    for (size_t i = 0; i < bitmaps.size(); ++i) {
      if (bitmaps[i]) ids.push_back(kFirstBitmapId + static_cast<uint32_t>(i));
    }
    return ids;
  }
  // Whether any context is selected (without building Ids()).
  bool Any() const {
    return base_allocation || allocation_depth ||
           std::find(bitmaps.begin(), bitmaps.end(), true) != bitmaps.end();
  }
};

}  // namespace

struct Server::Connection {
  int fd = -1;
  int timer_fd = -1;        // the handshake time limit, until negotiated
  bool negotiated = false;  // entered transmission
  bool no_zeroes = false;
  bool structured = false;
  MetaContexts meta;  // what SET_META_CONTEXT selected
  std::unique_ptr<TlsSession> tls;  // after STARTTLS
  io::Mutex send_mu;
  // Transmission phase: bytes received and not yet parsed are
  // rx[rx_begin, rx_end) (kRxBuffer bytes, allocated when negotiated).
  std::unique_ptr<uint8_t[]> rx;
  size_t rx_begin = 0;
  size_t rx_end = 0;
  // Replies ready and not sent yet (connections without TLS): Send* append
  // them here, FlushReplies sends them after the engine's batch of
  // completions with one send() for the whole connection.
  std::string tx;
  bool tx_listed = false;   // in Server::tx_pending_
  bool tx_blocked = false;  // the socket was full: FlushWhenWritable sends
  bool tx_failed = false;   // a send failed: the client is gone
  int in_flight = 0;
  // The reader, waiting until ReaderMayGo().
  std::coroutine_handle<> reader;
  int wait_below = 0;
  // Fewer than wait_below requests in flight and, to read more requests,
  // less than kTxHighWater of replies queued, or, to end the connection
  // (wait_below 1), every queued reply sent or the client gone.
  bool ReaderMayGo() const {
    if (in_flight >= wait_below) return false;
    if (wait_below == 1) return !tx_blocked && (tx.empty() || tx_failed);
    return tx_failed || tx.size() < kTxHighWater;
  }
};

struct Server::Request {
  uint16_t flags = 0;
  uint16_t type = 0;
  uint64_t handle = 0;
  uint64_t offset = 0;
  uint32_t length = 0;
  uint32_t error = 0;  // found while reading the request: reply with it
  std::vector<uint8_t> data;
};

Server::Server(io::Engine& engine, io::BlockNode& node, ExportOptions options)
    : engine_(engine), node_(node), options_(std::move(options)) {}

Server::~Server() {
  if (epoll_fd_ >= 0) close(epoll_fd_);
  if (wake_fd_ >= 0) close(wake_fd_);
}

io::Task<void> Server::WaitFd(int fd, int events) {
  struct Awaiter {
    Server& server;
    int fd;
    bool out;
    bool await_ready() const { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      SocketWaiters& w = server.waiters_[fd];
      (out ? w.out : w.in) = h;
      server.Arm(fd, w);
    }
    void await_resume() {}
  };
  co_await Awaiter{*this, fd, (events & POLLOUT) != 0};
}

io::Task<size_t> Server::RecvSome(int fd, void* data, size_t length) {
  TlsSession* tls = nullptr;
  if (auto it = tls_.find(fd); it != tls_.end()) tls = it->second;
  while (true) {
    const ssize_t r = tls != nullptr ? tls->Recv(data, length)
                                     : recv(fd, data, length, MSG_DONTWAIT);
    if (r > 0) co_return static_cast<size_t>(r);
    if (r == 0) {
      read_error_ = tls != nullptr
                        ? tls->ReadError()
                        : "Unexpected end-of-file before all data were read";
      co_return 0;
    }
    if (tls != nullptr ? r == -1 : (errno == EAGAIN || errno == EWOULDBLOCK)) {
      co_await WaitFd(fd, POLLIN);
    } else if (tls != nullptr) {
      read_error_ = tls->ReadError();
      co_return 0;
    } else if (errno != EINTR) {
      read_error_ = absl::StrCat("Unable to read from socket: ",
                                 std::strerror(errno));
      co_return 0;
    }
  }
}

io::Task<bool> Server::ReadFull(int fd, void* data, size_t length) {
  auto* p = static_cast<uint8_t*>(data);
  while (length > 0) {
    const size_t n = co_await RecvSome(fd, p, length);
    if (n == 0) co_return false;
    p += n;
    length -= n;
  }
  co_return true;
}

io::Task<bool> Server::ReadBuffered(Connection& conn, void* data,
                                    size_t length, size_t* copied) {
  auto* p = static_cast<uint8_t*>(data);
  if (copied != nullptr) *copied = 0;
  while (length > 0) {
    if (conn.rx_begin < conn.rx_end) {
      const size_t n = std::min(conn.rx_end - conn.rx_begin, length);
      std::memcpy(p, conn.rx.get() + conn.rx_begin, n);
      conn.rx_begin += n;
      p += n;
      length -= n;
      if (copied != nullptr) *copied += n;
      continue;
    }
    conn.rx_begin = conn.rx_end = 0;
    // The requests spawned from what was buffered start now, not after the
    // recv below (and, when nothing has come, the wait for the socket):
    // at depth 1 that is the whole time between a request and its I/O.
    engine_.Flush();
    if (length >= kRxBuffer) co_return co_await ReadFull(conn.fd, p, length);
    conn.rx_end = co_await RecvSome(conn.fd, conn.rx.get(), kRxBuffer);
    if (conn.rx_end == 0) co_return false;
  }
  co_return true;
}

void Server::ReportDisconnect(const std::string& why) {
  if (options_.report_disconnect) options_.report_disconnect(why);
}

void Server::ReportRead(const char* what) {
  if (!options_.report) return;
  options_.report(*what == '\0' ? read_error_
                                : absl::StrCat(what, ": ", read_error_));
}

io::Task<bool> Server::WriteFull(int fd, const struct iovec* iov, int iovcnt) {
  if (auto it = tls_.find(fd); it != tls_.end()) {
    TlsSession* tls = it->second;
    int r = tls->Send(iov, iovcnt);
    while (r == 0) {
      co_await WaitFd(fd, POLLOUT);
      r = tls->Flush();
    }
    co_return r == 1;
  }
  absl::InlinedVector<struct iovec, 4> v(iov, iov + iovcnt);
  size_t first = 0;
  while (first < v.size()) {
    if (v[first].iov_len == 0) {
      ++first;
      continue;
    }
    struct msghdr msg = {};
    msg.msg_iov = v.data() + first;
    msg.msg_iovlen = v.size() - first;
    const ssize_t r = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) {
        co_await WaitFd(fd, POLLOUT);
        continue;
      }
      if (errno == EINTR) continue;
      co_return false;
    }
    size_t done = static_cast<size_t>(r);
    while (done > 0 && first < v.size()) {
      const size_t n = std::min(done, v[first].iov_len);
      v[first].iov_base = static_cast<uint8_t*>(v[first].iov_base) + n;
      v[first].iov_len -= n;
      done -= n;
      if (v[first].iov_len == 0) ++first;
    }
  }
  co_return true;
}

io::Task<bool> Server::Drop(int fd, uint64_t length) {
  uint8_t buf[4096];
  while (length > 0) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(length, sizeof buf));
    if (!co_await ReadFull(fd, buf, n)) co_return false;
    length -= n;
  }
  co_return true;
}

void Server::Wake() {
  const uint64_t one = 1;
  [[maybe_unused]] ssize_t r = write(wake_fd_, &one, sizeof one);
}

uint16_t Server::TransmissionFlags(const Connection& conn) const {
  uint16_t flags = kTxHasFlags | kTxSendFlush | kTxSendFua | kTxSendCache;
  if (options_.read_only) {
    flags |= kTxReadOnly;
  } else {
    flags |= kTxSendTrim | kTxSendWriteZeroes | kTxSendFastZero;
  }
  if (conn.structured) flags |= kTxSendDf;
  if (options_.max_connections != 1) flags |= kTxCanMultiConn;
  return flags;
}

absl::Status Server::SetUp(int signal_fd) {
  wake_fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) return ErrnoStatus("", "eventfd", errno);
  epoll_fd_ = epoll_create1(EPOLL_CLOEXEC);
  if (epoll_fd_ < 0) return ErrnoStatus("", "epoll_create1", errno);
  for (const int fd : {wake_fd_, signal_fd}) {
    if (fd < 0) continue;
    struct epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    if (epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev) < 0) {
      return ErrnoStatus("", "epoll_ctl", errno);
    }
  }
  return absl::OkStatus();
}

io::Task<absl::Status> Server::Serve(int listen_fd, int signal_fd) {
  const int fl = fcntl(listen_fd, F_GETFL);
  if (fl < 0 || fcntl(listen_fd, F_SETFL, fl | O_NONBLOCK) < 0) {
    co_return ErrnoStatus("", "fcntl", errno);
  }
  if (absl::Status st = SetUp(signal_fd); !st.ok()) co_return st;
  co_return co_await Loop(listen_fd, signal_fd);
}

io::Task<absl::Status> Server::ServeConnected(int fd) {
  const int fl = fcntl(fd, F_GETFL);
  absl::Status st = fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0
                        ? ErrnoStatus("", "fcntl", errno)
                        : SetUp(-1);
  if (!st.ok()) {
    close(fd);
    co_return st;
  }
  AddConnection(fd);
  co_return co_await Loop(-1, -1);
}

void Server::AddConnection(int fd) {
  ++clients_;
  auto conn = std::make_unique<Connection>();
  conn->fd = fd;
  if (options_.handshake_limit_seconds > 0) {
    // No timerfd (out of fds): the client is served without a limit.
    conn->timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    if (conn->timer_fd >= 0) {
      struct itimerspec when = {};
      when.it_value.tv_sec = options_.handshake_limit_seconds;
      struct epoll_event ev = {};
      ev.events = EPOLLIN;
      ev.data.fd = conn->timer_fd;
      if (timerfd_settime(conn->timer_fd, 0, &when, nullptr) == 0 &&
          epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, conn->timer_fd, &ev) == 0) {
        handshake_timers_[conn->timer_fd] = conn.get();
      } else {
        close(conn->timer_fd);
        conn->timer_fd = -1;
      }
    }
  }
  Connection* raw = conn.get();
  connections_.push_back(std::move(conn));
  io::Spawn(RunConnection(raw));
}

void Server::CancelHandshakeTimer(Connection& conn) {
  if (conn.timer_fd < 0) return;
  epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn.timer_fd, nullptr);
  handshake_timers_.erase(conn.timer_fd);
  close(conn.timer_fd);
  conn.timer_fd = -1;
}

io::Task<absl::Status> Server::Loop(int listen_fd, int signal_fd) {
  auto add = [&](int fd) {
    struct epoll_event ev = {};
    ev.events = EPOLLIN;
    ev.data.fd = fd;
    return epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
  };
  bool listening = false;
  bool shut_down = false;
  std::vector<std::coroutine_handle<>> ready;
  // The one poll request in flight: on the epoll fd, which holds the
  // listening socket, the wake and signal fds and every socket a coroutine
  // waits on (WaitFd); this loop resumes the waiters.
  while (true) {
    if (listen_fd < 0 && clients_ == 0) stopping_ = true;
    if (stopping_ && !shut_down) {
      // Readers see the end of their stream; replies in flight fail.
      for (const auto& conn : connections_) shutdown(conn->fd, SHUT_RDWR);
      shut_down = true;
    }
    if (stopping_ && connections_.empty()) break;
    const bool want = listen_fd >= 0 && !stopping_ &&
                      (options_.max_connections <= 0 ||
                       clients_ < options_.max_connections);
    if (want != listening) {
      if (want) {
        if (add(listen_fd) < 0) co_return ErrnoStatus("", "epoll_ctl", errno);
      } else {
        epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd, nullptr);
      }
      listening = want;
    }
    {
      io::Op op{.kind = io::OpKind::kPoll, .fd = epoll_fd_, .mode = POLLIN};
      co_await engine_.Run(op);
    }
    struct epoll_event events[64];
    const int n = epoll_wait(epoll_fd_, events, 64, 0);
    for (int i = 0; i < n; ++i) {
      const int fd = events[i].data.fd;
      const uint32_t ev = events[i].events;
      if (fd == wake_fd_) {
        uint64_t count;
        [[maybe_unused]] ssize_t r = read(wake_fd_, &count, sizeof count);
      } else if (fd == signal_fd) {
        struct signalfd_siginfo info;
        [[maybe_unused]] ssize_t r = read(signal_fd, &info, sizeof info);
        stopping_ = true;
      } else if (fd == listen_fd) {
        while (!stopping_ && (options_.max_connections <= 0 ||
                              clients_ < options_.max_connections)) {
          const int c = accept4(listen_fd, nullptr, nullptr,
                                SOCK_NONBLOCK | SOCK_CLOEXEC);
          if (c < 0) break;
          AddConnection(c);
        }
      } else if (auto t = handshake_timers_.find(fd);
                 t != handshake_timers_.end()) {
        // qemu's nbd_handshake_timer_cb: the socket is shut down; the
        // handshake's next read or write fails and the connection ends.
        Connection* conn = t->second;
        CancelHandshakeTimer(*conn);
        shutdown(conn->fd, SHUT_RDWR);
      } else if (auto it = waiters_.find(fd); it != waiters_.end()) {
        SocketWaiters& w = it->second;
        const bool hangup = (ev & (EPOLLHUP | EPOLLERR)) != 0;
        if (w.in && (hangup || (ev & EPOLLIN) != 0)) {
          ready.push_back(std::exchange(w.in, {}));
        }
        if (w.out && (hangup || (ev & EPOLLOUT) != 0)) {
          ready.push_back(std::exchange(w.out, {}));
        }
        if (w.in || w.out) Arm(fd, w);  // one-shot: re-arm what still waits
      }
    }
    // Resumed after the whole batch: a resumed coroutine may end its
    // connection (a connection ends only when none of its coroutines waits).
    for (std::coroutine_handle<> h : ready) io::Resume(h);
    ready.clear();
  }
  if (listening) epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, listen_fd, nullptr);
  co_return absl::OkStatus();
}

void Server::Arm(int fd, SocketWaiters& w) {
  struct epoll_event ev = {};
  ev.events = EPOLLONESHOT | (w.in ? EPOLLIN : 0u) | (w.out ? EPOLLOUT : 0u);
  ev.data.fd = fd;
  if (!w.added) {
    epoll_ctl(epoll_fd_, EPOLL_CTL_ADD, fd, &ev);
    w.added = true;
  } else {
    epoll_ctl(epoll_fd_, EPOLL_CTL_MOD, fd, &ev);
  }
}

bool Server::QueueReply(Connection& conn, const struct iovec* iov,
                        int iovcnt) {
  if (conn.tx_failed) return false;
  for (int i = 0; i < iovcnt; ++i) {
    conn.tx.append(static_cast<const char*>(iov[i].iov_base), iov[i].iov_len);
  }
  if (!conn.tx_listed) {
    conn.tx_listed = true;
    tx_pending_.push_back(&conn);
  }
  return true;
}

bool Server::SendQueued(Connection& conn) {
  size_t done = 0;
  while (done < conn.tx.size()) {
    const ssize_t r = send(conn.fd, conn.tx.data() + done,
                           conn.tx.size() - done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      done += static_cast<size_t>(r);
    } else if (r < 0 && errno == EINTR) {
      continue;
    } else if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      conn.tx.erase(0, done);
      return false;
    } else {
      // The client is gone: wake the reader (it sees the end of the stream).
      conn.tx_failed = true;
      shutdown(conn.fd, SHUT_RDWR);
      break;
    }
  }
  conn.tx.clear();
  return true;
}

void Server::FlushReplies() {
  std::vector<Connection*> pending;
  pending.swap(tx_pending_);
  for (Connection* conn : pending) {
    conn->tx_listed = false;
    if (conn->tx_blocked) continue;  // its FlushWhenWritable sends them
    if (!SendQueued(*conn)) {
      conn->tx_blocked = true;
      io::Spawn(FlushWhenWritable(conn));
    }
    WakeReader(*conn);
  }
}

io::Task<void> Server::FlushWhenWritable(Connection* conn) {
  do {
    co_await WaitFd(conn->fd, POLLOUT);
  } while (!SendQueued(*conn));
  conn->tx_blocked = false;
  WakeReader(*conn);
}

void Server::WakeReader(Connection& conn) {
  if (conn.reader && conn.ReaderMayGo()) {
    io::Resume(std::exchange(conn.reader, {}));
  }
}

absl::Status Server::Run(io::Task<absl::Status> task) {
  std::optional<absl::Status> result;
  io::Spawn(std::move(task), [&](absl::Status st) { result = std::move(st); });
  while (!result.has_value()) {
    // A reader resumed by a flush may queue more replies (refused requests
    // are answered at once): flush until none is left to send.
    while (!tx_pending_.empty()) FlushReplies();
    if (result.has_value()) break;
    if (engine_.in_flight() == 0) {
      return absl::InternalError("nbd server: waiting on nothing");
    }
    absl::Status st = engine_.Poll(/*wait=*/true);
    if (!st.ok()) return st;
  }
  return *std::move(result);
}

void Server::ConnectionEnded(Connection* conn) {
  CancelHandshakeTimer(*conn);
  std::erase(tx_pending_, conn);
  tls_.erase(conn->fd);
  if (auto it = waiters_.find(conn->fd); it != waiters_.end()) {
    if (it->second.added) {
      epoll_ctl(epoll_fd_, EPOLL_CTL_DEL, conn->fd, nullptr);
    }
    waiters_.erase(it);
  }
  close(conn->fd);
  --clients_;
  // qemu-nbd 7.2's nbd_client_closed: only a client that negotiated stops
  // a server without -t, when it was the last one.
  if (!options_.persistent && conn->negotiated && clients_ == 0) {
    stopping_ = true;
  }
  connections_.remove_if(
      [conn](const std::unique_ptr<Connection>& c) { return c.get() == conn; });
  // Serve's loop re-checks the client count (it may be waiting in poll).
  Wake();
}

io::Task<bool> Server::SendOptionReply(Connection& conn, uint32_t option,
                                       uint32_t type, const std::string& data) {
  std::string head;
  Put64(head, kOptReplyMagic);
  Put32(head, option);
  Put32(head, type);
  Put32(head, static_cast<uint32_t>(data.size()));
  const struct iovec iov[2] = {
      {const_cast<char*>(head.data()), head.size()},
      {const_cast<char*>(data.data()), data.size()}};
  co_return co_await WriteFull(conn.fd, iov, 2);
}

io::Task<bool> Server::SendExportInfo(Connection& conn, uint32_t option,
                                      const std::vector<uint16_t>& requests) {
  const bool want_name = std::find(requests.begin(), requests.end(),
                                   kInfoName) != requests.end();
  const bool want_description =
      std::find(requests.begin(), requests.end(), kInfoDescription) !=
      requests.end();
  std::string d;
  if (want_name) {
    Put16(d, kInfoName);
    d += options_.name;
    if (!co_await SendOptionReply(conn, option, kRepInfo, d)) co_return false;
  }
  if (want_description && !options_.description.empty()) {
    d.clear();
    Put16(d, kInfoDescription);
    d += options_.description;
    if (!co_await SendOptionReply(conn, option, kRepInfo, d)) co_return false;
  }
  const bool want_block_size =
      option == kOptInfo || std::find(requests.begin(), requests.end(),
                                      kInfoBlockSize) != requests.end();
  const uint32_t min_block = want_block_size ? options_.min_block : 1;
  d.clear();
  Put16(d, kInfoBlockSize);
  Put32(d, min_block);
  Put32(d, std::max<uint32_t>(4096, min_block));
  Put32(d, kMaxPayload);
  if (!co_await SendOptionReply(conn, option, kRepInfo, d)) co_return false;
  d.clear();
  Put16(d, kInfoExport);
  Put64(d, options_.size);
  Put16(d, TransmissionFlags(conn));
  if (!co_await SendOptionReply(conn, option, kRepInfo, d)) co_return false;
  co_return co_await SendOptionReply(conn, option, kRepAck, "");
}

// The TLS handshake after STARTTLS's ACK; false to close.
io::Task<bool> Server::StartTls(Connection& conn) {
  absl::StatusOr<std::unique_ptr<TlsSession>> session =
      options_.tls->NewSession(conn.fd);
  absl::Status error = session.status();
  while (error.ok()) {
    absl::StatusOr<TlsSession::Wait> wait = (*session)->Handshake();
    if (!wait.ok()) {
      error = wait.status();
    } else if (*wait == TlsSession::Wait::kNone) {
      conn.tls = *std::move(session);
      tls_[conn.fd] = conn.tls.get();
      co_return true;
    } else {
      co_await WaitFd(conn.fd,
                      *wait == TlsSession::Wait::kWrite ? POLLOUT : POLLIN);
    }
  }
  if (options_.report) options_.report(std::string(error.message()));
  co_return false;
}

// Returns true when the client entered transmission, false to close.
io::Task<bool> Server::Handshake(Connection& conn) {
  std::string hello;
  Put64(hello, kNbdMagic);
  Put64(hello, kOptMagic);
  Put16(hello, kFlagFixedNewstyle | kFlagNoZeroes);
  const struct iovec iov = {hello.data(), hello.size()};
  if (!co_await WriteFull(conn.fd, &iov, 1)) co_return false;
  auto report = [this](std::string text) {
    if (options_.report) options_.report(text);
  };
  uint8_t b[16];
  if (!co_await ReadFull(conn.fd, b, 4)) {
    ReportRead("Failed to read flags");
    co_return false;
  }
  const uint32_t client_flags = Get32(b);
  if (const uint32_t unknown =
          client_flags & ~uint32_t{kFlagFixedNewstyle | kFlagNoZeroes};
      unknown != 0) {
    report(absl::StrFormat("Unknown client flags 0x%x received", unknown));
    co_return false;
  }
  conn.no_zeroes = (client_flags & kFlagNoZeroes) != 0;
  std::string data;
  while (true) {
    // Magic, option and length read one by one, as QEMU (its message
    // names the field a closed stream cut).
    if (!co_await ReadFull(conn.fd, b, 8)) {
      ReportRead("Failed to read opts magic");
      co_return false;
    }
    if (Get64(b) != kOptMagic) {
      report("Bad magic received");
      co_return false;
    }
    if (!co_await ReadFull(conn.fd, b + 8, 4)) {
      ReportRead("Failed to read option");
      co_return false;
    }
    if (!co_await ReadFull(conn.fd, b + 12, 4)) {
      ReportRead("Failed to read option length");
      co_return false;
    }
    const uint32_t option = Get32(b + 8);
    const uint32_t length = Get32(b + 12);
    if (options_.tls != nullptr && conn.tls == nullptr) {
      // qemu 7.2's nbd_negotiate_options before TLS.
      if (option == kOptExportName) {
        if (options_.report) {
          options_.report(absl::StrFormat(
              "Option 0x%x not permitted before TLS", option));
        }
        co_return false;
      }
      if (!co_await Drop(conn.fd, length)) {
        ReportRead("");
        co_return false;
      }
      if (option == kOptStartTls) {
        if (length != 0) {
          co_await SendOptionReply(conn, option, kRepErrInvalid,
                                   "option 'starttls' has unexpected length");
          co_return false;
        }
        if (!co_await SendOptionReply(conn, option, kRepAck, "") ||
            !co_await StartTls(conn)) {
          co_return false;
        }
        continue;
      }
      if (!co_await SendOptionReply(
              conn, option, kRepErrTlsReqd,
              absl::StrFormat("Option 0x%x not permitted before TLS",
                              option)) ||
          option == kOptAbort) {
        co_return false;
      }
      continue;
    }
    const bool known =
        option == kOptExportName || option == kOptAbort ||
        option == kOptList || option == kOptInfo || option == kOptGo ||
        option == kOptStructuredReply || option == kOptListMetaContext ||
        option == kOptSetMetaContext;
    if (!known) {
      if (!co_await Drop(conn.fd, length)) {
        ReportRead("");
        co_return false;
      }
      uint32_t type = option == kOptStartTls ? kRepErrPolicy : kRepErrUnsup;
      std::string message;  // qemu's texts for STARTTLS
      if (option == kOptStartTls) {
        message = "TLS not configured";
        if (conn.tls != nullptr) {
          type = kRepErrInvalid;
          message = "TLS already enabled";
        }
      }
      if (!co_await SendOptionReply(conn, option, type, message)) {
        co_return false;
      }
      continue;
    }
    if (option == kOptExportName && length > kMaxName) {
      report("Bad length received");
      co_return false;
    }
    if (length > kMaxOptionData) {
      if (!co_await Drop(conn.fd, length)) {
        ReportRead("");
        co_return false;
      }
      if (!co_await SendOptionReply(conn, option, kRepErrInvalid, "")) {
        co_return false;
      }
      continue;
    }
    data.resize(length);
    if (!co_await ReadFull(conn.fd, data.data(), length)) {
      ReportRead(option == kOptExportName ? "Failed to read export name" : "");
      co_return false;
    }
    const auto* p = reinterpret_cast<const uint8_t*>(data.data());
    bool valid = true;
    switch (option) {
      case kOptExportName: {
        if (data != options_.name) {
          report("export not found");
          co_return false;
        }
        std::string reply;
        Put64(reply, options_.size);
        Put16(reply, TransmissionFlags(conn));
        if (!conn.no_zeroes) reply.append(124, '\0');
        const struct iovec r = {reply.data(), reply.size()};
        co_return co_await WriteFull(conn.fd, &r, 1);
      }
      case kOptAbort:
        co_await SendOptionReply(conn, option, kRepAck, "");
        co_return false;
      case kOptList: {
        if (length != 0) {
          valid = false;
          break;
        }
        std::string d;
        Put32(d, static_cast<uint32_t>(options_.name.size()));
        d += options_.name;
        d += options_.description;
        if (!co_await SendOptionReply(conn, option, kRepServer, d) ||
            !co_await SendOptionReply(conn, option, kRepAck, "")) {
          co_return false;
        }
        continue;
      }
      case kOptStructuredReply:
        if (length != 0 || conn.structured) {
          valid = false;
          break;
        }
        conn.structured = true;
        if (!co_await SendOptionReply(conn, option, kRepAck, "")) {
          co_return false;
        }
        continue;
      case kOptInfo:
      case kOptGo: {
        uint32_t name_length = 0;
        if (length < 6 || (name_length = Get32(p)) > length - 6 ||
            name_length > kMaxName) {
          valid = false;
          break;
        }
        const uint16_t count = Get16(p + 4 + name_length);
        if (length != 6 + name_length + 2u * count) {
          valid = false;
          break;
        }
        if (data.compare(4, name_length, options_.name) != 0) {
          if (!co_await SendOptionReply(conn, option, kRepErrUnknown, "")) {
            co_return false;
          }
          continue;
        }
        std::vector<uint16_t> requests;
        for (uint16_t i = 0; i < count; ++i) {
          requests.push_back(Get16(p + 6 + name_length + 2 * i));
        }
        if (!co_await SendExportInfo(conn, option, requests)) co_return false;
        if (option == kOptGo) co_return true;
        continue;
      }
      case kOptListMetaContext:
      case kOptSetMetaContext: {
        const bool list = option == kOptListMetaContext;
        if (!list && !conn.structured) {
          valid = false;
          break;
        }
        // A SET drops the previous selection before anything else.
        MetaContexts listed;
        MetaContexts& meta = list ? listed : conn.meta;
        meta = MetaContexts();
        meta.bitmaps.assign(options_.bitmaps.size(), false);
        // u32 name length, name, u32 query count, queries (u32 length,
        // text), all within the option's data.
        uint32_t pos = 0;
        auto need = [&](uint64_t n) { return pos + n <= length; };
        if (!need(4)) {
          valid = false;
          break;
        }
        const uint32_t name_length = Get32(p);
        pos = 4;
        if (name_length > kMaxName || !need(name_length)) {
          valid = false;
          break;
        }
        const std::string name = data.substr(pos, name_length);
        pos += name_length;
        if (name != options_.name) {
          if (!co_await SendOptionReply(conn, option, kRepErrUnknown, "")) {
            co_return false;
          }
          continue;
        }
        if (!need(4)) {
          valid = false;
          break;
        }
        const uint32_t count = Get32(p + pos);
        pos += 4;
        std::vector<std::string> queries;
        for (uint32_t i = 0; i < count && valid; ++i) {
          if (!need(4)) {
            valid = false;
            break;
          }
          const uint32_t q = Get32(p + pos);
          pos += 4;
          if (!need(q)) {
            valid = false;
            break;
          }
          // qemu skips a query longer than NBD_MAX_STRING_SIZE.
          if (q <= kMaxName) queries.push_back(data.substr(pos, q));
          pos += q;
        }
        if (!valid || pos != length) {
          valid = false;
          break;
        }
        if (list && count == 0) {
          meta.base_allocation = true;
          meta.allocation_depth = options_.allocation_depth;
          meta.bitmaps.assign(options_.bitmaps.size(), true);
        }
        for (const std::string& q : queries) {
          absl::string_view rest = q;
          if (absl::ConsumePrefix(&rest, "base:")) {
            if ((rest.empty() && list) || rest == "allocation") {
              meta.base_allocation = true;
            }
          } else if (absl::ConsumePrefix(&rest, "qemu:")) {
            if (rest.empty()) {
              if (list) {
                meta.allocation_depth = options_.allocation_depth;
                meta.bitmaps.assign(options_.bitmaps.size(), true);
              }
            } else if (rest == "allocation-depth") {
              meta.allocation_depth = options_.allocation_depth;
            } else if (absl::ConsumePrefix(&rest, "dirty-bitmap:")) {
              if (rest.empty()) {
                if (list) meta.bitmaps.assign(options_.bitmaps.size(), true);
              } else {
                for (size_t i = 0; i < options_.bitmaps.size(); ++i) {
                  if (options_.bitmaps[i].name == rest) {
                    meta.bitmaps[i] = true;
                    break;
                  }
                }
              }
            }
          }
        }
        // Replies in qemu's order; LIST's carry id 0.
        for (const uint32_t id : meta.Ids()) {
          std::string d;
          Put32(d, list ? 0 : id);
          if (id == kBaseAllocationId) {
            d += kBaseAllocation;
          } else if (id == kAllocationDepthId) {
            d += kAllocationDepth;
          } else {
            absl::StrAppend(&d, kDirtyBitmapPrefix,
                            options_.bitmaps[id - kFirstBitmapId].name);
          }
          if (!co_await SendOptionReply(conn, option, kRepMetaContext, d)) {
            co_return false;
          }
        }
        if (!co_await SendOptionReply(conn, option, kRepAck, "")) {
          co_return false;
        }
        continue;
      }
    }
    if (!valid &&
        !co_await SendOptionReply(conn, option, kRepErrInvalid, "")) {
      co_return false;
    }
  }
}

io::Task<bool> Server::ReadPayload(Connection& conn,
                                    std::vector<uint8_t>& data,
                                    uint32_t length) {
  // Reserved, not touched: the pages come as the pieces are written.
  data.reserve(length);
  while (data.size() < length) {
    const size_t done = data.size();
    const size_t n = std::min<size_t>(length - done, kPayloadPiece);
    data.resize(done + n);
    if (!co_await ReadBuffered(conn, data.data() + done, n)) co_return false;
  }
  co_return true;
}

io::Task<void> Server::RunConnection(Connection* conn) {
  conn->negotiated = co_await Handshake(*conn);
  CancelHandshakeTimer(*conn);
  if (conn->negotiated) {
    conn->rx = std::make_unique<uint8_t[]>(kRxBuffer);
    uint8_t h[28];
    while (true) {
      conn->wait_below = kMaxRequests;
      if (!conn->ReaderMayGo()) {
        struct SlotAwaiter {
          Connection& c;
          bool await_ready() const { return c.ReaderMayGo(); }
          void await_suspend(std::coroutine_handle<> h) { c.reader = h; }
          void await_resume() {}
        };
        co_await SlotAwaiter{*conn};
      }
      size_t got = 0;
      if (!co_await ReadBuffered(*conn, h, sizeof h, &got)) {
        // qemu 7.2's nbd_read_eof: nothing at a clean end of the stream.
        if (!absl::StartsWith(read_error_, "Unexpected end-of-file")) {
          ReportDisconnect(read_error_);
        } else if (got > 0) {
          ReportDisconnect("Unexpected end-of-file before all bytes were read");
        }
        break;
      }
      auto request = std::make_unique<Request>();
      request->flags = Get16(h + 4);
      request->type = Get16(h + 6);
      request->handle = Get64(h + 8);
      request->offset = Get64(h + 16);
      request->length = Get32(h + 24);
      bool close_after = false;
      if (Get32(h) != kRequestMagic) {
        // qemu 7.2: an EINVAL reply, then the connection is closed (the
        // stream cannot be trusted any more).
        request->error = kNbdEinval;
        close_after = true;
      } else if (request->type == kCmdDisc) {
        break;
      } else if (request->type == kCmdWrite || request->type == kCmdRead ||
                 request->type == kCmdCache) {
        if (request->length > kMaxPayload) {
          request->error = kNbdEinval;
          // A WRITE's payload follows; the stream cannot be followed.
          close_after = request->type == kCmdWrite;
        } else if (request->type == kCmdWrite) {
          if (!co_await ReadPayload(*conn, request->data,
                                    request->length)) {
            ReportDisconnect(
                absl::StrCat("Failed to read CMD_WRITE data: ", read_error_));
            break;
          }
        }
      }
      ++conn->in_flight;
      io::Spawn(HandleRequest(conn, request.release()));
      if (close_after) {
        ReportDisconnect("Request handling failed in intermediate state");
        break;
      }
    }
  }
  // Requests in flight still reply (the client may be reading), then close.
  // Replies queued but not sent yet are sent first.
  conn->wait_below = 1;
  if (!conn->ReaderMayGo()) {
    struct DrainAwaiter {
      Connection& c;
      bool await_ready() const { return c.ReaderMayGo(); }
      void await_suspend(std::coroutine_handle<> h) { c.reader = h; }
      void await_resume() {}
    };
    co_await DrainAwaiter{*conn};
  }
  ConnectionEnded(conn);
}

io::Task<bool> Server::SendSimpleReply(Connection& conn, uint64_t handle,
                                       uint32_t error, const uint8_t* data,
                                       size_t length) {
  std::string head;
  Put32(head, kSimpleReplyMagic);
  Put32(head, error);
  Put64(head, handle);
  const struct iovec iov[2] = {{head.data(), head.size()},
                               {const_cast<uint8_t*>(data), length}};
  if (!tls_.contains(conn.fd)) co_return QueueReply(conn, iov, 2);
  auto lock = co_await io::ScopedLock::Take(conn.send_mu);
  co_return co_await WriteFull(conn.fd, iov, 2);
}

io::Task<bool> Server::SendChunk(Connection& conn, uint64_t handle,
                                 uint16_t flags, uint16_t type,
                                 const std::string& payload_head,
                                 const uint8_t* data, size_t length) {
  std::string head;
  Put32(head, kStructuredReplyMagic);
  Put16(head, flags);
  Put16(head, type);
  Put64(head, handle);
  Put32(head, static_cast<uint32_t>(payload_head.size() + length));
  const struct iovec iov[3] = {
      {head.data(), head.size()},
      {const_cast<char*>(payload_head.data()), payload_head.size()},
      {const_cast<uint8_t*>(data), length}};
  if (!tls_.contains(conn.fd)) co_return QueueReply(conn, iov, 3);
  auto lock = co_await io::ScopedLock::Take(conn.send_mu);
  co_return co_await WriteFull(conn.fd, iov, 3);
}

io::Task<bool> Server::SendError(Connection& conn, uint64_t handle,
                                 uint32_t error, const std::string& message) {
  if (!conn.structured) {
    co_return co_await SendSimpleReply(conn, handle, error, nullptr, 0);
  }
  std::string payload;
  Put32(payload, error);
  Put16(payload, static_cast<uint16_t>(message.size()));
  payload += message;
  co_return co_await SendChunk(conn, handle, kReplyFlagDone, kReplyError,
                               payload, nullptr, 0);
}

io::Task<bool> Server::DoRead(Connection& conn, Request& r) {
  r.data.resize(r.length);
  if (!conn.structured || (r.flags & kCmdFlagDf) != 0 || r.length == 0) {
    const absl::Status st = co_await node_.Read(r.offset, absl::MakeSpan(r.data));
    if (!st.ok()) {
      co_return co_await SendError(conn, r.handle, NbdErrno(st),
                                   std::string(st.message()));
    }
    if (!conn.structured) {
      co_return co_await SendSimpleReply(conn, r.handle, 0, r.data.data(),
                                         r.length);
    }
    if (r.length == 0) {
      co_return co_await SendChunk(conn, r.handle, kReplyFlagDone, kReplyNone,
                                   "", nullptr, 0);
    }
    std::string head;
    Put64(head, r.offset);
    co_return co_await SendChunk(conn, r.handle, kReplyFlagDone,
                                 kReplyOffsetData, head, r.data.data(),
                                 r.length);
  }
  // Sparse: one chunk per extent of the chain's block status.
  const uint64_t end = r.offset + r.length;
  uint64_t offset = r.offset;
  while (offset < end) {
    absl::StatusOr<Extent> e = co_await ExtentAt(offset, end - offset);
    uint64_t length = 0;
    bool zero = false;
    if (e.ok()) {
      length = e->length;
      zero = e->zero;
    }
    if (!e.ok() || length == 0) {
      // No status: read the rest as data.
      length = end - offset;
      zero = false;
    }
    const bool last = offset + length == end;
    const uint16_t flags = last ? kReplyFlagDone : 0;
    std::string head;
    Put64(head, offset);
    if (zero) {
      Put32(head, static_cast<uint32_t>(length));
      if (!co_await SendChunk(conn, r.handle, flags, kReplyOffsetHole, head,
                              nullptr, 0)) {
        co_return false;
      }
    } else {
      uint8_t* p = r.data.data() + (offset - r.offset);
      const absl::Status st =
          co_await node_.Read(offset, absl::MakeSpan(p, length));
      if (!st.ok()) {
        co_return co_await SendError(conn, r.handle, NbdErrno(st),
                                     std::string(st.message()));
      }
      if (!co_await SendChunk(conn, r.handle, flags, kReplyOffsetData, head,
                              p, length)) {
        co_return false;
      }
    }
    offset += length;
  }
  co_return true;
}

io::Task<absl::StatusOr<Server::Extent>> Server::ExtentAt(uint64_t offset,
                                                          uint64_t max) {
  Extent e;
  if (offset >= node_.size()) {
    // The export's tail past the node's end (a raw file's length rounded
    // up to whole sectors) reads as zeroes: QEMU reports it as a hole.
    e.length = max;
    e.zero = true;
    co_return e;
  }
  absl::StatusOr<io::ChainStatus> cs =
      co_await io::GetChainStatus(node_, offset, max);
  if (!cs.ok()) co_return cs.status();
  e.length = std::min(cs->status.length, max);
  e.data = cs->present && cs->status.data;
  e.zero = !cs->present || cs->status.zero;
  co_return e;
}

io::Task<absl::StatusOr<std::pair<uint64_t, uint32_t>>> Server::DepthAt(
    uint64_t offset, uint64_t max) {
  if (offset >= node_.size()) {
    // The export's tail past the node's end: QEMU's protocol layer
    // answers it as allocated in the top node.
    co_return std::pair<uint64_t, uint32_t>(max, 1);
  }
  uint64_t length = std::min(max, node_.size() - offset);
  io::BlockNode* node = &node_;
  uint32_t depth = 1;
  while (true) {
    absl::StatusOr<io::BlockStatus> st =
        co_await node->GetBlockStatus(offset, length);
    if (!st.ok()) co_return st.status();
    length = std::min(length, st->length);
    if (st->data || st->zero) co_return std::pair(length, depth);
    io::BlockNode* backing = io::BackingBelow(node);
    if (backing == nullptr) co_return std::pair<uint64_t, uint32_t>(length, 0);
    ++depth;
    // bdrv_co_common_block_status_above: past the end of a shorter
    // backing node the zeroes count as allocated in that node.
    if (offset >= backing->size()) co_return std::pair(length, depth);
    length = std::min(length, backing->size() - offset);
    node = backing;
  }
}

io::Task<bool> Server::SendExtents(Connection& conn, Request& r, uint32_t id,
                                   bool last) {
  const size_t max_extents =
      (r.flags & kCmdFlagReqOne) != 0 ? 1 : kMaxExtents;
  std::vector<std::pair<uint32_t, uint32_t>> extents;  // length, flags
  const uint64_t end = r.offset + r.length;
  uint64_t offset = r.offset;
  if (id >= kFirstBitmapId) {
    const ExportOptions::Bitmap& bitmap = options_.bitmaps[id - kFirstBitmapId];
    absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> dirty =
        bitmap.dirty(offset, end);
    if (!dirty.ok()) {
      co_return co_await SendError(conn, r.handle, NbdErrno(dirty.status()),
                                   "can't get block status");
    }
    bool full = false;
    for (const auto& [begin, stop] : *dirty) {
      const uint64_t b = std::max(begin, offset);
      const uint64_t e = std::min(stop, end);
      if (b >= e) continue;
      if (!AddExtent(extents, max_extents, b - offset, 0) ||
          !AddExtent(extents, max_extents, e - b, kStateDirty)) {
        full = true;
        break;
      }
      offset = e;
    }
    if (!full) AddExtent(extents, max_extents, end - offset, 0);
  } else {
    while (offset < end) {
      uint64_t length = 0;
      uint32_t flags = 0;
      if (id == kBaseAllocationId) {
        absl::StatusOr<Extent> e = co_await ExtentAt(offset, end - offset);
        if (!e.ok()) {
          co_return co_await SendError(conn, r.handle, NbdErrno(e.status()),
                                       "can't get block status");
        }
        length = e->length;
        flags = (e->data ? 0 : kStateHole) | (e->zero ? kStateZero : 0);
      } else {
        absl::StatusOr<std::pair<uint64_t, uint32_t>> d =
            co_await DepthAt(offset, end - offset);
        if (!d.ok()) {
          co_return co_await SendError(conn, r.handle, NbdErrno(d.status()),
                                       "can't get block status");
        }
        length = d->first;
        flags = d->second;
      }
      if (length == 0 || !AddExtent(extents, max_extents, length, flags)) {
        break;
      }
      offset += length;
    }
  }
  std::string payload;
  Put32(payload, id);
  for (const auto& [length, flags] : extents) {
    Put32(payload, length);
    Put32(payload, flags);
  }
  co_return co_await SendChunk(conn, r.handle, last ? kReplyFlagDone : 0,
                               kReplyBlockStatus, payload, nullptr, 0);
}

io::Task<bool> Server::DoBlockStatus(Connection& conn, Request& r) {
  // One chunk per selected context, in qemu's order (ids ascending).
  const std::vector<uint32_t> ids = conn.meta.Ids();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (!co_await SendExtents(conn, r, ids[i], i + 1 == ids.size())) {
      co_return false;
    }
  }
  co_return true;
}

io::Task<void> Server::HandleRequest(Connection* conn, Request* request) {
  std::unique_ptr<Request> owned(request);
  Request& r = *request;
  uint32_t error = r.error;
  std::string message;
  bool sent = false;
  bool ok = true;
  const bool writes = r.type == kCmdWrite || r.type == kCmdTrim ||
                      r.type == kCmdWriteZeroes;
  uint16_t valid_flags = kCmdFlagFua;
  if (r.type == kCmdRead && conn->structured) valid_flags |= kCmdFlagDf;
  if (r.type == kCmdWriteZeroes) valid_flags |= kCmdFlagNoHole | kCmdFlagFastZero;
  if (r.type == kCmdBlockStatus) valid_flags |= kCmdFlagReqOne;
  if (error == 0 && r.type > kCmdBlockStatus) {
    error = kNbdEinval;
    message = "unsupported operation";
  }
  if (error == 0 && writes && options_.read_only) {
    error = kNbdEinval;  // qemu 7.2 replies EINVAL to every refused request
    message = "Export is read-only";
  }
  if (error == 0 && r.type != kCmdFlush &&
      (r.offset > options_.size || r.length > options_.size - r.offset)) {
    error = kNbdEinval;
    message = "operation past EOF";
  }
  if (error == 0 && (r.flags & ~valid_flags) != 0) {
    error = kNbdEinval;
    message = "unsupported flags";
  }
  if (error == 0) {
    absl::Status st;
    switch (r.type) {
      case kCmdRead:
        // qemu: FUA on a read flushes first.
        if ((r.flags & kCmdFlagFua) != 0) st = co_await node_.Flush();
        if (st.ok()) {
          ok = co_await DoRead(*conn, r);
          sent = true;
        }
        break;
      case kCmdWrite:
        if (options_.detect_zeroes && !r.data.empty() &&
            IsZero(r.data.data(), r.data.size())) {
          // QEMU's bdrv_aligned_pwritev: the whole request is zeroes.
          io::WriteZeroesFlags wz;
          wz.may_unmap =
              options_.detect_zeroes_unmap && options_.discard_unmap;
          st = co_await node_.WriteZeroes(r.offset, r.length, wz);
        } else {
          st = co_await node_.Write(r.offset, absl::MakeConstSpan(r.data));
        }
        if (st.ok() && ((r.flags & kCmdFlagFua) != 0 || options_.write_through)) {
          st = co_await node_.Flush();
        }
        break;
      case kCmdFlush:
        st = co_await node_.Flush();
        break;
      case kCmdTrim:
        if (options_.discard_unmap && r.length > 0) {
          st = co_await node_.Discard(r.offset, r.length);
          if (st.code() == absl::StatusCode::kUnimplemented) st = absl::OkStatus();
        }
        if (st.ok() && (r.flags & kCmdFlagFua) != 0) st = co_await node_.Flush();
        break;
      case kCmdWriteZeroes:
        if (r.length > 0) {
          io::WriteZeroesFlags wz;
          wz.may_unmap =
              options_.discard_unmap && (r.flags & kCmdFlagNoHole) == 0;
          wz.no_fallback = (r.flags & kCmdFlagFastZero) != 0;
          st = co_await node_.WriteZeroes(r.offset, r.length, wz);
        }
        if (st.ok() && ((r.flags & kCmdFlagFua) != 0 || options_.write_through)) {
          st = co_await node_.Flush();
        }
        break;
      case kCmdCache:
        break;
      case kCmdBlockStatus:
        if (r.length == 0) {
          error = kNbdEinval;
          message = "need non-zero length";
        } else if (!conn->structured || !conn->meta.Any()) {
          error = kNbdEinval;
          message = "CMD_BLOCK_STATUS not negotiated";
        } else {
          ok = co_await DoBlockStatus(*conn, r);
          sent = true;
        }
        break;
    }
    if (!st.ok()) {
      error = NbdErrno(st);
      message = std::string(st.message());
    }
  }
  if (!sent) {
    // Success of a command without data: a simple reply also when
    // structured replies were negotiated (the protocol allows both; qemu 7.2
    // nbd_send_generic_reply sends the 16-byte simple reply, which a client
    // reads in one piece).
    ok = error != 0
             ? co_await SendError(*conn, r.handle, error, message)
             : co_await SendSimpleReply(*conn, r.handle, 0, nullptr, 0);
  }
  // A reply that could not be sent: the client is gone; wake the reader.
  if (!ok) shutdown(conn->fd, SHUT_RDWR);
  owned.reset();
  --conn->in_flight;
  WakeReader(*conn);
}

}  // namespace imgtool::nbd_server
