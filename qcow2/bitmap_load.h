// Loading the persistent dirty bitmaps of a qcow2 image from its file, as
// QEMU 7.2's qcow2_load_dirty_bitmaps does at every open
// (block/qcow2-bitmap.c): the directory (format::DecodeBitmapDirectory's
// checks and messages), then for each bitmap not in use its table
// (QEMU's check_table_entry) and data. Shared by the qcow2 driver's open
// and `check` (qemu-img check fails at open when the bitmaps do not load).
// Bytes past the end of the file read as zeroes, as QEMU's bdrv_pread of a
// short file gives them: a directory past the end is all zeroes ("Bitmap ''
// doesn't satisfy the constraints"), a table there is all zero entries.
// Thread model: a coroutine on the file node's engine thread.
#ifndef IMGTOOL_QCOW2_BITMAP_LOAD_H_
#define IMGTOOL_QCOW2_BITMAP_LOAD_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/format/bitmap.h"
#include "qcow2/format/header.h"

namespace imgtool::qcow2 {

struct LoadedBitmap {
  format::BitmapDirEntry entry;  // as on disk
  // For a bitmap not in use: its table as read (entry.table_size words)
  // and its bits, bit i covering guest bytes [i << g, (i + 1) << g), the
  // bits past the image end clear. Both empty for a bitmap in use (QEMU
  // does not read those: inconsistent).
  std::vector<uint64_t> table;
  std::vector<uint64_t> bits;
};

// Reads out.size() bytes of `file` at `offset` (bytes); the part past the
// end of the file (file.size()) reads as zeroes, as QEMU's bdrv_pread of a
// short file gives them (bitmap directories and tables, the checker's
// snapshot table). Read errors of `file` as they are.
io::Task<absl::Status> ReadZeroPadded(io::BlockNode& file, uint64_t offset,
                                      absl::Span<uint8_t> out);

// Reads the bitmaps that `ext` describes from `file`, of an image of
// `image_size` bytes (the virtual size) with clusters of 2^cluster_bits.
// Errors, kDataLoss with QEMU's messages (callers prefix "Could not open
// '<file>': "): those of format::DecodeBitmapDirectory; "Could not read
// bitmap_table table from image for bitmap 'NAME': Invalid argument" for a
// table entry with reserved bits or an unaligned offset; "Could not read
// bitmap 'NAME' from image: Invalid argument" for a table whose size does
// not fit the image size. Read errors of `file` as they are.
io::Task<absl::StatusOr<std::vector<LoadedBitmap>>> LoadPersistentBitmaps(
    io::BlockNode& file, const format::BitmapsExtension& ext,
    uint32_t cluster_bits, uint64_t image_size);

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_BITMAP_LOAD_H_
