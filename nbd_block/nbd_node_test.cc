// Names of the nbd driver, as qemu-img 7.2 parses them (each expectation
// checked against `qemu-img info NAME` of the installed qemu-img: the
// displayed "image:" name, or the error text).
#include "nbd_block/nbd_node.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "io/engine.h"

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

}  // namespace
}  // namespace imgtool::nbd_block
