#include "qcow2/format/snapshot.h"

#include <algorithm>

#include "qcow2/format/endian.h"

namespace imgtool::qcow2::format {

using internal::LoadBE16;
using internal::LoadBE32;
using internal::LoadBE64;
using internal::StoreBE16;
using internal::StoreBE32;
using internal::StoreBE64;

SnapshotEntryLayout DecodeSnapshotEntryLayout(absl::Span<const uint8_t> header) {
  SnapshotEntryLayout l;
  l.id_size = LoadBE16(header.data() + 12);
  l.name_size = LoadBE16(header.data() + 14);
  l.extra_data_size = LoadBE32(header.data() + 36);
  return l;
}

SnapshotEntry DecodeSnapshotEntry(absl::Span<const uint8_t> header,
                                  absl::Span<const uint8_t> extra,
                                  absl::Span<const uint8_t> strings,
                                  uint64_t default_disk_size) {
  const uint8_t* h = header.data();
  const SnapshotEntryLayout layout = DecodeSnapshotEntryLayout(header);
  SnapshotEntry e;
  e.l1_offset = LoadBE64(h);
  e.l1_size = LoadBE32(h + 8);
  e.date_sec = LoadBE32(h + 16);
  e.date_nsec = LoadBE32(h + 20);
  e.vm_clock_nsec = LoadBE64(h + 24);
  e.vm_state_size = LoadBE32(h + 32);
  e.extra_data_size = static_cast<uint32_t>(extra.size());
  if (extra.size() >= 8) e.vm_state_size = LoadBE64(extra.data());
  e.disk_size = extra.size() >= 16 ? LoadBE64(extra.data() + 8) : default_disk_size;
  if (extra.size() >= 24) e.icount = LoadBE64(extra.data() + 16);
  if (extra.size() > kSnapshotExtraKnownBytes) {
    e.unknown_extra.assign(extra.begin() + kSnapshotExtraKnownBytes, extra.end());
  }
  const size_t id_size = std::min<size_t>(layout.id_size, strings.size());
  e.id.assign(strings.begin(), strings.begin() + id_size);
  e.name.assign(strings.begin() + id_size, strings.end());
  // QEMU reads both into C strings: each ends at its first NUL, and every
  // later write of the table stores them so (strlen).
  e.id.resize(std::min(e.id.size(), e.id.find('\0')));
  e.name.resize(std::min(e.name.size(), e.name.find('\0')));
  return e;
}

uint64_t SnapshotEntryBytes(const SnapshotEntry& e) {
  return uint64_t{kSnapshotHeaderBytes} +
         std::max(kSnapshotExtraKnownBytes, e.extra_data_size) + e.id.size() +
         e.name.size();
}

uint64_t SnapshotTableBytes(const std::vector<SnapshotEntry>& entries) {
  uint64_t bytes = 0;
  for (const SnapshotEntry& e : entries) {
    bytes = ((bytes + 7) & ~uint64_t{7}) + SnapshotEntryBytes(e);
  }
  return bytes;
}

std::vector<uint8_t> EncodeSnapshotTable(
    const std::vector<SnapshotEntry>& entries) {
  std::vector<uint8_t> table(SnapshotTableBytes(entries), 0);
  uint64_t at = 0;
  for (const SnapshotEntry& e : entries) {
    at = (at + 7) & ~uint64_t{7};
    const uint32_t extra_size = std::max(kSnapshotExtraKnownBytes, e.extra_data_size);
    uint8_t* p = table.data() + at;
    StoreBE64(p, e.l1_offset);
    StoreBE32(p + 8, e.l1_size);
    StoreBE16(p + 12, static_cast<uint16_t>(e.id.size()));
    StoreBE16(p + 14, static_cast<uint16_t>(e.name.size()));
    StoreBE32(p + 16, e.date_sec);
    StoreBE32(p + 20, e.date_nsec);
    StoreBE64(p + 24, e.vm_clock_nsec);
    // A VM state too large for 32 bits reads as none to old readers.
    StoreBE32(p + 32, e.vm_state_size <= 0xffffffffu
                          ? static_cast<uint32_t>(e.vm_state_size)
                          : 0);
    StoreBE32(p + 36, extra_size);
    p += kSnapshotHeaderBytes;
    StoreBE64(p, e.vm_state_size);
    StoreBE64(p + 8, e.disk_size);
    StoreBE64(p + 16, e.icount);
    // unknown_extra has extra_data_size - 24 bytes when the entry came from
    // DecodeSnapshotEntry; never more than the entry's room.
    std::copy_n(e.unknown_extra.begin(),
                std::min<uint64_t>(e.unknown_extra.size(),
                                   extra_size - kSnapshotExtraKnownBytes),
                p + kSnapshotExtraKnownBytes);
    p += extra_size;
    std::copy(e.id.begin(), e.id.end(), p);
    std::copy(e.name.begin(), e.name.end(), p + e.id.size());
    at += SnapshotEntryBytes(e);
  }
  return table;
}

}  // namespace imgtool::qcow2::format
