#include "imgtool/snapshot_list.h"

#include <time.h>

#include <cstdint>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/size.h"

namespace imgtool::cli {

SnapshotInfo SnapshotInfoOf(const qcow2::Qcow2Node::SnapshotRecord& record) {
  constexpr uint64_t kNsPerSec = 1000000000;
  SnapshotInfo sn;
  if (record.icount != ~uint64_t{0}) sn.set_icount(record.icount);
  sn.set_vm_clock_nsec(record.vm_clock_nsec % kNsPerSec);
  sn.set_name(record.name);
  sn.set_date_sec(record.date_sec);
  sn.set_date_nsec(record.date_nsec);
  sn.set_vm_clock_sec(record.vm_clock_nsec / kNsPerSec);
  sn.set_id(record.id);
  sn.set_vm_state_size(record.vm_state_size);
  return sn;
}

std::string FormatSnapshotList(
    const google::protobuf::RepeatedPtrField<SnapshotInfo>& snapshots) {
  std::string text = absl::StrCat(
      "Snapshot list:\n",
      absl::StrFormat("%-10s%-17s%8s%20s%13s%11s\n", "ID", "TAG", "VM SIZE",
                      "DATE", "VM CLOCK", "ICOUNT"));
  for (const SnapshotInfo& sn : snapshots) {
    const time_t date = static_cast<time_t>(sn.date_sec());
    struct tm tm;
    localtime_r(&date, &tm);
    char date_text[64];
    strftime(date_text, sizeof(date_text), "%Y-%m-%d %H:%M:%S", &tm);
    const uint64_t secs = sn.vm_clock_sec();
    const std::string clock = absl::StrFormat(
        "%02d:%02d:%02d.%03d", static_cast<int>(secs / 3600),
        static_cast<int>(secs / 60 % 60), static_cast<int>(secs % 60),
        static_cast<int>(sn.vm_clock_nsec() / 1000000));
    const std::string icount =
        sn.has_icount() ? absl::StrCat(sn.icount()) : std::string();
    absl::StrAppend(&text,
                    absl::StrFormat("%-9s %-16s %8s%20s%13s%11s\n", sn.id(),
                                    sn.name(),
                                    FormatHumanSize(sn.vm_state_size()),
                                    date_text, clock, icount));
  }
  return text;
}

}  // namespace imgtool::cli
