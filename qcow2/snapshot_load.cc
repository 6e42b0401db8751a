#include "qcow2/snapshot_load.h"

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "qcow2/bitmap_load.h"

namespace imgtool::qcow2 {
namespace {

absl::Status TooBig(const std::string& message) {
  return WithMessage(ErrnoStatus("", message, EFBIG), message);
}

// BDRV_MAX_LENGTH: INT64_MAX aligned down to 1 GiB.
constexpr uint64_t kMaxRequestEnd = (uint64_t{1} << 63) - (uint64_t{1} << 30);

// qcow2_do_read_snapshots' message for a failed read.
absl::Status ReadFailed(int error_number) {
  return WithMessage(ErrnoStatus("", "read", error_number),
                     absl::StrCat("Failed to read snapshot table: ",
                                  std::strerror(error_number)));
}

}  // namespace

io::Task<absl::StatusOr<LoadedSnapshots>> LoadSnapshotTable(
    io::BlockNode& file, uint64_t offset, uint32_t nb,
    uint64_t default_disk_size, std::ostream* repair) {
  LoadedSnapshots out;
  if (nb == 0) co_return out;
  // Reads go through a window of the file so that a table of thousands of
  // entries costs a few reads; past the end of the file: zeroes. The
  // window starts at 4 KiB and doubles with each refill up to 256 KiB, so
  // that the usual table of a few entries is one small read.
  constexpr uint64_t kWindow = 256 * 1024;
  std::vector<uint8_t> window;
  uint64_t window_start = 0;
  auto read = [&](uint64_t pos, uint8_t* dst,
                  uint64_t n) -> io::Task<absl::Status> {
    // QEMU's block layer refuses a request reaching past BDRV_MAX_LENGTH
    // with EIO (bdrv_check_request), even of 0 bytes.
    if (pos > kMaxRequestEnd || n > kMaxRequestEnd - pos) {
      co_return ReadFailed(EIO);
    }
    while (n > 0) {
      if (window.empty() || pos < window_start ||
          pos >= window_start + window.size()) {
        window_start = pos;
        window.resize(std::min<uint64_t>(
            kWindow, std::max<uint64_t>(4096, window.size() * 2)));
        if (absl::Status st =
                co_await ReadZeroPadded(file, pos, absl::MakeSpan(window));
            !st.ok()) {
          window.clear();
          const int e = StatusErrno(st);
          co_return e != 0 ? ReadFailed(e) : st;
        }
      }
      const uint64_t k = std::min(n, window_start + window.size() - pos);
      std::memcpy(dst, window.data() + (pos - window_start), k);
      dst += k;
      pos += k;
      n -= k;
    }
    co_return absl::OkStatus();
  };

  out.entries.reserve(nb);
  uint64_t pos = offset;
  uint64_t table_length = 0;  // the entries as kept, padded to 8
  for (uint32_t i = 0; i < nb; ++i) {
    const uint64_t pre_pos = pos;
    table_length = (table_length + 7) & ~uint64_t{7};
    pos = (pos + 7) & ~uint64_t{7};
    uint8_t header[format::kSnapshotHeaderBytes];
    CO_RETURN_IF_ERROR(co_await read(pos, header, sizeof(header)));
    pos += sizeof(header);
    const format::SnapshotEntryLayout layout =
        format::DecodeSnapshotEntryLayout(header);
    uint64_t kept_extra = layout.extra_data_size;
    if (layout.extra_data_size > format::kMaxSnapshotExtraData) {
      if (repair == nullptr) {
        co_return TooBig(absl::StrFormat(
            "Too much extra metadata in snapshot table entry %u\n"
            "You can force-remove this extra metadata with qemu-img check "
            "-r all",
            i));
      }
      *repair << "Discarding too much extra metadata in snapshot table entry "
              << i << " (" << layout.extra_data_size << " > "
              << format::kMaxSnapshotExtraData << ")\n";
      ++out.extra_cut;
      kept_extra = format::kMaxSnapshotExtraData;
    }
    std::vector<uint8_t> extra(kept_extra);
    CO_RETURN_IF_ERROR(co_await read(pos, extra.data(), extra.size()));
    pos += layout.extra_data_size;
    std::vector<uint8_t> strings(uint64_t{layout.id_size} + layout.name_size);
    CO_RETURN_IF_ERROR(co_await read(pos, strings.data(), strings.size()));
    pos += strings.size();
    // The extra data counts as kept.
    table_length += format::kSnapshotHeaderBytes + kept_extra + strings.size();
    if (table_length > format::kMaxSnapshotTableBytes ||
        pos - offset > uint64_t{INT_MAX}) {
      if (repair == nullptr) {
        co_return TooBig(absl::StrFormat(
            "Snapshot table is too big\n"
            "You can force-remove all %u overhanging snapshots with "
            "qemu-img check -r all",
            nb - i));
      }
      *repair << "Discarding " << nb - i
              << " overhanging snapshots (snapshot table is too big)\n";
      out.dropped = nb - i;
      pos = pre_pos;
      break;
    }
    out.entries.push_back(format::DecodeSnapshotEntry(
        absl::MakeConstSpan(header), extra, strings, default_disk_size));
  }
  out.bytes = pos - offset;
  co_return out;
}

}  // namespace imgtool::qcow2
