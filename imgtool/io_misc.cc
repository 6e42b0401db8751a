// imgtool io: length, info, map, alloc, sleep, sigraise, abort and the
// breakpoint commands.
#include <getopt.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_output.h"
#include "imgtool/io_session.h"
#include "block/registry.h"
#include "io/chain_status.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli::qemu_io {

absl::StatusOr<std::pair<bool, uint64_t>> Session::IsAllocated(
    uint64_t offset, uint64_t max_bytes) {
  const uint64_t node_size = node().size();
  if (offset >= node_size) return std::make_pair(true, max_bytes);
  ASSIGN_OR_RETURN(
      io::ChainStatus cs,
      Wait(io::GetChainStatus(node(), offset,
                              std::min(max_bytes, node_size - offset))));
  return std::make_pair(cs.depth == 0 && cs.present,
                        std::max<uint64_t>(cs.status.length, 1));
}

bool Session::CmdLength(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) {
    out() << "getlength: " << std::strerror(ENOMEDIUM) << "\n";
    return false;
  }
  out() << HumanBytes(static_cast<double>(ImageLength())) << "\n";
  return true;
}

bool Session::CmdInfo(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) return false;  // qemu-io: bdrv_get_info fails silently
  out() << "format name: " << image_.format << "\n";
  // qemu-io 7.2 prints a protocol driver's name twice (its format_name and
  // its protocol_name: file, null-co, null-aio, blkdebug).
  const block::Driver* driver = block::FindDriver(image_.format);
  if (driver != nullptr && driver->kind == block::DriverKind::kProtocol) {
    out() << "format name: " << image_.format << "\n";
  }
  // Through filters (copy-on-read, blkdebug) and raw, QEMU's bdrv_get_info
  // answers with the qcow2 node below; its specific information only for a
  // qcow2 node on top.
  const qcow2::Qcow2Node* q =
      image_.qcow2 != nullptr ? image_.qcow2 : image_.qcow2_below;
  if (q == nullptr) {
    // QEMU's bdrv_get_info answers from the file at the bottom (no clusters,
    // no VM state area) and fails with ENOTSUP, silently in qemu-io, where
    // there is none (null-co, null-aio).
    if (image_.file == nullptr) return false;
    out() << "cluster size: " << HumanBytes(0) << "\n"
          << "vm state offset: " << HumanBytes(0) << "\n";
    return true;
  }
  const uint64_t vm_state = q->vm_state_offset();
  const bool v3 = q->header().version >= 3;
  auto flag = [](bool b) { return b ? "true" : "false"; };
  out() << "cluster size: "
        << HumanBytes(static_cast<double>(q->cluster_size())) << "\n"
        << "vm state offset: " << HumanBytes(static_cast<double>(vm_state))
        << "\n";
  if (image_.qcow2 == nullptr) return true;
  out() << "Format specific information:\n"
        << "    compat: " << q->compat() << "\n"
        << "    compression type: "
        << (q->header().compression_type == 0 ? "zlib" : "zstd") << "\n";
  if (v3) out() << "    lazy refcounts: " << flag(q->lazy_refcounts()) << "\n";
  out() << "    refcount bits: " << q->refcount_bits() << "\n";
  if (v3) {
    out() << "    corrupt: " << flag(q->corrupt()) << "\n"
          << "    extended l2: " << flag(q->extended_l2()) << "\n";
  }
  return true;
}

bool Session::CmdMap(const CommandDef&, std::vector<std::string>&) {
  if (driver_dropped_) {
    err() << ProgramName()
          << ": Failed to query image length: " << std::strerror(ENOMEDIUM)
          << "\n";
    return false;
  }
  const uint64_t length = ImageLength();
  uint64_t offset = 0;
  while (offset < length) {
    absl::StatusOr<std::pair<bool, uint64_t>> first =
        IsAllocated(offset, length - offset);
    if (!first.ok()) {
      const std::string why = FailureText(first.status());
      err() << ProgramName() << ": Failed to get allocation status: " << why
            << "\n";
      return false;
    }
    const bool allocated = first->first;
    uint64_t run = first->second;
    while (offset + run < length) {
      absl::StatusOr<std::pair<bool, uint64_t>> next =
          IsAllocated(offset + run, length - offset - run);
      if (!next.ok()) {
        // As qemu-io's map_is_allocated: a failure while extending the run
        // ends the run, which is printed; the next query reports it (a
        // corruption event is still printed now, when it happens).
        FailureText(next.status());
        break;
      }
      if (next->first != allocated) break;
      run += next->second;
    }
    out() << absl::StrFormat(
        "%s (0x%x) bytes %s allocated at offset %s (0x%x)\n",
        HumanBytes(static_cast<double>(run)), run, allocated ? "   " : "not",
        HumanBytes(static_cast<double>(offset)), offset);
    offset += run;
  }
  return true;
}

bool Session::CmdAlloc(const CommandDef&, std::vector<std::string>& words) {
  uint64_t offset = 0, count = kSectorSize;
  if (!ParseNumber(words[1], &offset)) return false;
  if (words.size() > 2 && !ParseNumber(words[2], &count)) return false;
  const uint64_t length = ImageLength();
  count = offset < length ? std::min(count, length - offset) : 0;
  uint64_t allocated = 0;
  for (uint64_t done = 0; done < count;) {
    absl::StatusOr<std::pair<bool, uint64_t>> st =
        IsAllocated(offset + done, count - done);
    if (!st.ok()) {
      const std::string why = FailureText(st.status());
      out() << "is_allocated failed: " << why << "\n";
      return false;
    }
    if (st->first) allocated += st->second;
    done += st->second;
  }
  out() << allocated << "/" << count << " bytes allocated at offset "
        << HumanBytes(static_cast<double>(offset)) << "\n";
  return true;
}

bool Session::CmdSleep(const CommandDef&, std::vector<std::string>& words) {
  char* end = nullptr;
  errno = 0;
  const long long ms = std::strtoll(words[1].c_str(), &end, 0);
  if (words[1].empty() || *end != '\0' || errno != 0 || ms < 0) {
    out() << words[1] << " is not a valid number\n";
    return false;
  }
  // The event loop keeps running: aio requests complete meanwhile.
  const Clock::time_point deadline =
      Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < deadline) {
    if (image_.engine != nullptr && engine().in_flight() > 0) {
      if (!engine().Poll(/*wait=*/false).ok()) std::abort();
      PrintAioOutput();
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(
        deadline - Clock::now(), std::chrono::milliseconds(1)));
  }
  if (image_.engine != nullptr) PrintAioOutput();
  return true;
}

bool Session::CmdSigraise(const CommandDef&, std::vector<std::string>& words) {
  uint64_t sig = 0;
  if (!ParseNumber(words[1], &sig)) return false;
  if (sig > NSIG) {
    out() << "signal argument '" << words[1]
          << "' is too large to be a valid signal\n";
    return false;
  }
  // As qemu-io: stdout and stderr are flushed first, since raise() may end
  // the process without flushing them.
  out().flush();
  err().flush();
  std::fflush(stdout);
  std::fflush(stderr);
  std::raise(static_cast<int>(sig));
  return true;
}

bool Session::CmdAbort(const CommandDef&, std::vector<std::string>&) {
  std::abort();  // qemu-io's abort(3), with nothing flushed
}

// The breakpoint commands act on the first blkdebug node below the top
// (io::BlockNode::DebugBreakpoint and friends); without one they fail with
// ENOTSUP, as qemu-io's. Messages are qemu-io 7.2's (qemu-io-cmds.c).
bool Session::CmdBreak(const CommandDef&, std::vector<std::string>& words) {
  if (absl::Status st = node().DebugBreakpoint(words[1], words[2]); !st.ok()) {
    out() << "Could not set breakpoint: " << ErrorText(st) << "\n";
    return false;
  }
  return true;
}

bool Session::CmdWaitBreak(const CommandDef&, std::vector<std::string>& words) {
  // qemu-io runs its event loop until a request is suspended under the tag,
  // forever if none ever is; imgtool stops once nothing is left that could
  // get there (no blkdebug node, or no request in flight).
  const std::string& tag = words[1];
  PrintAioOutput();
  while (!node().DebugIsSuspended(tag)) {
    if (engine().in_flight() == 0) {
      out() << "Could not wait for a breakpoint: no request in flight\n";
      return false;
    }
    if (!engine().Poll(/*wait=*/true).ok()) std::abort();
    PrintAioOutput();
  }
  return true;
}

bool Session::CmdResume(const CommandDef&, std::vector<std::string>& words) {
  absl::Status st = node().DebugResume(words[1]);
  PrintAioOutput();  // what the resumed request printed on its way
  if (!st.ok()) {
    out() << "Could not resume request: " << ErrorText(st) << "\n";
    return false;
  }
  return true;
}

bool Session::CmdRemoveBreak(const CommandDef&,
                             std::vector<std::string>& words) {
  absl::Status st = node().DebugRemoveBreakpoint(words[1]);
  PrintAioOutput();
  if (!st.ok()) {
    out() << "Could not remove breakpoint " << words[1] << ": "
          << ErrorText(st) << "\n";
    return false;
  }
  return true;
}

}  // namespace imgtool::cli::qemu_io
