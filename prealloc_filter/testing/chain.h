// Test helpers for the preallocate filter on real files: qcow2 -> preallocate
// -> file chains (or qcow2 -> file, to compare with), and a sequential write
// workload with many requests in flight.
// Thread model: one qcow2::testing::Env (engine) per test or process.
#ifndef IMGTOOL_PREALLOC_FILTER_TESTING_CHAIN_H_
#define IMGTOOL_PREALLOC_FILTER_TESTING_CHAIN_H_

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "posix_file/file_node.h"
#include "prealloc_filter/prealloc_filter.h"
#include "prealloc_filter/prealloc_options.pb.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/testing/harness.h"

namespace imgtool::prealloc_filter::testing {

struct Chain {
  std::unique_ptr<qcow2::Qcow2Node> qcow2;
  PreallocFilterNode* filter = nullptr;  // owned by qcow2; null without
  posix_file::FileNode* file = nullptr;  // owned by filter or qcow2
};

// Opens the qcow2 image `path` read-write with cache mode `cache` ("none",
// "writeback"), over the filter with `options` if `with_filter`.
absl::StatusOr<Chain> OpenChain(qcow2::testing::Env& env,
                                const std::string& path,
                                const std::string& cache, bool with_filter,
                                const PreallocFilterOptions& options = {});

// `count` writes of `length` bytes at start, start + length, ... (bytes of
// write i: qcow2::testing::Pattern(length, seed + i)), `depth` in flight,
// issued in order. The first error, if any.
absl::Status WriteSequential(qcow2::testing::Env& env, io::BlockNode& node,
                             uint64_t start, uint64_t length, int count,
                             int depth, uint64_t seed);

// Extents of the file at `path` (FIEMAP).
absl::StatusOr<uint64_t> ExtentCount(qcow2::testing::Env& env,
                                     const std::string& path);

using qcow2::testing::FileLength;
using qcow2::testing::LastDataEnd;

}  // namespace imgtool::prealloc_filter::testing

#endif  // IMGTOOL_PREALLOC_FILTER_TESTING_CHAIN_H_
