// qcow2 snapshot table entries (qcow2 spec, "Snapshots"), with QEMU 7.2's
// limits and defaults (block/qcow2.h, qcow2_do_read_snapshots and
// qcow2_write_snapshots in block/qcow2-snapshot.c). No I/O: the caller
// reads an entry in three parts (the fixed 40 bytes, then its extra data,
// then its id and name) and DecodeSnapshotEntry puts them together;
// EncodeSnapshotTable gives the bytes of a whole table. Sizes and offsets
// are bytes unless the name says otherwise.
//
// An entry: l1_table_offset (u64), l1_size (u32, entries), id_str_size
// (u16), name_size (u16), date_sec (u32), date_nsec (u32), vm_clock_nsec
// (u64), vm_state_size (u32), extra_data_size (u32), then the extra data
// (version 3 wants at least 16 bytes: vm_state_size_large (u64), disk_size
// (u64); QEMU 7.2 also knows icount (u64)), the id and the name (neither
// NUL-terminated), and padding to a multiple of 8 before the next entry.
// Thread model: plain values and pure functions, safe from any thread.
#ifndef IMGTOOL_QCOW2_FORMAT_SNAPSHOT_H_
#define IMGTOOL_QCOW2_FORMAT_SNAPSHOT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/types/span.h"

namespace imgtool::qcow2::format {

// The fixed part of an entry.
inline constexpr uint32_t kSnapshotHeaderBytes = 40;
// Extra data QEMU 7.2 knows (QCowSnapshotExtraData): vm_state_size_large,
// disk_size, icount. Every entry QEMU writes has at least this much.
inline constexpr uint32_t kSnapshotExtraKnownBytes = 24;
// Version 3 requires vm_state_size_large and disk_size; an entry with less
// is "incomplete" to `qemu-img check`.
inline constexpr uint32_t kSnapshotExtraV3MinBytes = 16;
// QCOW_MAX_SNAPSHOT_EXTRA_DATA: more extra data fails the open ("Too much
// extra metadata in snapshot table entry N"); `check -r all` cuts it.
inline constexpr uint32_t kMaxSnapshotExtraData = 1024;
// QCOW_MAX_SNAPSHOTS_SIZE: the table's length (entries padded to 8, extra
// data as kept) may not exceed it ("Snapshot table is too big").
inline constexpr uint64_t kMaxSnapshotTableBytes = uint64_t{1024} * 65536;
// kMaxSnapshots (65536, QCOW_MAX_SNAPSHOTS) is in header.h.

// One snapshot table entry with QEMU's view of its extra data.
struct SnapshotEntry {
  uint64_t l1_offset = 0;
  uint32_t l1_size = 0;  // entries
  uint32_t date_sec = 0;
  uint32_t date_nsec = 0;
  uint64_t vm_clock_nsec = 0;
  // The 64-bit vm_state_size_large if the extra data has it, else the
  // 32-bit field.
  uint64_t vm_state_size = 0;
  // Extra data bytes as stored (or as kept, when cut to
  // kMaxSnapshotExtraData).
  uint32_t extra_data_size = 0;
  uint64_t disk_size = 0;          // the caller's default if absent
  uint64_t icount = ~uint64_t{0};  // -1 if absent
  // The extra data past the known 24 bytes (extra_data_size - 24 bytes, or
  // empty), kept as it is.
  std::vector<uint8_t> unknown_extra;
  // Decoded as QEMU's C strings: the stored id_str_size / name_size bytes
  // up to the first NUL (DecodeSnapshotEntry); encoded as they are.
  std::string id;
  std::string name;
};

// What the fixed part says about the rest of an entry.
struct SnapshotEntryLayout {
  uint32_t extra_data_size = 0;
  uint16_t id_size = 0;
  uint16_t name_size = 0;
};

// The sizes in an entry's fixed part; `header` has at least
// kSnapshotHeaderBytes bytes.
SnapshotEntryLayout DecodeSnapshotEntryLayout(absl::Span<const uint8_t> header);

// An entry from its fixed part (kSnapshotHeaderBytes bytes), its extra data
// (`extra`: the stored bytes, or their first kMaxSnapshotExtraData when cut;
// extra_data_size becomes extra.size()) and its id and name, back to back
// (`strings`: id_size + name_size bytes of the layout). Fields the extra
// data is too short for take QEMU's defaults: vm_state_size the 32-bit
// field, disk_size `default_disk_size` (QEMU: the image's size in whole
// 512-byte sectors), icount -1.
SnapshotEntry DecodeSnapshotEntry(absl::Span<const uint8_t> header,
                                  absl::Span<const uint8_t> extra,
                                  absl::Span<const uint8_t> strings,
                                  uint64_t default_disk_size);

// Bytes of `e` as qcow2_write_snapshots stores it, without padding: the
// extra data grown to at least kSnapshotExtraKnownBytes.
uint64_t SnapshotEntryBytes(const SnapshotEntry& e);

// Bytes of a table of `entries` (each entry but the first starting at a
// multiple of 8 from the table's start).
uint64_t SnapshotTableBytes(const std::vector<SnapshotEntry>& entries);

// The table as qcow2_write_snapshots writes it: every entry with at least
// the 24 known bytes of extra data (vm_state_size_large, disk_size, icount,
// then unknown_extra), the 32-bit vm_state_size 0 when the size does not fit
// in it, zero padding between entries; SnapshotTableBytes long. Ids and
// names longer than 65535 bytes are the caller's error (not checked).
std::vector<uint8_t> EncodeSnapshotTable(const std::vector<SnapshotEntry>& entries);

}  // namespace imgtool::qcow2::format

#endif  // IMGTOOL_QCOW2_FORMAT_SNAPSHOT_H_
