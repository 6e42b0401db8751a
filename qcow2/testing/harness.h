// Helpers for the qcow2 oracle tests (crash consistency, round trips with
// qemu-img): running qemu-img/qemu-io with separate stdout and stderr,
// block status maps in qemu-img map's form, and qemu-img check's figures.
// Env (opening images, dumping a node to a raw file), TempPath, Pattern,
// FirstDifference and ReadFile are qcow2/test_util's.
// Thread model: one Env (engine) per test, used from the test's thread.
#ifndef IMGTOOL_QCOW2_TESTING_HARNESS_H_
#define IMGTOOL_QCOW2_TESTING_HARNESS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2::testing {

struct CommandResult {
  int exit_code = 0;  // -1 if the command did not exit normally
  std::string out;    // stdout
  std::string err;    // stderr
};
// Runs `command` with /bin/sh -c, capturing stdout and stderr apart.
CommandResult RunCommand(const std::string& command);

// The end of the last data extent of `path` (SEEK_DATA/SEEK_HOLE):
// fallocate'd, never written space counts as a hole. 0 if none.
uint64_t LastDataEnd(const std::string& path);

// The length of the file at `path` (0 if it cannot be read).
uint64_t FileLength(const std::string& path);

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
