// Helpers for the qcow2 oracle tests (crash consistency, round trips with
// qemu-img): temporary paths, running qemu-img/qemu-io with separate stdout
// and stderr, opening images through posix_file and Qcow2Node (backing
// files probed: qcow2 magic -> qcow2, else raw), dumping a node to a raw
// file, comparing files, and block status maps in qemu-img map's form.
// Thread model: one Env (engine) per test, used from the test's thread.
#ifndef IMGTOOL_QCOW2_TESTING_HARNESS_H_
#define IMGTOOL_QCOW2_TESTING_HARNESS_H_

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::qcow2::testing {

// $TEST_TMPDIR/<name> (or /tmp/<name>).
std::string TempPath(absl::string_view name);

struct CommandResult {
  int exit_code = 0;  // -1 if the command did not exit normally
  std::string out;    // stdout
  std::string err;    // stderr
};
// Runs `command` with /bin/sh -c, capturing stdout and stderr apart.
CommandResult RunCommand(const std::string& command);

// Deterministic bytes (never all-zero runs): xorshift of `seed`.
std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed);

// The offset of the first byte where files `a` and `b` differ, -1 if they
// are identical (a length difference counts as a difference at the shorter
// length); holes are not read.
int64_t FirstDifference(const std::string& a, const std::string& b);

// Reads the whole file; empty if it does not exist.
std::vector<uint8_t> ReadWholeFile(const std::string& path);

class Env {
 public:
  // `kind` kAuto: io_uring if it works, else threads.
  explicit Env(io::EngineKind kind = io::EngineKind::kAuto, int depth = 64);
  io::Engine& engine() { return *engine_; }

  template <typename T>
  T Run(io::Task<T> task) {
    return io::RunSync(*engine_, std::move(task));
  }

  // An empty file node (created with size 0, opened read-write).
  absl::StatusOr<std::unique_ptr<io::BlockNode>> CreateEmpty(
      const std::string& path);
  // A read-only open shares every permission (qemu-img -U).
  absl::StatusOr<std::unique_ptr<io::BlockNode>> OpenFile(
      const std::string& path, bool read_only);
  // Opens a qcow2 image with its backing chain (read-only, probed).
  absl::StatusOr<std::unique_ptr<Qcow2Node>> OpenQcow2(
      const std::string& path, bool read_only,
      Qcow2OpenOptions options = Qcow2OpenOptions());
  BackingOpener Opener();

  // CreateQcow2 into a new file `path`.
  absl::Status CreateImage(const std::string& path,
                           const Qcow2CreateOptions& options);

  // Writes what `node` reads, [0, size()), into a new raw file `path`
  // (zero chunks left as holes).
  absl::Status DumpToRaw(io::BlockNode& node, const std::string& path);

 private:
  std::unique_ptr<io::Engine> engine_;
};

// One line of `qemu-img map --output=json`.
struct MapEntry {
  uint64_t start = 0;
  uint64_t length = 0;
  int depth = 0;
  bool present = false;
  bool zero = false;
  bool data = false;
  bool has_offset = false;
  uint64_t offset = 0;
  bool operator==(const MapEntry&) const = default;
};
std::string ToString(const MapEntry& e);
std::string ToString(const std::vector<MapEntry>& map);

// Parses qemu-img map's JSON output (one entry per line).
absl::StatusOr<std::vector<MapEntry>> ParseQemuMap(const std::string& json);

// The map of `top` through io::GetChainStatus, merged the way qemu-img map
// merges (same depth/present/zero/data, contiguous offsets in the same
// file).
io::Task<absl::StatusOr<std::vector<MapEntry>>> ChainMap(io::BlockNode& top);

// `qemu-img check --output=json` numbers.
struct QemuCheck {
  int exit_code = 0;
  std::string err;  // the problem lines
  uint64_t corruptions = 0;
  uint64_t leaks = 0;
  uint64_t check_errors = 0;
  uint64_t image_end_offset = 0;
  uint64_t total_clusters = 0;
  uint64_t allocated_clusters = 0;
  uint64_t fragmented_clusters = 0;
  uint64_t compressed_clusters = 0;
  std::string output;  // stdout
};
// Runs `qemu-img check --output=json [extra] <path>`. Retries for a few
// seconds while the image is locked by a process that is going away.
QemuCheck RunQemuCheck(const std::string& path, const std::string& extra = "");

}  // namespace imgtool::qcow2::testing

#endif  // IMGTOOL_QCOW2_TESTING_HARNESS_H_
