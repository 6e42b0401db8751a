#include "qcow2/bitmap_load.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "qcow2/format/endian.h"

namespace imgtool::qcow2 {

using format::internal::LoadBE64;

io::Task<absl::Status> ReadZeroPadded(io::BlockNode& file, uint64_t offset,
                                      absl::Span<uint8_t> out) {
  std::fill(out.begin(), out.end(), 0);
  const uint64_t file_size = file.size();
  if (out.empty() || offset >= file_size) co_return absl::OkStatus();
  const uint64_t avail = std::min<uint64_t>(out.size(), file_size - offset);
  co_return co_await file.Read(offset, io::IoVec(out.data(), avail));
}

io::Task<absl::StatusOr<std::vector<LoadedBitmap>>> LoadPersistentBitmaps(
    io::BlockNode& file, const format::BitmapsExtension& ext,
    uint32_t cluster_bits, uint64_t image_size) {
  const uint64_t cluster_size = uint64_t{1} << cluster_bits;
  std::vector<uint8_t> dir(ext.bitmap_directory_size);
  if (!dir.empty() && dir.size() <= format::kMaxBitmapDirectorySize) {
    CO_RETURN_IF_ERROR(co_await ReadZeroPadded(
        file, ext.bitmap_directory_offset, absl::MakeSpan(dir)));
  }
  CO_ASSIGN_OR_RETURN(std::vector<format::BitmapDirEntry> entries,
                      format::DecodeBitmapDirectory(dir, ext.nb_bitmaps,
                                                    cluster_bits, image_size));
  std::vector<LoadedBitmap> out;
  std::vector<uint8_t> cluster(cluster_size);
  for (format::BitmapDirEntry& e : entries) {
    LoadedBitmap bm;
    bm.entry = std::move(e);
    if (bm.entry.in_use()) {
      out.push_back(std::move(bm));
      continue;
    }
    const std::string& name = bm.entry.name;
    std::vector<uint8_t> raw(uint64_t{bm.entry.table_size} * 8);
    CO_RETURN_IF_ERROR(co_await ReadZeroPadded(file, bm.entry.table_offset,
                                               absl::MakeSpan(raw)));
    bm.table.resize(bm.entry.table_size);
    for (uint64_t i = 0; i < bm.table.size(); ++i) {
      bm.table[i] = LoadBE64(raw.data() + i * 8);
      if (!format::BitmapTableEntryValid(bm.table[i], cluster_size)) {
        co_return absl::DataLossError(absl::StrCat(
            "Could not read bitmap_table table from image for bitmap '", name,
            "': Invalid argument"));
      }
    }
    const uint32_t g = bm.entry.granularity_bits;
    if (format::BitmapTableSize(image_size, g, cluster_bits) !=
        bm.entry.table_size) {
      co_return absl::DataLossError(absl::StrCat(
          "Could not read bitmap '", name, "' from image: Invalid argument"));
    }
    const uint64_t gran = uint64_t{1} << g;
    const uint64_t nbits = image_size / gran + (image_size % gran != 0);
    bm.bits.assign((nbits + 63) / 64, 0);
    const uint64_t words_per_cluster = cluster_size / 8;
    for (uint64_t i = 0; i < bm.table.size(); ++i) {
      const uint64_t first_word = i * words_per_cluster;
      if (first_word >= bm.bits.size()) break;
      const uint64_t n =
          std::min(words_per_cluster, bm.bits.size() - first_word);
      const uint64_t offset = bm.table[i] & format::kBitmapTableOffsetMask;
      if (offset == 0) {
        if (bm.table[i] & format::kBitmapTableAllOnes) {
          std::fill_n(bm.bits.begin() + first_word, n, ~uint64_t{0});
        }
        continue;
      }
      CO_RETURN_IF_ERROR(
          co_await ReadZeroPadded(file, offset, absl::MakeSpan(cluster)));
      for (uint64_t w = 0; w < n; ++w) {
        uint64_t v = 0;
        for (int b = 7; b >= 0; --b) v = (v << 8) | cluster[w * 8 + b];
        bm.bits[first_word + w] = v;
      }
    }
    if (nbits % 64 != 0) bm.bits.back() &= (uint64_t{1} << (nbits % 64)) - 1;
    out.push_back(std::move(bm));
  }
  co_return out;
}

}  // namespace imgtool::qcow2
