// Fuzz target: a whole qcow2 image from bytes. Opens the input read-only as
// a qcow2 node over an in-memory file (io::testing::MemoryNode; a backing
// file named in the image is a 64 KiB in-memory raw node), walks block status
// over the virtual size and reads every extent that has data here (and the
// first 256 KiB whatever they hold), then runs `check` and `check -r all` on
// copies. Neither may crash, hang (a task left waiting aborts), read or write
// outside a buffer (ASan), or take memory beyond a bound set by the input's
// size: the copies never grow past 2 * input + 8 MiB, and the walk reads at
// most 4 MiB. Invariant: when `check -r all` reports the image clean
// afterwards, a fresh check of the repaired bytes finds no corruption or
// leak either.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"
#include "qcow2/check.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::qcow2 {
namespace {

using io::testing::MemoryNode;
using io::testing::RunInline;

constexpr size_t kMaxInput = 4 << 20;
// Each read of a compressed cluster inflates all of it (up to 2 MiB), so
// reads go in 1 MiB requests and the budget stays small.
constexpr uint64_t kMaxReadBytes = 4 << 20;
constexpr uint64_t kAlwaysReadBytes = 256 << 10;
constexpr int kMaxStatusSteps = 4096;
constexpr uint64_t kBackingSize = 64 << 10;
constexpr uint64_t kChunk = 1 << 20;

template <typename T>
T MustFinish(std::optional<T> result, const char* what) {
  if (!result.has_value()) {
    std::fprintf(stderr, "image_fuzzer: %s never finished (deadlock)\n", what);
    std::abort();
  }
  return std::move(*result);
}

io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> OpenBacking(
    std::string filename, std::string format) {
  std::vector<uint8_t> bytes(kBackingSize);
  for (uint64_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 7 + 1);
  co_return std::unique_ptr<io::BlockNode>(std::make_unique<MemoryNode>(
      std::move(filename), std::move(bytes), /*read_only=*/true, kBackingSize));
}

// Reads [offset, offset + length) in chunks; errors are the image's, fine.
io::Task<void> ReadRange(Qcow2Node& node, uint64_t offset, uint64_t length,
                         uint64_t& budget) {
  std::vector<uint8_t> buf(kChunk);
  while (length > 0 && budget > 0) {
    const uint64_t n = std::min({length, kChunk, budget});
    (void)co_await node.Read(offset, io::IoVec(buf.data(), n));
    offset += n;
    length -= n;
    budget -= n;
  }
}

io::Task<absl::Status> ReadAll(const std::vector<uint8_t>& bytes) {
  auto file = std::make_unique<MemoryNode>("fuzz.qcow2", bytes,
                                           /*read_only=*/true, bytes.size());
  absl::StatusOr<std::unique_ptr<Qcow2Node>> opened =
      co_await Qcow2Node::Open(std::move(file), Qcow2OpenOptions(), OpenBacking);
  if (!opened.ok()) co_return opened.status();
  Qcow2Node& node = **opened;
  uint64_t budget = kMaxReadBytes;
  co_await ReadRange(node, 0, std::min(node.size(), kAlwaysReadBytes), budget);
  uint64_t offset = 0;
  for (int step = 0; step < kMaxStatusSteps && offset < node.size(); ++step) {
    absl::StatusOr<io::BlockStatus> status =
        co_await node.GetBlockStatus(offset, node.size() - offset);
    if (!status.ok()) break;
    if (status->data) co_await ReadRange(node, offset, status->length, budget);
    offset += status->length;
  }
  co_return co_await node.Close();
}

std::optional<CheckResult> Check(MemoryNode& file, RepairMode mode) {
  std::ostringstream messages;
  absl::StatusOr<CheckResult> result =
      MustFinish(RunInline(CheckQcow2(file, mode, messages)), "check");
  if (!result.ok()) return std::nullopt;
  return *result;
}

}  // namespace
}  // namespace imgtool::qcow2

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace imgtool::qcow2;
  if (size > kMaxInput) return 0;
  const std::vector<uint8_t> bytes(data, data + size);
  (void)MustFinish(RunInline(ReadAll(bytes)), "open and read");

  const uint64_t max_size = 2 * uint64_t{size} + (8 << 20);
  {
    MemoryNode copy("fuzz.qcow2", bytes, /*read_only=*/false, max_size);
    (void)Check(copy, RepairMode::kNone);
  }
  MemoryNode copy("fuzz.qcow2", bytes, /*read_only=*/false, max_size);
  std::optional<CheckResult> repaired = Check(copy, RepairMode::kAll);
  if (repaired.has_value() && repaired->corruptions == 0 &&
      repaired->leaks == 0 && repaired->check_errors == 0) {
    MemoryNode again("fuzz.qcow2", copy.bytes(), /*read_only=*/true,
                     copy.bytes().size());
    std::optional<CheckResult> after = Check(again, RepairMode::kNone);
    if (!after.has_value() || after->corruptions != 0 || after->leaks != 0) {
      std::fprintf(stderr,
                   "image_fuzzer: check -r all left a clean report, but a "
                   "second check finds %s\n",
                   after.has_value() ? "corruptions or leaks" : "an error");
      std::abort();
    }
  }
  return 0;
}
