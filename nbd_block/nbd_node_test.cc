// Names of the nbd driver, as qemu-img 7.2 parses them (each expectation
// checked against `qemu-img info NAME` of the installed qemu-img: the
// displayed "image:" name, or the error text).
#include "nbd_block/nbd_node.h"

#include <map>
#include <string>

#include "absl/status/status.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace imgtool::nbd_block
