// The VM state area of a qcow2 image (QEMU 7.2's qcow2_save_vmstate and
// qcow2_load_vmstate): guest offsets past the virtual disk, from
// vm_state_offset() on, mapped by the same L1/L2 tables.
#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/status_macros.h"
#include "io/sync.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {

uint64_t Qcow2Node::vm_state_offset() const {
  // QEMU: l1_vm_state_index = size_to_l1(total_sectors * 512).
  const uint64_t l1_coverage = cluster_size_ * l2_entries_;
  const uint64_t disk = size() / 512 * 512;
  return (disk + l1_coverage - 1) / l1_coverage * l1_coverage;
}

io::Task<absl::Status> Qcow2Node::WriteVmState(uint64_t pos,
                                               io::ConstIoVec data) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrCat(filename(), ": image is read-only"));
  }
  const uint64_t l1_coverage = cluster_size_ * l2_entries_;
  uint64_t offset = vm_state_offset() + pos;
  // QEMU's qcow2_co_save_vmstate raises vmstate_save before its write.
  co_await file_->DebugEvent(io::BlkdebugEvent::kVmstateSave);
  // One L1 entry's range at a time: QEMU grows the L1 table when a write
  // first reaches an entry past its end.
  while (!data.empty()) {
    const uint64_t n =
        std::min<uint64_t>(data.size(), l1_coverage - offset % l1_coverage);
    {
      auto lock = co_await io::ScopedLock::Take(meta_lock_);
      CO_RETURN_IF_ERROR(CheckUsable());
      CO_RETURN_IF_ERROR(co_await GrowL1(l1_index(offset) + 1, false));
    }
    CO_RETURN_IF_ERROR(co_await WriteGuest(offset, data.first(n)));
    offset += n;
    data.remove_prefix(n);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::ReadVmState(uint64_t pos, io::IoVec buf) {
  // QEMU's qcow2_co_load_vmstate raises vmstate_load before its read.
  co_await file_->DebugEvent(io::BlkdebugEvent::kVmstateLoad);
  co_return co_await ReadGuest(vm_state_offset() + pos, buf);
}

}  // namespace imgtool::qcow2
