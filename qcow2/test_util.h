// Test helpers for the qcow2 driver: temporary paths, running qemu-img and
// qemu-io (the oracle), opening images through posix_file and Qcow2Node.
#ifndef IMGTOOL_QCOW2_TEST_UTIL_H_
#define IMGTOOL_QCOW2_TEST_UTIL_H_

#include <cstdint>
#include <memory>
#include <random>
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

struct ShellResult {
  int exit_code = 0;
  std::string output;  // stdout and stderr
};
// Runs `command` with /bin/sh -c.
ShellResult Shell(const std::string& command);

// Runs `command` with /bin/sh in `dir`, stdout and stderr apart (kept in
// `dir`.sh_out and `dir`.sh_err, beside `dir`, not in it).
struct ShellOutput {
  int rc = -1;  // exit code, -1 if the shell did not exit
  std::string out;
  std::string err;
};
ShellOutput RunShell(const std::string& dir, const std::string& command);

std::vector<uint8_t> ReadFile(const std::string& path);
// The whole file as a string ("" if it cannot be read).
std::string ReadAll(const std::string& path);
// Writes the bytes spelled by `hex` (two digits a byte, e.g. "8000") at byte
// `offset` of the existing file `path`; a gtest failure if that fails. Tests
// break images with it.
void PatchHex(const std::string& path, uint64_t offset,
              const std::string& hex);
void WriteFile(const std::string& path, const std::vector<uint8_t>& bytes);

// Compares two files without reading their holes: the offset of the first
// differing byte, or -1 if the files are identical (a length difference
// counts as a difference at the shorter length).
int64_t FirstDifference(const std::string& a, const std::string& b);

// Deterministic test data.
std::vector<uint8_t> Pattern(uint64_t length, uint64_t seed);

class Env;

// A mixed concurrent workload: `batches` batches of 64 requests started at
// once on `node` at disjoint byte ranges (one in each of 64 random slots of
// `slot` bytes, starting up to 99 bytes in, so that they share clusters):
// writes, zero writes (with and without may_unmap), reads checked against
// `ref` and, with `discard_unit` > 0, discards of the whole discard_unit-
// aligned units (subclusters) inside their range. A flush runs alongside
// every 7th batch. `ref` (node.size() bytes) follows what the node must
// read; `rng` draws everything. gtest failures on any error.
void RunMixedBatches(Env& env, io::BlockNode& node, std::vector<uint8_t>& ref,
                     std::mt19937_64& rng, int batches, uint64_t slot,
                     uint64_t discard_unit);

// Forwards every request to `target` (owned). Tests that watch what a
// driver sends to its file derive from it and override the Do* functions
// they observe, calling the ForwardingNode's version to pass requests on.
class ForwardingNode : public io::BlockNode {
 public:
  explicit ForwardingNode(std::unique_ptr<io::BlockNode> target);
  uint64_t size() const override { return target_->size(); }
  absl::StatusOr<uint64_t> AllocatedSize() const override {
    return target_->AllocatedSize();
  }
  io::Task<absl::Status> Close() override { return target_->Close(); }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  std::unique_ptr<io::BlockNode> target_;
};

// One engine per test (io_uring if it works; the thread pool when
// QCOW2_TEST_THREADS is set), and helpers running tasks on it.
class Env {
 public:
  Env();
  // An engine of `kind` (kAuto: io_uring if it works, else threads) with
  // `depth` requests in flight at most.
  explicit Env(io::EngineKind kind, int depth = 64);
  io::Engine& engine() { return *engine_; }

  template <typename T>
  T Run(io::Task<T> task) {
    return io::RunSync(*engine_, std::move(task));
  }

  // An empty file node (CreateFile with size 0, then opened read-write).
  absl::StatusOr<std::unique_ptr<io::BlockNode>> CreateEmpty(
      const std::string& path);
  absl::StatusOr<std::unique_ptr<io::BlockNode>> OpenFile(
      const std::string& path, bool read_only);

  // Opens a qcow2 image with backing files opened read-only by probing
  // (qcow2 magic -> qcow2, else raw). `grow_length_ahead` != 0: the image
  // file grows its length that many bytes ahead of the data, as when
  // block/registry.cc opens a qcow2 node over a file read-write (see
  // posix_file::FileNode::GrowLengthAhead), and read-write a hole after
  // the last refcounted cluster is cut at close (AdoptHoleTail).
  absl::StatusOr<std::unique_ptr<Qcow2Node>> OpenQcow2(
      const std::string& path, bool read_only,
      Qcow2OpenOptions options = Qcow2OpenOptions(),
      uint64_t grow_length_ahead = 0);

  BackingOpener Opener();

  // CreateQcow2 into a new file `path`.
  absl::Status CreateImage(const std::string& path,
                           const Qcow2CreateOptions& options);

  // Writes what `node` reads, [0, size()), into a new raw file `path`
  // (zero chunks left as holes). Errors: the node's read errors, and the
  // errno of a failed open/pwrite/ftruncate of `path`.
  absl::Status DumpToRaw(io::BlockNode& node, const std::string& path);

 private:
  std::unique_ptr<io::Engine> engine_;
};

}  // namespace imgtool::qcow2::testing

#endif  // IMGTOOL_QCOW2_TEST_UTIL_H_
