// Fuzz target: the NBD server's handshake and request parser against a
// hostile client. One input is a byte of export settings, then the bytes a
// client sends (options, then requests with their payloads). The real server
// code (Server::ServeConnected) serves one end of a socketpair on a 1 MiB
// in-memory export (io::testing::MemoryNode); a client thread writes the
// rest of the input to the other end and closes its sending side, another
// reads and drops every reply until the server closes. The run ends when the
// input is exhausted: the server reads end-of-file, finishes the requests in
// flight and closes. Settings byte: bit 0 read-only, bit 1 the
// qemu:allocation-depth context, bit 2 a dirty bitmap "b0" (dirty
// [64 KiB, 128 KiB) and [512 KiB, 516 KiB)), bit 3 detect-zeroes, bit 4
// discard=unmap, bit 5 write-through, bit 6 TLS required (PSK credentials
// written at the first run into a temporary directory, removed at exit:
// options before STARTTLS get NBD_REP_ERR_TLS_REQD, STARTTLS is acknowledged
// and the rest of the input is the client's side of the TLS handshake,
// which GnuTLS refuses unless the fuzzer builds a ClientHello; the PSK key
// is not in the input, so no input gets past the handshake). Neither may crash, leak (libFuzzer's leak check), hang
// (libFuzzer's -timeout), write outside the export (the MemoryNode keeps
// its 1 MiB: a write past it would fail and is checked after the run), or
// take memory beyond what the server holds by design (kMaxRequests buffers
// of 32 MiB; fuzz.sh's -rss_limit_mb).
#include <sys/socket.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "io/engine.h"
#include "io/testing/memory_node.h"
#include "block/objects.h"
#include "nbd_server/nbd_server.h"
#include "nbd_server/tls.h"

namespace imgtool::nbd_server {
namespace {

constexpr uint64_t kExportSize = 1 << 20;
// Bigger inputs add nothing the parser has not seen (a request is 28 bytes,
// a payload at most 32 MiB is refused or written alike).
constexpr size_t kMaxInput = 1 << 20;

io::Engine& FuzzEngine() {
  static io::Engine* engine = [] {
    absl::StatusOr<std::unique_ptr<io::Engine>> e =
        io::CreateEngine(io::EngineKind::kThreads, 64, nullptr);
    if (!e.ok()) {
      std::fprintf(stderr, "server_fuzzer: %s\n", e.status().ToString().c_str());
      std::abort();
    }
    return e->release();
  }();
  return *engine;
}

// PSK server credentials from a keys.psk in a temporary directory made at
// the first call; the directory is removed at exit (GnuTLS reads the file
// at each handshake).
const TlsServerCreds* FuzzTls() {
  static const TlsServerCreds* creds = [] {
    static std::string dir = "/tmp/server_fuzzer_tls.XXXXXX";
    if (mkdtemp(dir.data()) == nullptr) {
      std::perror("server_fuzzer: mkdtemp");
      std::abort();
    }
    std::ofstream(dir + "/keys.psk")
        << "qemu:00112233445566778899aabbccddeeff\n";
    std::atexit([] {
      unlink((dir + "/keys.psk").c_str());
      rmdir(dir.c_str());
    });
    block::ObjectRegistry::TlsCreds c;
    c.psk = true;
    c.server = true;
    c.dir = dir;
    absl::StatusOr<std::unique_ptr<TlsServerCreds>> loaded =
        TlsServerCreds::Load(c);
    if (!loaded.ok()) {
      std::fprintf(stderr, "server_fuzzer: %s\n",
                   loaded.status().ToString().c_str());
      std::abort();
    }
    return loaded->release();
  }();
  return creds;
}

std::vector<uint8_t> ExportBytes() {
  std::vector<uint8_t> bytes(kExportSize);
  // Data in the first half, zeroes in the second (holes for sparse reads).
  for (uint64_t i = 0; i < kExportSize / 2; ++i) {
    bytes[i] = static_cast<uint8_t>(i * 13 + 5);
  }
  return bytes;
}

void Run(const uint8_t* data, size_t size) {
  const uint8_t settings = data[0];
  ExportOptions options;
  options.size = kExportSize;
  options.read_only = (settings & 1) != 0;
  options.allocation_depth = (settings & 2) != 0;
  if ((settings & 4) != 0) {
    options.bitmaps.push_back(
        {"b0", [](uint64_t, uint64_t)
                   -> absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> {
           return std::vector<std::pair<uint64_t, uint64_t>>{
               {64 << 10, 128 << 10}, {512 << 10, 516 << 10}};
         }});
  }
  options.detect_zeroes = (settings & 8) != 0;
  options.detect_zeroes_unmap = options.detect_zeroes;
  options.discard_unmap = (settings & 16) != 0;
  options.write_through = (settings & 32) != 0;
  if ((settings & 64) != 0) options.tls = FuzzTls();
  options.max_connections = 1;

  int fds[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
    std::perror("server_fuzzer: socketpair");
    std::abort();
  }
  const int client = fds[1];
  std::thread writer([client, data, size] {
    size_t done = 1;
    while (done < size) {
      const ssize_t r = send(client, data + done, size - done, MSG_NOSIGNAL);
      if (r <= 0) break;  // the server closed first
      done += static_cast<size_t>(r);
    }
    shutdown(client, SHUT_WR);
  });
  std::thread reader([client] {
    uint8_t buf[65536];
    while (recv(client, buf, sizeof buf, 0) > 0) {
    }
  });

  io::testing::MemoryNode node("fuzz.raw", ExportBytes(), options.read_only,
                               kExportSize);
  absl::Status served;
  {
    Server server(FuzzEngine(), node, std::move(options));
    served = server.Run(server.ServeConnected(fds[0]));
  }
  // The server's end is closed: the reader sees end-of-file, a blocked
  // writer an error.
  writer.join();
  reader.join();
  close(client);
  if (!served.ok()) {
    std::fprintf(stderr, "server_fuzzer: %s\n", served.ToString().c_str());
    std::abort();
  }
  if (node.size() != kExportSize) {
    std::fprintf(stderr, "server_fuzzer: the export grew to %llu bytes\n",
                 static_cast<unsigned long long>(node.size()));
    std::abort();
  }
}

}  // namespace
}  // namespace imgtool::nbd_server

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > imgtool::nbd_server::kMaxInput) return 0;
  imgtool::nbd_server::Run(data, size);
  return 0;
}
