// Workloads shared by the benchmarks and the fragmentation test: the
// strided O_DIRECT write pattern that fragments raw files without an extent
// size hint (file-posix.md §2: "4 KiB writes every 8 KiB"), and a block
// status walk over a node as `map` does it.
// Thread model: everything runs on the calling thread, which polls `engine`.
#ifndef IMGTOOL_BENCHMARKS_WORKLOADS_H_
#define IMGTOOL_BENCHMARKS_WORKLOADS_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "posix_file/file_node.h"

namespace imgtool::benchmarks {

// Writes `request_size`-byte blocks at first_offset, first_offset + step,
// ... while a block fits below `end` (bytes), keeping `depth` (>= 1) requests
// in flight through `node`. Buffers are 4096-aligned and hold `pattern`.
// Returns the first failed write's status.
absl::Status WriteStrided(io::Engine& engine, io::BlockNode& node,
                          uint64_t first_offset, uint64_t end, uint64_t step,
                          uint64_t request_size, int depth,
                          uint8_t pattern = 0xaa);

// The fragmentation experiment's write phase over the whole node: 4 KiB
// writes with an 8 KiB step, first pass at offset 0, second at 4096, `depth`
// in flight. Afterwards every byte of the node has been written once.
absl::Status WriteInterleaved(io::Engine& engine, io::BlockNode& node,
                              int depth = 64);

// Walks GetBlockStatus from 0 to node.size(), like `map` does, and returns
// how many block status answers it took.
absl::StatusOr<uint64_t> WalkBlockStatus(io::Engine& engine,
                                         io::BlockNode& node);

// A raw image file on disk with its engine and node, opened with
// cache=none (O_DIRECT): what the benchmarks and the test write through.
struct RawImage {
  std::unique_ptr<io::Engine> engine;
  std::unique_ptr<posix_file::FileNode> node;
};

// Creates `path` as a raw image of `size` bytes with the given extent size
// hint (nullopt = the default 1 MiB; 0 = none) and opens it read-write with
// cache=none and an engine of queue depth 64 (io_uring, else threads).
absl::StatusOr<RawImage> CreateAndOpenRaw(const std::string& path,
                                          uint64_t size,
                                          std::optional<uint64_t> hint);

// Opens `path` as a file node with cache=none (O_DIRECT) on `engine`.
absl::StatusOr<std::unique_ptr<posix_file::FileNode>> OpenFileNode(
    io::Engine& engine, const std::string& path, bool read_only);

// Opens an existing raw image the same way (cache=none, read-write unless
// `read_only`).
absl::StatusOr<RawImage> OpenRaw(const std::string& path,
                                 bool read_only = false);

// Closes the node (errors are returned) and drops the engine.
absl::Status CloseRaw(RawImage& image);

// Creates `path` as a raw image of `size` bytes (no extent size hint) and
// writes all of it with 0xaa in 1 MiB requests, 8 in flight: a backing file
// or a fully allocated file to read and overwrite.
absl::Status CreateFullRaw(const std::string& path, uint64_t size);

}  // namespace imgtool::benchmarks

#endif  // IMGTOOL_BENCHMARKS_WORKLOADS_H_
