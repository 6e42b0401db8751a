// imgtool io: the request commands (read, write, readv, writev, aio_read,
// aio_write, aio_flush, discard, flush, truncate) and their arguments.
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
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_output.h"
#include "imgtool/io_session.h"
#include "compress_filter/compress_filter.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli::qemu_io {

// Runs one request against `node` the way qemu's BlockBackend checks it:
// a range past `image_length` (the 512-rounded length) fails with EIO. With
// `write_through` (the writethrough and directsync cache modes: QEMU's
// BlockBackend without a write cache) every write is followed by a flush of
// the node, as QEMU emulates FUA for drivers such as qcow2: their metadata
// caches reach the file after each write.
io::Task<absl::Status> RunRequest(io::BlockNode* node, uint64_t image_length,
                                  Request r, bool write_through) {
  const bool vmstate =
      r.kind == Request::kReadVmState || r.kind == Request::kWriteVmState;
  if (!vmstate &&
      (r.offset > image_length || image_length - r.offset < r.bytes)) {
    co_return ErrnoStatus(node->filename(), "request", EIO);
  }
  auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(node);
  // Only qcow2 has a VM state area. Every other driver passes the request
  // to its primary child (QEMU 7.2's bdrv_co_readv_vmstate/writev_vmstate:
  // a filter such as compress or blkdebug, raw over qcow2), ENOTSUP at the
  // bottom.
  qcow2::Qcow2Node* vm_state = qcow2;
  for (io::BlockNode* n = node; vmstate && vm_state == nullptr && n != nullptr;
       n = n->primary_child()) {
    vm_state = dynamic_cast<qcow2::Qcow2Node*>(n);
  }
  if (vmstate && vm_state == nullptr)
    co_return ErrnoStatus("", "vmstate", ENOTSUP);
  absl::Status status;
  switch (r.kind) {
    case Request::kReadVmState:
      co_return co_await vm_state->ReadVmState(r.offset, r.buffer);
    case Request::kWriteVmState:
      status = co_await vm_state->WriteVmState(r.offset, r.buffer);
      break;
    case Request::kRead:
      co_return co_await node->Read(r.offset, r.buffer);
    case Request::kWrite:
      if (auto* compress = dynamic_cast<compress_filter::CompressNode*>(node);
          compress != nullptr && r.bytes == 0) {
        // QEMU hands a zero-length write on to the driver (here the
        // compress filter's compressed write); BlockNode::Write drops it.
        status = co_await compress->WriteEmpty(r.offset);
        break;
      }
      status = co_await node->Write(r.offset, r.buffer);
      break;
    case Request::kWriteCompressed: {
      // write -c: only qcow2 compresses (qemu-io: ENOTSUP elsewhere).
      if (qcow2 == nullptr) co_return ErrnoStatus("", "write", ENOTSUP);
      status = co_await qcow2->WriteCompressed(r.offset, r.buffer);
      if (absl::IsFailedPrecondition(status)) {
        // A cluster allocated already: QEMU's EIO.
        status = ErrnoStatus(node->filename(), status.message(), EIO);
      }
      break;
    }
    case Request::kWriteZeroes:
      status = co_await node->WriteZeroes(
          r.offset, r.bytes,
          io::WriteZeroesFlags{.may_unmap = r.may_unmap,
                               .no_fallback = r.no_fallback});
      break;
    case Request::kDiscard:
      if (r.discard_ignored) co_return absl::OkStatus();
      status = co_await node->Discard(r.offset, r.bytes);
      // Discard is advisory: a node that cannot discard has done its job.
      if (absl::IsUnimplemented(status)) status = absl::OkStatus();
      co_return status;
  }
  if (status.ok() && (r.fua || write_through)) {
    status = co_await node->Flush();
  }
  co_return status;
}

bool Session::GetIoOptions(const CommandDef& def,
                           std::vector<std::string>& words,
                           const char* optstring, IoOptions* opts,
                           std::vector<std::string>* operands) {
  const bool s_is_offset = std::strchr(optstring, 'l') != nullptr;
  return GetOptions(
      def, words, optstring,
      [&](int c, const char* arg) {
        uint64_t v = 0;
        uint8_t p = 0;
        switch (c) {
          case 'b':
            opts->vmstate = true;
            break;
          case 'c':
            opts->compressed = true;
            break;
          case 'C':
            opts->machine = true;
            break;
          case 'f':
            opts->fua = true;
            break;
          case 'i':
            opts->invalid = true;
            break;
          case 'l':
            if (!ParseNumber(arg, &v)) return false;
            opts->pattern_count = v;
            break;
          case 'n':
            opts->no_fallback = true;
            break;
          case 'p':
            break;  // ignored, as by qemu-io
          case 'P':
            if (!ParsePattern(arg, &p)) return false;
            opts->pattern = p;
            break;
          case 'q':
            opts->quiet = true;
            break;
          case 's':
            if (s_is_offset) {
              if (!ParseNumber(arg, &v)) return false;
              opts->pattern_offset = v;
            } else {
              opts->source_file = arg;
            }
            break;
          case 'u':
            opts->unmap = true;
            break;
          case 'v':
            opts->verbose = true;
            break;
          case 'z':
            opts->zero = true;
            break;
        }
        return true;
      },
      operands);
}

bool Session::RunTimed(const Request& r, absl::string_view op,
                       double* seconds) {
  if (driver_dropped_) {
    out() << op << " failed: " << std::strerror(ENOMEDIUM) << "\n";
    return false;
  }
  const Clock::time_point start = Clock::now();
  absl::Status st = Wait(RunRequest(&node(), ImageLength(), r, WriteThrough()));
  *seconds = Seconds(Clock::now() - start);
  if (!st.ok()) {
    const std::string why = FailureText(st);
    out() << op << " failed: " << why << "\n";
    return false;
  }
  return true;
}

bool Session::ReadAndCheck(const IoOptions& o, absl::string_view op,
                           uint64_t offset, uint64_t count,
                           uint64_t check_offset, uint64_t check_count) {
  std::vector<uint8_t> data(count, kReadFill);
  const Request r{.kind = o.vmstate ? Request::kReadVmState : Request::kRead,
                  .offset = offset,
                  .bytes = count,
                  .buffer = absl::MakeSpan(data)};
  double seconds = 0;
  if (!RunTimed(r, op, &seconds)) return false;
  const absl::Span<const uint8_t> buffer = data;
  bool ok = true;
  if (o.pattern.has_value() &&
      !AllBytesAre(buffer.subspan(check_offset, check_count), *o.pattern)) {
    out() << "Pattern verification failed at offset " << offset + check_offset
          << ", " << check_count << " bytes\n";
    ok = false;
  }
  if (o.quiet) return ok;
  if (o.verbose) out() << HexDump(buffer, offset);
  out() << Report("read", seconds, offset, buffer.size(), buffer.size(), 1,
                  o.machine);
  return ok;
}

bool Session::ParsePattern(const char* text, uint8_t* pattern) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 0);
  if (*text == '\0' || *end != '\0' || errno != 0 || v < 0 || v > 0xff) {
    out() << text << " is not a valid pattern byte\n";
    return false;
  }
  *pattern = static_cast<uint8_t>(v);
  return true;
}

bool Session::ParseLengths(absl::Span<const std::string> texts,
                           uint64_t* total) {
  *total = 0;
  for (const std::string& t : texts) {
    uint64_t len = 0;
    if (!ParseNumber(t, &len)) return false;
    if (len > kMaxRequestBytes) {
      out() << "Argument '" << t << "' exceeds maximum size "
            << kMaxRequestBytes << "\n";
      return false;
    }
    if (*total > kMaxRequestBytes - len) {
      out() << "The total number of bytes exceed the maximum size "
            << kMaxRequestBytes << "\n";
      return false;
    }
    *total += len;
  }
  return true;
}

bool Session::CheckSectorAligned(uint64_t offset, uint64_t count) {
  if (offset % kSectorSize != 0) {
    out() << offset << " is not a sector-aligned value for 'offset'\n";
    return false;
  }
  if (count % kSectorSize != 0) {
    out() << count << " is not a sector-aligned value for 'count'\n";
    return false;
  }
  return true;
}

bool Session::FillFromFile(const std::string& path,
                           std::vector<uint8_t>& buffer) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    err() << path << ": " << std::strerror(errno) << "\n";
    return false;
  }
  std::vector<uint8_t> content;
  content.reserve(buffer.size());
  char chunk[65536];
  while (content.size() < buffer.size() &&
         in.read(chunk, sizeof(chunk)).gcount() > 0) {
    content.insert(content.end(), chunk, chunk + in.gcount());
  }
  if (in.bad()) {
    err() << path << ": " << std::strerror(EISDIR) << "\n";
    return false;
  }
  if (content.empty()) {
    err() << path << ": file is empty\n";
    return false;
  }
  for (size_t i = 0; i < buffer.size(); ++i) {
    buffer[i] = content[i % content.size()];
  }
  return true;
}

bool Session::ParseOffsetAndLengths(const std::vector<std::string>& operands,
                                    uint64_t* offset, uint64_t* count) {
  return ParseNumber(operands[0], offset) &&
         ParseLengths(absl::MakeConstSpan(operands).subspan(1), count);
}

bool Session::CheckZeroOnlyOptions(const IoOptions& o) {
  if (o.no_fallback && !o.zero) {
    out() << "-n requires -z to be specified\n";
    return false;
  }
  if (o.unmap && !o.zero) {
    out() << "-u requires -z to be specified\n";
    return false;
  }
  return true;
}

bool Session::MakeWriteRequest(const IoOptions& o, uint64_t offset,
                               uint64_t count, std::vector<uint8_t>& buffer,
                               Request* r) {
  *r = Request{
      .kind = Request::kWrite, .offset = offset, .bytes = count, .fua = o.fua};
  if (o.zero) {
    r->kind = Request::kWriteZeroes;
    r->may_unmap = o.unmap;
    r->no_fallback = o.no_fallback;
    return true;
  }
  buffer.assign(count, o.pattern.value_or(kDefaultPattern));
  if (o.source_file.has_value() && !FillFromFile(*o.source_file, buffer)) {
    return false;
  }
  r->buffer = absl::MakeSpan(buffer);
  return true;
}

bool Session::CmdRead(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "bCl:pP:qs:v", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  if (!o.pattern.has_value() &&
      (o.pattern_offset.has_value() || o.pattern_count.has_value())) {
    return Usage(def);
  }
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  if (count > kMaxRequestBytes) {
    out() << "length cannot exceed " << kMaxRequestBytes << ", given "
          << operands[1] << "\n";
    return false;
  }
  if (o.vmstate && !CheckSectorAligned(offset, count)) return false;
  const uint64_t check_offset = o.pattern_offset.value_or(0);
  uint64_t check_count = 0;
  if (o.pattern.has_value()) {
    if (o.pattern_count.has_value()) {
      check_count = *o.pattern_count;
    } else if (check_offset <= count) {
      check_count = count - check_offset;
    }
    if (check_offset > count || check_count > count - check_offset) {
      out() << "pattern verification range exceeds end of read data\n";
      return false;
    }
  }
  return ReadAndCheck(o, "read", offset, count, check_offset, check_count);
}

bool Session::CmdWrite(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "bcCfnpP:qs:uz", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  if (o.vmstate && o.zero) {
    out() << "-b and -z cannot be specified at the same time\n";
    return false;
  }
  if (o.fua && (o.vmstate || o.compressed)) {
    out() << "-f and -b or -c cannot be specified at the same time\n";
    return false;
  }
  const int sources =
      int(o.zero) + int(o.pattern.has_value()) + int(o.source_file.has_value());
  if (sources > 1) {
    out() << "Only one of -z, -P, and -s can be specified at the same time\n";
    return false;
  }
  if (!CheckZeroOnlyOptions(o)) return false;
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  if (count > kMaxRequestBytes && !o.no_fallback) {
    out() << "length cannot exceed " << kMaxRequestBytes
          << " without -n, given " << operands[1] << "\n";
    return false;
  }
  if ((o.vmstate || o.compressed) && !CheckSectorAligned(offset, count)) {
    return false;
  }
  std::vector<uint8_t> buffer;
  Request r;
  if (!MakeWriteRequest(o, offset, count, buffer, &r)) return false;
  if (o.compressed && !o.zero) r.kind = Request::kWriteCompressed;
  if (o.vmstate) r.kind = Request::kWriteVmState;
  double seconds = 0;
  if (!RunTimed(r, "write", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("wrote", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

bool Session::CmdReadv(const CommandDef& def, std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CP:qv", &o, &operands)) return false;
  if (operands.size() < 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  return ReadAndCheck(o, "readv", offset, count, 0, count);
}

bool Session::CmdWritev(const CommandDef& def,
                        std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CfP:q", &o, &operands)) return false;
  if (operands.size() < 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  std::vector<uint8_t> buffer(count, o.pattern.value_or(kDefaultPattern));
  Request r{.kind = Request::kWrite,
            .offset = offset,
            .bytes = count,
            .buffer = absl::MakeSpan(buffer),
            .fua = o.fua};
  double seconds = 0;
  if (!RunTimed(r, "writev", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("wrote", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

void Session::SubmitAio(std::shared_ptr<AioRequest> aio, const char* op) {
  const bool write = aio->request.kind != Request::kRead;
  if (driver_dropped_) {
    absl::StrAppend(&aio_output_, write ? "aio_write" : "readv",
                    " failed: ", std::strerror(ENOMEDIUM), "\n");
    return;
  }
  ++aio_in_flight_;
  aio->start = Clock::now();
  if (!aio->buffer.empty()) aio->request.buffer = absl::MakeSpan(aio->buffer);
  io::Task<absl::Status> task =
      RunRequest(&node(), ImageLength(), aio->request, WriteThrough());
  io::Spawn(std::move(task), [this, aio, op, write](absl::Status st) {
    --aio_in_flight_;
    const double seconds = Seconds(Clock::now() - aio->start);
    const Request& r = aio->request;
    if (!st.ok()) {
      // qemu-io names a failed aio_read "readv".
      absl::StrAppend(&aio_output_, write ? "aio_write" : "readv",
                      " failed: ", FailureText(st), "\n");
      return;
    }
    if (aio->pattern.has_value() && !AllBytesAre(aio->buffer, *aio->pattern)) {
      absl::StrAppend(&aio_output_, "Pattern verification failed at offset ",
                      r.offset, ", ", r.bytes, " bytes\n");
    }
    if (aio->quiet) return;
    if (aio->verbose)
      absl::StrAppend(&aio_output_, HexDump(aio->buffer, r.offset));
    absl::StrAppend(&aio_output_, Report(op, seconds, r.offset, r.bytes,
                                         r.bytes, 1, aio->machine));
  });
}

bool Session::CmdAioRead(const CommandDef& def,
                         std::vector<std::string>& words) {
  auto aio = std::make_shared<AioRequest>();
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CiP:qv", &o, &operands)) return false;
  aio->machine = o.machine;
  aio->quiet = o.quiet;
  aio->verbose = o.verbose;
  aio->pattern = o.pattern;
  if (operands.size() < 2) return Usage(def);
  if (o.invalid) {
    // qemu-io's -i only counts a failed request in its statistics.
    out() << "injecting invalid read request\n";
    return true;
  }
  uint64_t offset = 0, count = 0;
  if (!ParseOffsetAndLengths(operands, &offset, &count)) return false;
  aio->buffer.assign(count, kReadFill);
  aio->request =
      Request{.kind = Request::kRead, .offset = offset, .bytes = count};
  SubmitAio(std::move(aio), "read");
  return true;
}

bool Session::CmdAioWrite(const CommandDef& def,
                          std::vector<std::string>& words) {
  auto aio = std::make_shared<AioRequest>();
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "CfiP:quz", &o, &operands)) return false;
  aio->machine = o.machine;
  aio->quiet = o.quiet;
  if (operands.size() < 2) return Usage(def);
  if (o.zero && operands.size() > 2) {
    out() << "-z supports only a single length parameter\n";
    return false;
  }
  if (!CheckZeroOnlyOptions(o)) return false;
  if (o.invalid) {
    out() << "injecting invalid write request\n";
    return true;
  }
  uint64_t offset = 0, count = 0;
  if (o.zero) {
    // One length, not limited to a buffer's size.
    if (!ParseNumber(operands[0], &offset) ||
        !ParseNumber(operands[1], &count)) {
      return false;
    }
  } else if (!ParseOffsetAndLengths(operands, &offset, &count)) {
    return false;
  }
  if (!MakeWriteRequest(o, offset, count, aio->buffer, &aio->request)) {
    return false;
  }
  SubmitAio(std::move(aio), "wrote");
  return true;
}

bool Session::CmdAioFlush(const CommandDef&, std::vector<std::string>&) {
  DrainAio();
  return true;
}

bool Session::CmdDiscard(const CommandDef& def,
                         std::vector<std::string>& words) {
  IoOptions o;
  std::vector<std::string> operands;
  if (!GetIoOptions(def, words, "Cq", &o, &operands)) return false;
  if (operands.size() != 2) return Usage(def);
  uint64_t offset = 0, count = 0;
  if (!ParseNumber(operands[0], &offset) || !ParseNumber(operands[1], &count)) {
    return false;
  }
  Request r{.kind = Request::kDiscard,
            .offset = offset,
            .bytes = count,
            .discard_ignored = discard_ignored_};
  double seconds = 0;
  if (!RunTimed(r, "discard", &seconds)) return false;
  if (!o.quiet) {
    out() << Report("discard", seconds, offset, count, count, 1, o.machine);
  }
  return true;
}

bool Session::CmdFlush(const CommandDef&, std::vector<std::string>&) {
  // qemu-io prints nothing, even when the flush fails.
  return Wait(node().Flush()).ok();
}

bool Session::CmdTruncate(const CommandDef& def,
                          std::vector<std::string>& words) {
  io::PreallocMode mode = io::PreallocMode::kOff;
  std::vector<std::string> operands;
  if (!GetOptions(
          def, words, "m:",
          [&](int, const char* arg) {
            absl::StatusOr<io::PreallocMode> m = io::ParsePreallocMode(arg);
            if (!m.ok()) {
              err() << ProgramName() << ": " << m.status().message() << "\n";
              return false;
            }
            mode = *m;
            return true;
          },
          &operands)) {
    return false;
  }
  // qemu-io uses the first operand and ignores the rest.
  if (operands.empty()) return Usage(def);
  uint64_t size = 0;
  if (!ParseNumber(operands[0], &size)) return false;
  if (driver_dropped_) {
    err() << ProgramName() << ": No medium inserted\n";
    return false;
  }
  absl::Status st = Wait(node().Truncate(size, mode));
  if (!st.ok()) {
    err() << ProgramName() << ": " << WithoutFilename(st, node().filename())
          << "\n";
    return false;
  }
  return true;
}

}  // namespace imgtool::cli::qemu_io
