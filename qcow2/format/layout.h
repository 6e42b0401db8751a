// Layout of a freshly created qcow2 image, exactly as `qemu-img create -f
// qcow2` (QEMU 7.2, preallocation=off) lays it out, so imgtool can write a
// byte-identical file. No I/O: this computes offsets and the bytes to write.
//
// QEMU's creation sequence (qcow2_co_create): write cluster 0 (header),
// cluster 1 (refcount table, entry 0 -> cluster 2) and cluster 2 (refcount
// block); allocate clusters 0-2; then resize, which allocates the L1 table
// (normally from cluster 3 on) and writes exactly l1_size * 8 zero bytes, so
// the file usually ends inside a cluster. An image of size 0 has no L1 table
// (offset 0) and is 3 clusters long. Backing file, data file and feature
// names only change cluster 0.
//
// When the L1 table reaches past the clusters the first refcount block
// covers (small clusters, wide refcounts, big images), QEMU's allocator adds
// refcount blocks after the L1 table and may move the refcount table to a
// bigger one, leaving the old one behind as a free cluster. This
// file replays that allocator (qcow2-refcount.c: alloc_clusters_noref,
// update_refcount, alloc_refcount_block, qcow2_refcount_area) on an in-memory
// model, so those layouts come out byte-identical too.
//
// Not modelled: encryption, preallocation other than off, data-file-raw.
//
// Geometry helpers used here live in l2_entry.h (L2EntriesPerCluster,
// L1EntriesForSize) and refcount.h (RefcountEntriesPerBlock).
// Thread model: pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_LAYOUT_H_
#define IMGTOOL_QCOW2_FORMAT_LAYOUT_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "qcow2/format/header.h"

namespace imgtool::qcow2::format {

// The `qemu-img create -o ...` options that shape a new qcow2 image, with
// QEMU's defaults.
struct NewImageOptions {
  uint64_t size = 0;             // requested virtual size, bytes
  uint64_t cluster_size = 65536;  // bytes, power of two, 512..2 MiB
  uint32_t version = 3;          // compat=1.1 -> 3, compat=0.10 -> 2
  uint32_t refcount_bits = 16;   // power of two, 1..64
  bool extended_l2 = false;
  bool lazy_refcounts = false;
  uint8_t compression_type = kCompressionZlib;
  std::optional<std::string> backing_file;
  std::optional<std::string> backing_format;
  std::optional<std::string> data_file;
  bool data_file_raw = false;
};

// A run of bytes to write at `offset`.
struct FileExtent {
  uint64_t offset = 0;
  std::vector<uint8_t> bytes;
  bool operator==(const FileExtent&) const = default;
};

// Where everything of a new image is. Offsets and sizes in bytes.
struct NewImageLayout {
  uint32_t cluster_bits = 0;
  uint32_t refcount_order = 0;
  uint64_t virtual_size = 0;             // size rounded up to 512 bytes
  uint64_t refcount_table_offset = 0;    // cluster 1 unless it had to grow
  uint32_t refcount_table_clusters = 0;
  // Refcount table entries 0..last non-zero one (0 = no block there);
  // {2 * cluster_size} for the common single-block layout.
  std::vector<uint64_t> refcount_block_offsets;
  uint64_t l1_table_offset = 0;          // 0 when l1_size == 0
  uint32_t l1_size = 0;                  // entries
  // Number of clusters with refcount 1; all others have 0.
  uint64_t allocated_clusters = 0;
  uint64_t file_size = 0;                // exact length of the new file
  // The non-zero bytes QEMU leaves outside cluster 0: refcount table,
  // refcount blocks, and stale copies of refcount tables it replaced. In
  // ascending offset order, not overlapping, trailing zeros trimmed.
  std::vector<FileExtent> metadata;
  bool operator==(const NewImageLayout&) const = default;
};

// Validates `options` like qemu-img create and computes the layout.
// kInvalidArgument, with qemu-img's message, for: cluster size not a power
// of two in 512..2 MiB, refcount width not a power of two <= 64, size above
// INT64_MAX or needing an L1 table above 32 MiB ("The image size is too
// large for file format 'qcow2' (try using a larger cluster size)"),
// version-3-only options on version 2, extended L2 with clusters below
// 16 KiB, backing format without backing file, data-file-raw without data
// file or with a backing file.
// kUnimplemented when data_file_raw is set (QEMU then preallocates
// metadata, which is not modelled).
absl::StatusOr<NewImageLayout> ComputeNewImageLayout(
    const NewImageOptions& options);

// The header QEMU leaves in the new image: fields from `options` and
// `layout`, plus the backing file/format and data file name extensions.
// EncodeHeader() of it is QEMU's cluster 0.
Header NewImageHeader(const NewImageOptions& options,
                      const NewImageLayout& layout);

// Every non-zero byte of the new image file, in ascending offset order:
// EncodeHeader(NewImageHeader()) at offset 0, then layout.metadata. All other
// bytes up to layout.file_size (the L1 table included) are zero; the file
// must be exactly layout.file_size bytes long.
std::vector<FileExtent> NewImageContents(const NewImageOptions& options,
                                         const NewImageLayout& layout);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_LAYOUT_H_
