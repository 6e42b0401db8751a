// Names of the nbd driver, as qemu-img 7.2 parses them (each expectation
// checked against `qemu-img info NAME` of the installed qemu-img: the
// displayed "image:" name, or the error text).
#include "nbd_block/nbd_node.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "gtest/gtest.h"
#include "io/engine.h"
#include "nbd_block/oldstyle.h"

namespace imgtool::nbd_block {
namespace {

absl::StatusOr<std::map<std::string, std::string>> Parse(
    const std::string& name) {
  std::map<std::string, std::string> values;
  absl::Status st = ParseNbdFilename(
      name, [&](const std::string& k, const std::string& v) { values[k] = v; });
  if (!st.ok()) return st;
  return values;
}

// The name qemu-img shows for `name`, or its error.
std::string Shown(const std::string& name) {
  auto values = Parse(name);
  if (!values.ok()) return std::string(values.status().message());
  auto address = AddressFromOptions([&](const std::string& key) {
    auto it = values->find(key);
    return it == values->end() ? nullptr : &it->second;
  });
  if (!address.ok()) return std::string(address.status().message());
  return ExactFilename(*address);
}

TEST(NbdNamesTest, AsQemuImg) {
  EXPECT_EQ(Shown("nbd+unix:///?socket=/tmp/s.sock"),
            "nbd+unix://?socket=/tmp/s.sock");
  EXPECT_EQ(Shown("nbd+unix:///foo?socket=/tmp/s.sock"),
            "nbd+unix:///foo?socket=/tmp/s.sock");
  EXPECT_EQ(Shown("nbd://127.0.0.1/exp"), "nbd://127.0.0.1:10809/exp");
  EXPECT_EQ(Shown("nbd://127.0.0.1:10809/exp"), "nbd://127.0.0.1:10809/exp");
  EXPECT_EQ(Shown("nbd+tcp://127.0.0.1:5"), "nbd://127.0.0.1:5");
  EXPECT_EQ(Shown("nbd:127.0.0.1:10809:exportname=exp"),
            "nbd://127.0.0.1:10809/exp");
  EXPECT_EQ(Shown("nbd:unix:/tmp/s.sock"), "nbd+unix://?socket=/tmp/s.sock");
  EXPECT_EQ(Shown("nbd://[::1]:5/x"), "");  // no exact name: json:
  // imgtool's: the NBD URI spec's TLS schemes (qemu-img 7.2: "Unknown
  // protocol 'nbds'"), with libnbd's tls-certificates=DIR parameter.
  EXPECT_EQ(Shown("nbds://127.0.0.1/exp?tls-certificates=/c"),
            "nbds://127.0.0.1:10809/exp?tls-certificates=/c");
  EXPECT_EQ(Shown("nbds://127.0.0.1:5?tls-certificates=/c"),
            "nbds://127.0.0.1:5?tls-certificates=/c");
  EXPECT_EQ(Shown("nbds+unix:///e?socket=/tmp/s.sock&tls-certificates=/c"),
            "nbds+unix:///e?socket=/tmp/s.sock&tls-certificates=/c");
  EXPECT_EQ(Shown("nbds+unix://?tls-certificates=/c;socket=/tmp/s.sock"),
            "nbds+unix://?socket=/tmp/s.sock&tls-certificates=/c");
  // Without certificates or tls-creds.
  EXPECT_EQ(Shown("nbds+unix://?socket=/tmp/s.sock"),
            "nbds:// needs tls-certificates=DIR in the URI or the tls-creds "
            "option");
  // Export "exp/" (one leading '/' stripped).
  EXPECT_EQ(Shown("nbd://127.0.0.1/exp/"), "nbd://127.0.0.1:10809/exp/");
}

TEST(NbdNamesTest, ErrorsAsQemuImg) {
  for (const char* bad :
       {"nbd+unix:///", "nbd:///x", "nbd://",
        "nbd+unix:///?socket=/tmp/s.sock&foo=1", "nbd://h:99999/",
        "nbd+unix://host/?socket=/x", "nbd+tcp://127.0.0.1/exp?a=b"}) {
    EXPECT_EQ(Shown(bad), "No valid URL specified") << bad;
  }
  for (const char* bad : {"nbds+unix:///", "nbds://", "nbds+tcp://h/",
                          "nbds://h/e?tls-psk-file=/x",
                          "nbd://h/e?tls-certificates=/x"}) {
    EXPECT_EQ(Shown(bad), "No valid URL specified") << bad;
  }
  EXPECT_EQ(Shown("nbd:unix:/tmp/s.sock:exportname="),
            "NBD server address missing");
}

TEST(NbdNamesTest, OptionErrorsAsQemuImg) {
  auto shown = [](std::map<std::string, std::string> values) {
    auto address = AddressFromOptions([&](const std::string& key) {
      auto it = values.find(key);
      return it == values.end() ? nullptr : &it->second;
    });
    return address.ok() ? ExactFilename(*address)
                        : std::string(address.status().message());
  };
  EXPECT_EQ(shown({}), "NBD server address missing");
  EXPECT_EQ(shown({{"server.type", "foo"}}),
            "Parameter 'type' does not accept value 'foo'");
  EXPECT_EQ(shown({{"server.type", "unix"}}), "Parameter 'path' is missing");
  EXPECT_EQ(shown({{"server.type", "inet"}, {"server.host", "127.0.0.1"}}),
            "Parameter 'port' is missing");
  EXPECT_EQ(shown({{"server.type", "inet"},
                   {"server.host", "127.0.0.1"},
                   {"server.port", "10809"},
                   {"export", "exp"}}),
            "nbd://127.0.0.1:10809/exp");
  // imgtool's options.
  EXPECT_EQ(shown({{"server.type", "unix"},
                   {"server.path", "/s"},
                   {"x-tls", "on"},
                   {"x-tls-certificates", "/c"}}),
            "nbds+unix://?socket=/s&tls-certificates=/c");
  EXPECT_EQ(shown({{"server.type", "unix"},
                   {"server.path", "/s"},
                   {"x-tls", "yes"}}),
            "Parameter 'x-tls' expects 'on' or 'off'");
  for (const char* n : {"0", "17"}) {
    EXPECT_EQ(shown({{"server.type", "unix"},
                     {"server.path", "/s"},
                     {"multi-conn", n}}),
              "Parameter 'multi-conn' expects a number from 1 to 16");
  }
  EXPECT_EQ(shown({{"server.type", "unix"},
                   {"server.path", "/s"},
                   {"multi-conn", "16"}}),
            "nbd+unix://?socket=/s");
}

// An nbdkit memory export (8 MiB, sparse: unwritten ranges are holes that
// read as zeroes) on a unix socket, killed at the end.
class NbdkitMemory {
 public:
  NbdkitMemory() {
    // Under /tmp: a unix socket path must stay under 108 bytes (Bazel's
    // TEST_TMPDIR is longer).
    dir_ = "/tmp/nbdkit.XXXXXX";
    if (mkdtemp(dir_.data()) == nullptr) return;
    // nbdkit forks into the background once it listens (-P: its pid).
    started_ = std::system(absl::StrCat("nbdkit -U ", socket(), " -P ", dir_,
                                        "/pid memory 8M")
                               .c_str()) == 0;
  }
  ~NbdkitMemory() {
    std::ifstream pid_file(dir_ + "/pid");
    pid_t pid = 0;
    if (pid_file >> pid && pid > 0) kill(pid, SIGTERM);
    unlink((dir_ + "/pid").c_str());
    unlink(socket().c_str());
    rmdir(dir_.c_str());
  }
  bool started() const { return started_; }
  std::string socket() const { return dir_ + "/s"; }

 private:
  std::string dir_;
  bool started_ = false;
};

// The extents a BLOCK_STATUS reply gave answer the queries inside them
// without another request, and are dropped by this node's writes, write
// zeroes and discards (nbd_node.h, "Block status").
TEST(NbdNodeTest, HeldExtentsAnswerQueriesUntilTheNodeWrites) {
  if (std::system("command -v nbdkit >/dev/null") != 0) {
    GTEST_SKIP() << "nbdkit not installed (tools/setup.sh)";
  }
  NbdkitMemory server;
  ASSERT_TRUE(server.started());
  auto engine = io::CreateEngine(io::EngineKind::kThreads, 16, nullptr);
  ASSERT_TRUE(engine.ok()) << engine.status();
  NbdAddress address;
  address.is_unix = true;
  address.path = server.socket();
  auto node = NbdNode::Open("nbd", address, engine->get(), false);
  ASSERT_TRUE(node.ok()) << node.status();
  NbdNode& n = **node;
  constexpr uint64_t kMiB = 1 << 20;
  auto status = [&](uint64_t offset, uint64_t length) {
    absl::StatusOr<io::BlockStatus> st =
        io::RunSync(**engine, n.GetBlockStatus(offset, length));
    EXPECT_TRUE(st.ok()) << st.status();
    return st.ok() ? *st : io::BlockStatus{};
  };
  // All hole: one request, asked from 0 to the end; the next query is
  // answered from it.
  io::BlockStatus s = status(0, 8 * kMiB);
  EXPECT_EQ(s.length, 8 * kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_TRUE(s.zero);
  s = status(4 * kMiB, kMiB);
  EXPECT_EQ(s.length, kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_EQ(n.block_status_requests(), 1u);
  // A write: the held extents (a hole at 4 MiB) are no longer used.
  std::vector<uint8_t> data(64 << 10, 0x5a);
  ASSERT_TRUE(io::RunSync(**engine, n.Write(4 * kMiB, data)).ok());
  s = status(4 * kMiB, kMiB);
  EXPECT_TRUE(s.data);
  EXPECT_EQ(s.length, 64u << 10);
  EXPECT_EQ(n.block_status_requests(), 2u);
  // From the reply at 4 MiB: the hole after the data, no request.
  s = status(4 * kMiB + (64 << 10), kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_EQ(n.block_status_requests(), 2u);
  // Before 4 MiB: not held, asked.
  s = status(0, 8 * kMiB);
  EXPECT_EQ(s.length, 4 * kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_EQ(n.block_status_requests(), 3u);
  // Discard and write zeroes drop them too.
  ASSERT_TRUE(io::RunSync(**engine, n.Discard(4 * kMiB, 64 << 10)).ok());
  s = status(4 * kMiB, 8 * kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_EQ(s.length, 4 * kMiB);
  ASSERT_TRUE(io::RunSync(**engine, n.Write(kMiB, data)).ok());
  s = status(0, 8 * kMiB);
  EXPECT_EQ(s.length, kMiB);
  EXPECT_FALSE(s.data);
  ASSERT_TRUE(
      io::RunSync(**engine, n.WriteZeroes(kMiB, 64 << 10,
                                          io::WriteZeroesFlags{.may_unmap = true}))
          .ok());
  s = status(kMiB, kMiB);
  EXPECT_FALSE(s.data);
  EXPECT_TRUE(s.zero);
  EXPECT_EQ(n.block_status_requests(), 6u);
  ASSERT_TRUE(io::RunSync(**engine, n.Close()).ok());
}

// An oldstyle NBD server (doc/proto.md, "Oldstyle negotiation") in a
// thread, as QEMU's nbd-fault-injector.py --classic-negotiation: greeting
// with the given 32-bit flags, then simple replies to READ, WRITE and DISC
// over a 1 MiB memory disk, one connection at a time on a unix socket.
// drop_writes: the first that many WRITEs close the connection once their
// data is read, without a reply (the injector's event=data when=after).
class OldstyleServer {
 public:
  static constexpr uint64_t kSize = 1 << 20;
  OldstyleServer(uint32_t flags, int drop_writes)
      : flags_(flags), drop_writes_(drop_writes), disk_(kSize, 0) {
    dir_ = "/tmp/oldstyle.XXXXXX";
    if (mkdtemp(dir_.data()) == nullptr) return;
    listen_fd_ = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un sun = {};
    sun.sun_family = AF_UNIX;
    std::strcpy(sun.sun_path, socket_path().c_str());
    if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&sun), sizeof sun) != 0 ||
        listen(listen_fd_, 4) != 0) {
      return;
    }
    thread_ = std::thread([this] { Serve(); });
  }
  ~OldstyleServer() {
    stop_ = true;
    shutdown(listen_fd_, SHUT_RDWR);
    if (thread_.joinable()) thread_.join();
    close(listen_fd_);
    unlink(socket_path().c_str());
    rmdir(dir_.c_str());
  }
  std::string socket_path() const { return dir_ + "/s"; }
  bool listening() const { return thread_.joinable(); }
  std::vector<uint8_t> disk() const {
    std::lock_guard<std::mutex> lock(mu_);
    return disk_;
  }
  int connections() const { return connections_; }
  int disconnects() const { return disconnects_; }

 private:
  static void Put(uint8_t* p, uint64_t v, int bytes) {
    for (int i = bytes - 1; i >= 0; --i, v >>= 8) p[i] = v & 0xff;
  }
  static uint64_t Get(const uint8_t* p, int bytes) {
    uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v = v << 8 | p[i];
    return v;
  }
  static bool ReadAll(int fd, uint8_t* p, size_t n) {
    return recv(fd, p, n, MSG_WAITALL) == static_cast<ssize_t>(n);
  }
  void Serve() {
    while (!stop_) {
      const int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) return;
      ++connections_;
      ServeOne(fd);
      close(fd);
    }
  }
  void ServeOne(int fd) {
    uint8_t greeting[152] = {'N', 'B', 'D', 'M', 'A', 'G', 'I', 'C',
                             0,   0,   0x42, 0x02, 0x81, 0x86, 0x12, 0x53};
    Put(greeting + 16, kSize, 8);
    Put(greeting + 24, flags_, 4);
    if (send(fd, greeting, sizeof greeting, MSG_NOSIGNAL) != 152) return;
    for (;;) {
      uint8_t req[28];
      if (!ReadAll(fd, req, sizeof req) || Get(req, 4) != 0x25609513) return;
      const uint64_t type = Get(req + 6, 2);
      const uint64_t offset = Get(req + 16, 8);
      const uint64_t length = Get(req + 24, 4);
      uint8_t reply[16] = {};
      Put(reply, 0x67446698, 4);
      std::memcpy(reply + 8, req + 8, 8);
      if (type == 2) {  // NBD_CMD_DISC
        ++disconnects_;
        return;
      }
      if (offset > kSize || length > kSize - offset) return;
      if (type == 0) {  // NBD_CMD_READ
        const std::vector<uint8_t> data = disk();
        if (send(fd, reply, sizeof reply, MSG_NOSIGNAL) != 16 ||
            send(fd, data.data() + offset, length, MSG_NOSIGNAL) !=
                static_cast<ssize_t>(length)) {
          return;
        }
      } else if (type == 1) {  // NBD_CMD_WRITE
        std::vector<uint8_t> data(length);
        if (!ReadAll(fd, data.data(), length)) return;
        if (drop_writes_ > 0) {
          --drop_writes_;
          return;
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          std::memcpy(disk_.data() + offset, data.data(), length);
        }
        if (send(fd, reply, sizeof reply, MSG_NOSIGNAL) != 16) return;
      } else {
        Put(reply + 4, 22, 4);  // EINVAL
        if (send(fd, reply, sizeof reply, MSG_NOSIGNAL) != 16) return;
      }
    }
  }

  const uint32_t flags_;
  int drop_writes_;
  mutable std::mutex mu_;
  std::vector<uint8_t> disk_;  // guarded by mu_
  std::string dir_;
  int listen_fd_ = -1;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<int> connections_{0};
  std::atomic<int> disconnects_{0};
};

// An OldstyleServer and an NbdNode opened on it (thread-pool engine).
class OldstyleNodeTest : public ::testing::Test {
 protected:
  // Starts the server (flags, drop_writes) and opens the node with
  // `reconnect_delay` (seconds).
  void Open(uint32_t flags, int drop_writes, uint32_t reconnect_delay = 0) {
    server_ = std::make_unique<OldstyleServer>(flags, drop_writes);
    ASSERT_TRUE(server_->listening());
    auto engine = io::CreateEngine(io::EngineKind::kThreads, 16, nullptr);
    ASSERT_TRUE(engine.ok()) << engine.status();
    engine_ = std::move(*engine);
    NbdAddress address;
    address.is_unix = true;
    address.path = server_->socket_path();
    address.reconnect_delay = reconnect_delay;
    auto node = NbdNode::Open("nbd", address, engine_.get(), false);
    ASSERT_TRUE(node.ok()) << node.status();
    node_ = std::move(*node);
  }
  template <typename T>
  T Run(io::Task<T> task) {
    return io::RunSync(*engine_, std::move(task));
  }

  std::unique_ptr<OldstyleServer> server_;
  std::unique_ptr<io::Engine> engine_;
  std::unique_ptr<NbdNode> node_;
};

// Transmission flags 0 (libnbd alone: "invalid eflags == 0 from server"):
// opened as QEMU opens it (writable; no flush, trim or zeroes), and data
// written and read back through the relay; DISC reaches the server.
TEST_F(OldstyleNodeTest, ServerWithoutFlags) {
  ASSERT_NO_FATAL_FAILURE(Open(0, 0));
  EXPECT_EQ(node_->size(), OldstyleServer::kSize);
  EXPECT_FALSE(node_->can_flush());
  EXPECT_FALSE(node_->can_trim());
  EXPECT_FALSE(node_->can_zero());
  EXPECT_FALSE(node_->has_base_allocation());
  std::vector<uint8_t> data(300 << 10);
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<uint8_t>(i * 7);
  ASSERT_TRUE(Run(node_->Write(4096, data)).ok());
  std::vector<uint8_t> back(data.size());
  ASSERT_TRUE(Run(node_->Read(4096, io::IoVec(back))).ok());
  EXPECT_EQ(back, data);
  EXPECT_TRUE(Run(node_->Flush()).ok());  // no-op: no flush
  ASSERT_TRUE(Run(node_->Close()).ok());
  node_.reset();
  for (int i = 0; i < 500 && server_->disconnects() == 0; ++i) usleep(10000);
  EXPECT_EQ(server_->disconnects(), 1);
  EXPECT_EQ(server_->connections(), 1);
  const std::vector<uint8_t> disk = server_->disk();
  EXPECT_TRUE(std::equal(data.begin(), data.end(), disk.begin() + 4096));
}

// The server closes the connection after a write's data (iotest 277's
// first server): libnbd sees the close through the relay, and with
// reconnect-delay the write is sent again on a new connection.
TEST_F(OldstyleNodeTest, ServerWithoutFlagsReconnects) {
  ASSERT_NO_FATAL_FAILURE(Open(0, 1, 5));
  std::vector<uint8_t> data(3 << 20 >> 2, 0x07);
  ASSERT_TRUE(Run(node_->Write(0, data)).ok());
  EXPECT_EQ(node_->reconnects(), 1u);
  EXPECT_EQ(server_->connections(), 2);
  const std::vector<uint8_t> disk = server_->disk();
  EXPECT_TRUE(std::equal(data.begin(), data.end(), disk.begin()));
  ASSERT_TRUE(Run(node_->Close()).ok());
}

// Without reconnect-delay the lost connection fails the write with EIO, as
// QEMU's client.
TEST_F(OldstyleNodeTest, ServerWithoutFlagsLost) {
  ASSERT_NO_FATAL_FAILURE(Open(0, 1));
  std::vector<uint8_t> data(4096, 0x07);
  absl::Status st = Run(node_->Write(0, data));
  EXPECT_EQ(StatusErrno(st), EIO) << st;
}

// Oldstyle with NBD_FLAG_HAS_FLAGS | NBD_FLAG_SEND_FLUSH: libnbd reads the
// greeting itself (no relay) and the server's flags count.
TEST_F(OldstyleNodeTest, ServerWithFlags) {
  ASSERT_NO_FATAL_FAILURE(Open(0x1 | 0x4, 0));
  EXPECT_TRUE(node_->can_flush());
  EXPECT_FALSE(node_->can_trim());
  ASSERT_TRUE(Run(node_->Close()).ok());
}

// AdaptOldstyle on one end of a socketpair, `sent` written to the other
// first (then closed when `close_after`): the descriptor it returns and
// the bytes that one then reads (up to 152).
struct Adapted {
  absl::StatusOr<int> fd;
  bool same_fd = false;
  std::vector<uint8_t> bytes;
};
Adapted Adapt(const std::vector<uint8_t>& sent, bool close_after, int wait_ms) {
  int sv[2];
  EXPECT_EQ(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
  EXPECT_EQ(send(sv[1], sent.data(), sent.size(), 0),
            static_cast<ssize_t>(sent.size()));
  if (close_after) close(sv[1]);
  Adapted a;
  a.fd = AdaptOldstyle(sv[0], wait_ms);
  if (a.fd.ok()) {
    a.same_fd = *a.fd == sv[0];
    if (!close_after) shutdown(sv[1], SHUT_WR);
    uint8_t buf[152];
    const ssize_t n = recv(*a.fd, buf, sizeof buf, MSG_WAITALL);
    if (n > 0) a.bytes.assign(buf, buf + n);
    close(*a.fd);
  }
  if (!close_after) close(sv[1]);
  return a;
}

std::vector<uint8_t> OldGreeting(uint32_t flags) {
  std::vector<uint8_t> g = {'N', 'B', 'D', 'M', 'A', 'G', 'I', 'C',
                            0,   0,   0x42, 0x02, 0x81, 0x86, 0x12, 0x53};
  g.resize(152, 0);
  g[23] = 0x10;  // size 4096
  g[24] = flags >> 24;
  g[25] = flags >> 16;
  g[26] = flags >> 8;
  g[27] = flags;
  return g;
}

TEST(OldstyleTest, RelaysOnlyOldstyleWithoutTransmissionFlags) {
  // Flags 0: a new descriptor, the greeting with NBD_FLAG_HAS_FLAGS.
  Adapted a = Adapt(OldGreeting(0), false, 1000);
  ASSERT_TRUE(a.fd.ok()) << a.fd.status();
  EXPECT_FALSE(a.same_fd);
  EXPECT_EQ(a.bytes, OldGreeting(1));
  // Only the low 16 bits are transmission flags: 0x10000 is relayed too.
  a = Adapt(OldGreeting(0x10000), false, 1000);
  EXPECT_FALSE(a.same_fd);
  EXPECT_EQ(a.bytes, OldGreeting(0x10001));
  // Flags: untouched, nothing read.
  for (uint32_t flags : {0x1u, 0x2u, 0x5u}) {
    a = Adapt(OldGreeting(flags), false, 1000);
    ASSERT_TRUE(a.fd.ok()) << a.fd.status();
    EXPECT_TRUE(a.same_fd) << flags;
    EXPECT_EQ(a.bytes, OldGreeting(flags)) << flags;
  }
  // Newstyle ("IHAVEOPT", 18 bytes): untouched.
  std::vector<uint8_t> newstyle = {'N', 'B', 'D', 'M', 'A', 'G', 'I', 'C',
                                   'I', 'H', 'A', 'V', 'E', 'O', 'P', 'T', 0, 3};
  a = Adapt(newstyle, false, 1000);
  EXPECT_TRUE(a.same_fd);
  EXPECT_EQ(a.bytes, newstyle);
  // A greeting cut short by the server's close: untouched (libnbd reports
  // it).
  const std::vector<uint8_t> greeting = OldGreeting(0);
  std::vector<uint8_t> cut(greeting.begin(), greeting.begin() + 40);
  a = Adapt(cut, true, 1000);
  EXPECT_TRUE(a.same_fd);
  EXPECT_EQ(a.bytes, cut);
  a = Adapt({}, true, 1000);
  EXPECT_TRUE(a.same_fd);
  EXPECT_TRUE(a.bytes.empty());
}

TEST(OldstyleTest, NoGreetingInTime) {
  // Nothing, or part of a greeting, within the wait: kUnavailable.
  const std::vector<uint8_t> greeting = OldGreeting(0);
  for (size_t n : {size_t{0}, size_t{20}, size_t{100}}) {
    std::vector<uint8_t> part(greeting.begin(), greeting.begin() + n);
    Adapted a = Adapt(part, false, 50);
    EXPECT_EQ(a.fd.status(),
              absl::UnavailableError("no greeting from the server"))
        << n;
  }
}

}  // namespace
}  // namespace imgtool::nbd_block
