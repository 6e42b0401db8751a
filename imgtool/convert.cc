// imgtool convert [-f FMT] [-O FMT] [-o OPTS] [-S SPARSE] [-m N] [-W] [-n]
// [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] SRC... DST:
// copies the concatenation of the source images into DST as qemu-img 7.2
// does. The copy works on any io::BlockNode: block status through the
// backing chain says which ranges hold data; ranges that read as zeroes are
// skipped (or written as zeroes when the target may hold old data), and
// zeroes inside data ranges are found by scanning the buffer in 512-byte
// sectors, so the target stays sparse. Up to -m coroutines copy chunks of at
// most 2 MiB each, writing in order unless -W. All images of the command
// share one engine. Targets: raw (posix_file::CreateFile) and qcow2 (the
// create options of `imgtool create -f qcow2`, -B/-F backing files, -c
// compressed clusters through qcow2::Qcow2Node::WriteCompressed).
#include <getopt.h>
#include <sys/stat.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/strip.h"
#include "absl/types/span.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/progress.h"
#include "imgtool/qcow2_create.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/engine.h"
#include "io/sync.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "posix_file/file_options.pb.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool convert [-f FMT] [-O FMT] [-o OPTIONS] [-S SPARSE_SIZE] "
    "[-m N] [-W] [-n] [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] "
    "[-U] SRC... DST";

constexpr char kHelp[] =
    "Usage: imgtool convert [-f FMT] [-O FMT] [-o OPTIONS] [-S SPARSE_SIZE] "
    "[-m N] [-W] [-n]\n"
    "        [--target-is-zero] [-t CACHE] [-T SRC_CACHE] [-p] [-q] [-U] "
    "SRC... DST\n"
    "Copies the images SRC... (concatenated) into the new image DST.\n"
    "  -f FMT            format of the sources (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts      the sources are option strings (driver=qcow2,...)\n"
    "  --target-image-opts  DST is an option string (needs -n)\n"
    "  -O FMT            format of DST: raw (default), file or qcow2\n"
    "  -B BACKING        backing file of a qcow2 DST (needs -F)\n"
    "  -F BACKING_FMT    format of the backing file\n"
    "  -c                write compressed clusters (qcow2 DST)\n"
    "  -o OPTIONS        create options of DST; '-o help' lists them\n"
    "  -S SPARSE_SIZE    zero runs of at least this size (multiple of 512, "
    "default 4k)\n"
    "                    become holes; 0 writes every byte\n"
    "  -m N              requests in flight (1..16, default 8)\n"
    "  -W                write out of order (faster; default: in order)\n"
    "  -n                DST exists: do not create it\n"
    "  --target-is-zero  with -n: DST reads as zeroes, skip writing zeroes\n"
    "  -t CACHE          cache mode of DST (default unsafe)\n"
    "  -T SRC_CACHE      cache mode of the sources (default writeback)\n"
    "  -p                show progress\n"
    "  -q                quiet\n"
    "  -U, --force-share open the sources without taking their locks\n";

// The create options of raw over `file`, as `-o help` lists them (the same
// text as `imgtool create`).
constexpr char kSizeHelp[] = "  size=<size>            - Virtual disk size\n";
constexpr char kFileOptionsHelp[] =
    "  extent_size_hint=<size> - Extent size hint for the image file, 0 to "
    "disable\n"
    "  nocow=<bool (on/off)>  - Turn off copy-on-write (valid only on btrfs)\n"
    "  preallocation=<str>    - Preallocation mode (allowed values: off, "
    "falloc, full)\n"
    "  size=<size>            - Virtual disk size\n";
constexpr char kProtocolHint[] =
    "\nThe protocol level may support further options.\n"
    "Specify the target filename to include those options.\n";

constexpr uint64_t kSectorSize = 512;
// qemu-img's IO_BUF_SIZE: the largest data chunk one coroutine copies.
constexpr uint64_t kChunkSize = 2 << 20;
// The largest -S (qemu-img's MAX_BUF_SECTORS sectors).
constexpr uint64_t kMaxSparseSize = 16 << 20;
// The largest single request (QEMU's BDRV_REQUEST_MAX_BYTES).
constexpr uint64_t kMaxRequest = static_cast<uint64_t>(INT_MAX) & ~511ull;
constexpr int kMaxCoroutines = 16;

enum LongOption {
  kObject = 256,
  kImageOpts,
  kTargetImageOpts,
  kTargetIsZero,
  kBitmaps,
  kSkipBrokenBitmaps,
  kSalvage,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"target-image-opts", no_argument, nullptr, kTargetImageOpts},
    {"target-is-zero", no_argument, nullptr, kTargetIsZero},
    {"bitmaps", no_argument, nullptr, kBitmaps},
    {"skip-broken-bitmaps", no_argument, nullptr, kSkipBrokenBitmaps},
    {"salvage", no_argument, nullptr, kSalvage},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

// Cache modes QEMU accepts ("off" is "none"); the name for posix_file, or
// nullopt.
std::optional<std::string> CacheMode(const std::string& name) {
  if (name == "off") return std::string("none");
  if (name == "none" || name == "writeback" || name == "writethrough" ||
      name == "directsync" || name == "unsafe") {
    return name;
  }
  return std::nullopt;
}

// qemu-img's check on each -o argument: not empty, no leading comma, an
// even number of trailing commas.
bool IsValidOptionList(const std::string& text) {
  if (text.empty() || text[0] == ',') return false;
  size_t trailing = 0;
  while (trailing < text.size() && text[text.size() - 1 - trailing] == ',') {
    ++trailing;
  }
  return trailing % 2 == 0;
}

// Applies one -o argument to the create options of a raw target. `size` is
// checked but later replaced by the sources' total, as qemu-img does.
absl::Status ApplyCreateOptions(const std::string& text,
                                posix_file::FileCreateOptions* options) {
  ASSIGN_OR_RETURN(OptionList list, ParseOptionString(text));
  for (const auto& [key, value] : list) {
    if (key == "help") continue;
    if (key == "size") {
      RETURN_IF_ERROR(ParseSizeOption(key, value).status());
    } else if (key == "nocow") {
      ASSIGN_OR_RETURN(bool nocow, ParseBoolOption(key, value));
      options->set_nocow(nocow);
    } else if (key == "preallocation") {
      options->set_preallocation(value);
    } else if (key == "extent_size_hint") {
      ASSIGN_OR_RETURN(uint64_t hint, ParseSizeOption(key, value));
      options->set_extent_size_hint(hint);
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("Invalid parameter '", key, "'"));
    }
  }
  return absl::OkStatus();
}

bool HasHelpOption(const std::vector<std::string>& option_texts) {
  for (const std::string& text : option_texts) {
    absl::StatusOr<OptionList> list = ParseOptionString(text);
    if (!list.ok()) continue;
    for (const auto& item : *list) {
      if (item.first == "help") return true;
    }
  }
  return false;
}

// cvtnum() of qemu-img: `what` names the value in the error.
absl::StatusOr<uint64_t> ParseNumber(const std::string& what,
                                     const std::string& text) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (v.ok()) return v;
  return PrefixEachLine(absl::InvalidArgumentError(absl::StrReplaceAll(
      v.status().message(), {{"Invalid image size", "Invalid " + what}})));
}

// Creates the target, as `imgtool create` would, with the sources' total
// size. Errors are qemu-img's "<dst>: error while converting <fmt>: ...".
absl::Status CreateTarget(const std::string& filename,
                          const std::string& format,
                          posix_file::FileCreateOptions options, uint64_t size,
                          std::ostream& err) {
  options.set_size(size);
  absl::Status st = CreateImageFile(filename, options, err);
  if (st.ok()) return st;
  absl::string_view cause = st.message();
  absl::ConsumePrefix(&cause, absl::StrCat(filename, ": "));
  return absl::Status(
      st.code(),
      absl::StrCat(filename, ": error while converting ", format, ": ", cause));
}

// Whether a freshly created target reads as zeroes everywhere (QEMU's
// has_zero_init): true for regular files, not for block devices.
bool CreatedTargetIsZero(const std::string& filename) {
  struct stat st;
  return stat(filename.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

bool IsZero(const uint8_t* p, size_t n) {
  uint64_t acc = 0;
  for (size_t i = 0; i + 8 <= n; i += 8) {
    uint64_t word;
    std::memcpy(&word, p + i, sizeof(word));
    acc |= word;
  }
  for (size_t i = n & ~size_t{7}; i < n; ++i) acc |= p[i];
  return acc == 0;
}

// A run of sectors at the start of a buffer.
struct SectorRun {
  bool data = false;  // false: every byte is zero
  uint64_t sectors = 0;
};

// The leading run of sectors in `buf` (`sectors` sectors, the first one
// being target sector `first_sector`) that are all zero or all non-zero.
// A run that stops before the end of the buffer is made to end on a
// multiple of `alignment` sectors (a power of two): a data run is extended,
// a zero run cut back, and a zero run too short to survive the cut counts
// as data (its sectors would be rewritten with the data next to them).
SectorRun LeadingRun(const uint8_t* buf, uint64_t sectors,
                     uint64_t first_sector, uint64_t alignment) {
  const bool zero = IsZero(buf, kSectorSize);
  uint64_t i = 1;
  while (i < sectors && IsZero(buf + i * kSectorSize, kSectorSize) == zero) {
    ++i;
  }
  if (i == sectors) return {!zero, i};
  const uint64_t tail = (first_sector + i) & (alignment - 1);
  if (tail == 0) return {!zero, i};
  if (zero && i > tail) return {false, i - tail};
  return {true, std::min(i + alignment - tail, sectors)};
}

// Splits the start of a data buffer into what must be written and what can
// stay a hole: the first run if it is zero, else the data up to the first
// zero run of at least `min_zero` sectors (shorter zero runs are written
// with the data around them, so requests are not broken up for small gaps).
SectorRun DataOrHole(const uint8_t* buf, uint64_t sectors,
                     uint64_t first_sector, uint64_t min_zero,
                     uint64_t alignment) {
  min_zero = std::min(min_zero, sectors);
  const SectorRun first = LeadingRun(buf, sectors, first_sector, alignment);
  if (!first.data) return first;
  uint64_t used = first.sectors;
  uint64_t checked = first.sectors;
  while (checked < sectors) {
    const SectorRun run =
        LeadingRun(buf + checked * kSectorSize, sectors - checked,
                   first_sector + checked, alignment);
    checked += run.sectors;
    if (run.data) {
      used = checked;
    } else if (run.sectors >= min_zero) {
      break;
    }
  }
  return {true, used};
}

struct CopySource {
  io::BlockNode* node = nullptr;
  uint64_t start = 0;   // offset in the target, bytes
  uint64_t length = 0;  // the node's size rounded up to 512 bytes
};

struct CopySettings {
  uint64_t min_sparse_sectors = 8;  // 0: write everything
  uint64_t alignment_sectors = 8;   // power of two
  bool target_is_zero = false;      // skip zero ranges entirely
  // The target has a backing file (-n -B): ranges the top source node does
  // not allocate are left to it.
  bool target_has_backing = false;
  bool in_order = true;
  bool copy_whole_chunks = false;  // -C: no zero detection in data
  int num_workers = 8;
  // -c: whole target clusters of this many bytes are written compressed
  // (through `compressed_target`); 0 = no compression.
  uint64_t compressed_cluster_size = 0;
  qcow2::Qcow2Node* compressed_target = nullptr;
  // A new target with a backing file: its backing file's length in bytes.
  // Zeroes past it need no writing (the target reads zeroes there).
  std::optional<uint64_t> target_backing_end;
};

// What qemu-img prints after "error while reading/writing at byte N: ":
// strerror of the request's errno, not the file layer's message naming the
// file and the syscall ("dst.qcow2: pwritev: No space left on device");
// messages without an errno stay as they are.
std::string RequestError(const absl::Status& status) {
  if (const int error_number = StatusErrno(status); error_number != 0) {
    return std::strerror(error_number);
  }
  return std::string(status.message());
}

// The copy itself (qemu-img's convert_do_copy). The target is split into
// chunks that are either data (read, scanned for zeroes, written) or zero
// (skipped on a zeroed target, else written as zeroes that may unmap);
// workers take chunks in order and, unless out-of-order writes are allowed,
// write them in order too.
class Copier {
 public:
  Copier(std::vector<CopySource> sources, io::BlockNode& target,
         const CopySettings& settings, Progress& progress)
      : sources_(std::move(sources)),
        target_(target),
        settings_(settings),
        progress_(progress),
        waiting_(settings.num_workers) {
    for (const CopySource& s : sources_) total_ += s.length;
  }

  // Counts the data sectors so the progress can be shown as a fraction of
  // them, then copies.
  io::Task<absl::Status> Run(bool count_first) {
    if (count_first) {
      uint64_t offset = 0;
      while (offset < total_) {
        CO_ASSIGN_OR_RETURN(uint64_t n, co_await NextChunk(offset));
        if (CountsAsAllocated(status_)) allocated_sectors_ += n / kSectorSize;
        offset += n;
      }
      next_status_end_ = 0;
    }
    running_ = settings_.num_workers;
    for (int i = 0; i < settings_.num_workers; ++i) {
      io::Spawn(Worker(i), [this] {
        if (--running_ == 0) done_.Set();
      });
    }
    co_await done_.Wait();
    if (error_.ok() && settings_.compressed_target != nullptr) {
      // qemu-img's compressed write of 0 bytes: pads the file to a sector.
      co_return co_await settings_.compressed_target->WriteCompressed(
          0, io::ConstIoVec());
    }
    co_return error_;
  }

 private:
  enum class ChunkKind { kData, kZero, kBacking };

  struct Waiter {
    bool waiting = false;
    uint64_t offset = 0;
    std::coroutine_handle<> handle;
  };

  bool CountsAsAllocated(ChunkKind kind) const {
    return kind == ChunkKind::kData ||
           (settings_.min_sparse_sectors == 0 && kind == ChunkKind::kZero);
  }

  // The length of the chunk starting at target offset `offset` (a multiple
  // of 512 bytes); its kind is left in status_. Block status is asked once
  // per extent and reused for the chunks inside it. Runs under mutex_.
  io::Task<absl::StatusOr<uint64_t>> NextChunk(uint64_t offset) {
    size_t index = 0;
    while (offset - sources_[index].start >= sources_[index].length) ++index;
    const CopySource& source = sources_[index];
    const uint64_t in_source = offset - source.start;
    uint64_t n =
        std::min({total_ - offset, kMaxRequest, source.length - in_source});
    bool past_backing_end = false;
    if (settings_.target_backing_end.has_value()) {
      // Ranges before and after the end of the target's backing file are
      // asked for separately: zeroes past it need no writing.
      const uint64_t end = *settings_.target_backing_end;
      if (offset >= end) {
        past_backing_end = true;
      } else if (offset + n > end) {
        n = end - offset;
      }
    }
    if (next_status_end_ <= offset) {
      uint64_t count = n;
      ChunkKind kind = ChunkKind::kZero;
      // Past the node's end (up to the 512-byte rounding) it reads zeroes.
      if (in_source < source.node->size()) {
        absl::StatusOr<io::BlockStatus> status =
            co_await SourceStatus(*source.node, in_source, n);
        if (!status.ok()) {
          co_return absl::Status(
              status.status().code(),
              absl::StrCat("error while reading block status at offset ",
                           in_source, ": ", status.status().message()));
        }
        count = status->length;
        if (status->zero) {
          kind = past_backing_end ? ChunkKind::kBacking : ChunkKind::kZero;
        } else if (status->data || !settings_.target_has_backing) {
          kind = ChunkKind::kData;
        } else {
          kind = ChunkKind::kBacking;
        }
      }
      n = AlignUp(count, kSectorSize);
      status_ = kind;
      next_status_end_ = offset + n;
    }
    n = std::min(n, next_status_end_ - offset);
    if (status_ == ChunkKind::kData) n = std::min(n, kChunkSize);
    if (const uint64_t cluster = settings_.compressed_cluster_size;
        cluster != 0) {
      // Compressed clusters are written whole: a run shorter than a
      // cluster makes the whole cluster data, a longer one stops at a
      // cluster boundary (qemu-img's convert_iteration_sectors).
      if (n < cluster) {
        n = std::min(cluster, total_ - offset);
        status_ = ChunkKind::kData;
        next_status_end_ = std::max(next_status_end_, offset + n);
      } else {
        n = n / cluster * cluster;
      }
      // One cluster per data chunk (qemu-img's buffer is one cluster).
      if (status_ == ChunkKind::kData) n = std::min(n, cluster);
    }
    co_return n;
  }

  // Block status of a source range: through its whole backing chain, or
  // of its top node only when the target has a backing file (which then
  // provides what the source's backing chain did).
  io::Task<absl::StatusOr<io::BlockStatus>> SourceStatus(io::BlockNode& node,
                                                         uint64_t offset,
                                                         uint64_t length) {
    if (settings_.target_has_backing) {
      // What the top node does not allocate reads as zeroes when it has no
      // backing file, or from past the end of its backing file (QEMU's
      // bdrv_block_status): zeroes to write, not the target's backing file.
      CO_ASSIGN_OR_RETURN(io::BlockStatus status,
                          co_await node.GetBlockStatus(offset, length));
      if (!status.data && !status.zero) {
        const io::BlockNode* backing = node.backing();
        status.zero = backing == nullptr ||
                      offset >= AlignUp(backing->size(), kSectorSize);
      }
      co_return status;
    }
    CO_ASSIGN_OR_RETURN(io::ChainStatus chain,
                        co_await io::GetChainStatus(node, offset, length));
    co_return chain.status;
  }

  void SetError(absl::Status status) {
    if (error_.ok()) error_ = std::move(status);
  }

  // Suspends until the writes before `offset` are done (or the copy
  // failed); resumed by FinishWrite.
  auto WaitForTurn(int index, uint64_t offset) {
    struct Awaiter {
      Copier& copier;
      int index;
      uint64_t offset;
      bool await_ready() const {
        return copier.written_up_to_ == offset || !copier.error_.ok();
      }
      void await_suspend(std::coroutine_handle<> h) {
        copier.waiting_[index] = Waiter{true, offset, h};
      }
      void await_resume() {}
    };
    return Awaiter{*this, index, offset};
  }

  void FinishWrite(uint64_t end) {
    written_up_to_ = end;
    for (Waiter& w : waiting_) {
      if (w.waiting && w.offset == end) {
        w.waiting = false;
        io::Resume(w.handle);
        break;
      }
    }
  }

  io::Task<absl::Status> WriteChunk(uint64_t offset, uint64_t length,
                                    const uint8_t* buf, ChunkKind kind) {
    if (settings_.compressed_target != nullptr && kind == ChunkKind::kData &&
        (settings_.min_sparse_sectors == 0 || !IsZero(buf, length))) {
      // One cluster (or the image's last, shorter one); all-zero data is
      // treated as a zero range.
      co_return co_await settings_.compressed_target->WriteCompressed(
          offset, io::ConstIoVec(buf, length));
    }
    if (settings_.compressed_target != nullptr && kind == ChunkKind::kData) {
      kind = ChunkKind::kZero;
    }
    uint64_t done = 0;
    while (done < length) {
      uint64_t n = length - done;
      if (kind == ChunkKind::kBacking) break;
      bool data = kind == ChunkKind::kData;
      if (data && settings_.min_sparse_sectors != 0 &&
          !settings_.copy_whole_chunks) {
        const SectorRun run = DataOrHole(
            buf + done, n / kSectorSize, (offset + done) / kSectorSize,
            settings_.min_sparse_sectors, settings_.alignment_sectors);
        data = run.data;
        n = run.sectors * kSectorSize;
      }
      if (data) {
        CO_RETURN_IF_ERROR(co_await target_.Write(
            offset + done, io::ConstIoVec(buf + done, n)));
      } else if (!settings_.target_is_zero) {
        CO_RETURN_IF_ERROR(co_await target_.WriteZeroes(
            offset + done, n, io::WriteZeroesFlags{.may_unmap = true}));
      }
      done += n;
    }
    co_return absl::OkStatus();
  }

  io::Task<void> Worker(int index) {
    io::AlignedBuffer buffer(kChunkSize);
    for (;;) {
      io::ScopedLock lock = co_await io::ScopedLock::Take(mutex_);
      if (!error_.ok() || next_offset_ >= total_) break;
      absl::StatusOr<uint64_t> chunk = co_await NextChunk(next_offset_);
      if (!chunk.ok()) {
        SetError(chunk.status());
        break;
      }
      const uint64_t offset = next_offset_;
      ChunkKind kind = status_;
      uint64_t length = *chunk;
      if (settings_.min_sparse_sectors == 0 && kind == ChunkKind::kZero) {
        length = std::min(length, kChunkSize);
      }
      // Other workers may look further while this one copies.
      next_offset_ += length;
      lock.Release();

      if (CountsAsAllocated(kind) && allocated_sectors_ > 0) {
        allocated_done_ += length / kSectorSize;
        progress_.Print(
            static_cast<float>(100.0 * allocated_done_ / allocated_sectors_),
            0);
      }
      if (kind == ChunkKind::kData) {
        absl::Status st = co_await ReadChunk(offset, length, buffer.data());
        if (!st.ok()) {
          SetError(absl::Status(
              st.code(), absl::StrCat("error while reading at byte ", offset,
                                      ": ", RequestError(st))));
        }
      } else if (settings_.min_sparse_sectors == 0 &&
                 kind == ChunkKind::kZero) {
        // -S 0 writes zero ranges as data; ranges left to the target's
        // backing file stay unallocated (qemu-img's convert_co_do_copy).
        std::memset(buffer.data(), 0, length);
        kind = ChunkKind::kData;
      }
      if (settings_.in_order) {
        while (written_up_to_ != offset && error_.ok()) {
          co_await WaitForTurn(index, offset);
        }
      }
      if (error_.ok()) {
        absl::Status st =
            co_await WriteChunk(offset, length, buffer.data(), kind);
        if (!st.ok()) {
          SetError(absl::Status(
              st.code(), absl::StrCat("error while writing at byte ", offset,
                                      ": ", RequestError(st))));
        }
      }
      if (settings_.in_order) FinishWrite(offset + length);
    }
  }

  // Reads target range [offset, offset + length) from the sources it
  // covers (qemu-img's convert_co_read): a compressed cluster may hold the
  // tail of one source and the start of the next ones. Bytes past a
  // source's size, up to its 512-byte rounding, read as zeroes.
  io::Task<absl::Status> ReadChunk(uint64_t offset, uint64_t length,
                                   uint8_t* buf) {
    size_t index = 0;
    while (length > 0) {
      while (offset - sources_[index].start >= sources_[index].length) {
        ++index;
      }
      const CopySource& source = sources_[index];
      const uint64_t in_source = offset - source.start;
      const uint64_t n = std::min(length, source.length - in_source);
      const uint64_t size = source.node->size();
      const uint64_t readable =
          in_source < size ? std::min(n, size - in_source) : 0;
      if (readable > 0) {
        CO_RETURN_IF_ERROR(co_await source.node->Read(
            in_source, io::IoVec(buf, readable)));
      }
      std::memset(buf + readable, 0, n - readable);
      offset += n;
      length -= n;
      buf += n;
    }
    co_return absl::OkStatus();
  }

  std::vector<CopySource> sources_;
  io::BlockNode& target_;
  const CopySettings settings_;
  Progress& progress_;
  uint64_t total_ = 0;

  io::Mutex mutex_;           // guards the chunk iteration below
  uint64_t next_offset_ = 0;  // the first byte no worker has taken yet
  uint64_t next_status_end_ = 0;
  ChunkKind status_ = ChunkKind::kData;

  uint64_t allocated_sectors_ = 0;
  uint64_t allocated_done_ = 0;
  uint64_t written_up_to_ = 0;  // in-order writes: all before are written
  std::vector<Waiter> waiting_;
  int running_ = 0;
  io::Event done_;
  absl::Status error_;
};

struct ConvertArgs {
  std::string source_format;
  std::string target_format;
  std::string cache = "unsafe";
  std::string source_cache = "writeback";
  std::vector<std::string> option_texts;
  std::optional<std::string> backing_file;
  std::optional<std::string> backing_format;
  std::optional<std::string> snapshot;
  uint64_t min_sparse = 4096;
  bool explicit_min_sparse = false;
  int num_coroutines = 8;
  bool in_order = true;
  bool copy_range = false;
  bool compress = false;
  bool progress = false;
  bool quiet = false;
  bool skip_create = false;
  bool target_is_zero = false;
  bool force_share = false;
  bool image_opts = false;
  bool target_image_opts = false;
  bool bitmaps = false;
  bool skip_broken_bitmaps = false;
  bool salvage = false;
  uint64_t rate_limit = 0;
};

absl::Status ParseOption(int c, const std::string& arg, ConvertArgs& a,
                         bool& help) {
  switch (c) {
    case 'h':
      help = true;
      break;
    case 'f':
      a.source_format = arg;
      break;
    case 'O':
      a.target_format = arg;
      break;
    case 'B':
      a.backing_file = arg;
      break;
    case 'F':
      a.backing_format = arg;
      break;
    case 'C':
      a.copy_range = true;
      break;
    case 'c':
      a.compress = true;
      break;
    case 'o':
      if (!IsValidOptionList(arg)) {
        return absl::InvalidArgumentError(
            absl::StrCat("Invalid option list: ", arg));
      }
      a.option_texts.push_back(arg);
      break;
    case 'l':
      a.snapshot = arg;
      break;
    case 'S': {
      ASSIGN_OR_RETURN(uint64_t size,
                       ParseNumber("buffer size for sparse output", arg));
      if (size % kSectorSize != 0 || size > kMaxSparseSize) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid buffer size for sparse output specified. Valid sizes "
            "are multiples of ",
            kSectorSize, " up to ", kMaxSparseSize,
            ". Select 0 to disable sparse detection (fully allocates "
            "output)."));
      }
      a.min_sparse = size;
      a.explicit_min_sparse = true;
      break;
    }
    case 'p':
      a.progress = true;
      break;
    case 't':
      a.cache = arg;
      break;
    case 'T':
      a.source_cache = arg;
      break;
    case 'n':
      a.skip_create = true;
      break;
    case 'm': {
      absl::StatusOr<uint64_t> n = ParseSize(arg);
      if (!n.ok() || *n < 1 || *n > kMaxCoroutines) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Invalid number of coroutines. Allowed number of coroutines is "
            "between 1 and ",
            kMaxCoroutines));
      }
      a.num_coroutines = static_cast<int>(*n);
      break;
    }
    case 'W':
      a.in_order = false;
      break;
    case 'U':
      a.force_share = true;
      break;
    case 'r': {
      ASSIGN_OR_RETURN(a.rate_limit, ParseNumber("rate limit", arg));
      break;
    }
    case 'q':
      a.quiet = true;
      break;
    case kObject:
      return absl::UnimplementedError("--object is not supported yet");
    case kImageOpts:
      a.image_opts = true;
      break;
    case kTargetImageOpts:
      a.target_image_opts = true;
      break;
    case kTargetIsZero:
      a.target_is_zero = true;
      break;
    case kBitmaps:
      a.bitmaps = true;
      break;
    case kSkipBrokenBitmaps:
      a.skip_broken_bitmaps = true;
      break;
    case kSalvage:
      a.salvage = true;
      break;
  }
  return absl::OkStatus();
}

// The checks qemu-img makes on the options alone, in its order.
absl::Status CheckOptions(const ConvertArgs& a) {
  if (a.skip_broken_bitmaps && !a.bitmaps) {
    return absl::InvalidArgumentError(
        "Use of --skip-broken-bitmaps requires --bitmaps");
  }
  if (a.compress && a.copy_range) {
    return absl::InvalidArgumentError(
        "Cannot enable copy offloading when -c is used");
  }
  if (a.explicit_min_sparse && a.copy_range) {
    return absl::InvalidArgumentError(
        "Cannot enable copy offloading when -S is used");
  }
  if (a.copy_range && a.salvage) {
    return absl::InvalidArgumentError(
        "Cannot use copy offloading in salvaging mode");
  }
  if (a.target_image_opts && !a.skip_create) {
    return absl::InvalidArgumentError(
        "--target-image-opts requires use of -n flag");
  }
  if (a.skip_create && !a.option_texts.empty()) {
    return absl::InvalidArgumentError(
        "-o has no effect when skipping image creation");
  }
  if (a.target_is_zero && !a.skip_create) {
    return absl::InvalidArgumentError(
        "--target-is-zero requires use of -n flag");
  }
  return absl::OkStatus();
}

// Closes every image, the last opened (the target) first; the first error
// wins.
absl::Status CloseAll(std::vector<OpenedImage>& images) {
  absl::Status first;
  for (auto it = images.rbegin(); it != images.rend(); ++it) {
    absl::Status st = CloseImage(*it);
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

// Fails like qemu-img for what the target cannot do: a backing file for a
// new raw image, compression, bitmaps.
absl::Status CheckTargetFeatures(const ConvertArgs& a, size_t num_sources,
                                 const std::string& target_format,
                                 const Qcow2CreateValues& qcow2_values) {
  if (a.target_is_zero && a.backing_file.has_value()) {
    return absl::InvalidArgumentError(
        "Cannot use --target-is-zero when the destination image has a "
        "backing file");
  }
  if (num_sources > 1 && a.backing_file.has_value()) {
    return absl::InvalidArgumentError(
        "Having a backing file for the target makes no sense when "
        "concatenating multiple input images");
  }
  if (!a.skip_create && target_format == "qcow2" &&
      qcow2_values.Has("backing_file") && !qcow2_values.Has("backing_fmt")) {
    return absl::InvalidArgumentError(
        "Use of backing file requires explicit backing format");
  }
  if (a.compress) {
    // With -n the target's format is known only once it is open
    // (--target-image-opts names it in its options): Copy() checks then,
    // after the open errors, as qemu-img does.
    if (!a.skip_create && target_format != "qcow2") {
      return absl::InvalidArgumentError(
          "Compression not supported for this file format");
    }
    if (qcow2_values.Has("encryption") || qcow2_values.Has("encrypt.format")) {
      return absl::InvalidArgumentError(
          "Compression and encryption not supported at the same time");
    }
    if (qcow2_values.Text("preallocation").value_or("off") != "off") {
      return absl::InvalidArgumentError(
          "Compression and preallocation not supported at the same time");
    }
  }
  if (a.bitmaps) {
    if (num_sources > 1) {
      return absl::InvalidArgumentError(
          "Copying bitmaps only possible with single source");
    }
    return absl::InvalidArgumentError("Source lacks bitmap support");
  }
  return absl::OkStatus();
}

// Copies the opened sources into the opened target.
absl::Status Copy(const ConvertArgs& a, absl::Span<OpenedImage> sources,
                  OpenedImage& target, const std::string& target_name,
                  Progress& progress) {
  uint64_t total = 0;
  std::vector<CopySource> copy_sources;
  for (OpenedImage& image : sources) {
    const uint64_t length = VirtualSize(image);
    copy_sources.push_back(CopySource{image.node.get(), total, length});
    total += length;
  }
  if (a.compress && target.qcow2 == nullptr) {
    return absl::InvalidArgumentError(
        "Compression not supported for this file format");
  }
  if (a.skip_create && VirtualSize(target) < total) {
    return absl::InvalidArgumentError("output file is smaller than input file");
  }
  CopySettings settings;
  settings.min_sparse_sectors = a.min_sparse / kSectorSize;
  // qemu-img aligns runs to the largest power of two <= -S (the request
  // alignment of a format node, 1 byte, is never larger).
  settings.alignment_sectors = 1;
  while (settings.alignment_sectors * 2 <= settings.min_sparse_sectors) {
    settings.alignment_sectors *= 2;
  }
  settings.target_is_zero =
      a.target_is_zero ||
      (!a.skip_create && a.min_sparse != 0 && !a.backing_file.has_value() &&
       CreatedTargetIsZero(target_name));
  settings.target_has_backing = a.backing_file.has_value();
  settings.in_order = a.in_order;
  settings.copy_whole_chunks = a.copy_range;
  settings.num_workers = a.num_coroutines;
  if (a.compress) {
    settings.compressed_target = target.qcow2;
    settings.compressed_cluster_size = target.qcow2->cluster_size();
  }
  if (a.backing_file.has_value() && !a.skip_create &&
      target.node->backing() != nullptr) {
    settings.target_backing_end =
        AlignUp(target.node->backing()->size(), kSectorSize);
  }

  // Every image was opened on the target's engine.
  Copier copier(std::move(copy_sources), *target.node, settings, progress);
  return io::RunSync(*target.engine,
                     copier.Run(/*count_first=*/a.progress && !a.quiet));
}

// Everything after the option checks, in qemu-img's order: open the
// sources, create and open the target, copy.
absl::Status Convert(ConvertArgs a,
                     const std::vector<std::string>& source_names,
                     const std::string& target_name, Progress& progress,
                     std::vector<OpenedImage>& images, Streams streams) {
  uint64_t total = 0;
  std::shared_ptr<io::Engine> engine;
  for (const std::string& name : source_names) {
    ImageSpec spec;
    spec.filename = name;
    spec.format = a.source_format;
    spec.image_opts = a.image_opts;
    spec.cache = *CacheMode(a.source_cache);
    spec.read_only = true;
    spec.force_share = a.force_share;
    // As qemu-img, keep writers (and convert onto itself) out.
    spec.unshare_write = true;
    spec.queue_depth = a.num_coroutines;
    ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err, engine));
    engine = image.engine;
    total += VirtualSize(image);
    images.push_back(std::move(image));
  }
  const size_t num_sources = images.size();
  if (a.snapshot.has_value()) {
    if (num_sources > 1) {
      return absl::InvalidArgumentError(
          "No support for concatenating multiple snapshot");
    }
    return absl::UnimplementedError(absl::StrCat(
        "Failed to load snapshot: Block format '", images[0].format,
        "' used by device '' does not support temporarily loading internal "
        "snapshots"));
  }

  const std::string target_format =
      a.target_format.empty() ? "raw" : a.target_format;
  posix_file::FileCreateOptions create_options;
  Qcow2CreateValues qcow2_values;
  if (!a.skip_create && target_format == "qcow2") {
    for (const std::string& text : a.option_texts) {
      RETURN_IF_ERROR(qcow2_values.Apply(text));
    }
    // The size is the sources' total; -B and -F override -o.
    qcow2_values.SetNumber("size", total);
    if (a.backing_file.has_value()) {
      qcow2_values.SetString("backing_file", *a.backing_file);
    }
    if (a.backing_format.has_value()) {
      qcow2_values.SetString("backing_fmt", *a.backing_format);
    }
    a.backing_file = qcow2_values.Text("backing_file");
  } else if (!a.skip_create) {
    RETURN_IF_ERROR(CheckFormat(target_format, /*for_create=*/true));
    for (const std::string& text : a.option_texts) {
      RETURN_IF_ERROR(ApplyCreateOptions(text, &create_options));
    }
    // Neither raw nor file has a backing file.
    if (a.backing_file.has_value()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Backing file not supported for file format '", target_format, "'"));
    }
    if (a.backing_format.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("Backing file format not supported for file format '",
                       target_format, "'"));
    }
  }
  RETURN_IF_ERROR(
      CheckTargetFeatures(a, num_sources, target_format, qcow2_values));
  if (!a.skip_create && target_format == "qcow2") {
    absl::Status st = CreateQcow2File(target_name, qcow2_values, streams.err);
    if (!st.ok()) {
      return absl::Status(st.code(),
                          absl::StrCat(target_name,
                                       ": error while converting qcow2: ",
                                       st.message()));
    }
  } else if (!a.skip_create) {
    RETURN_IF_ERROR(CreateTarget(target_name, target_format, create_options,
                                 total, streams.err));
  }

  const std::optional<std::string> cache = CacheMode(a.cache);
  if (!cache.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", a.cache));
  }
  ImageSpec spec;
  spec.filename = target_name;
  // With --target-image-opts only an explicit -O clashes (qemu-img's
  // "--image-opts and --format are mutually exclusive").
  spec.format = a.target_image_opts ? a.target_format : target_format;
  spec.image_opts = a.target_image_opts;
  spec.cache = *cache;
  spec.read_only = false;
  spec.queue_depth = a.num_coroutines;
  ASSIGN_OR_RETURN(OpenedImage target, OpenImage(spec, streams.err, engine));
  images.push_back(std::move(target));
  return Copy(a, absl::MakeSpan(images).first(num_sources), images.back(),
              target_name, progress);
}

}  // namespace

absl::Status RunConvert(const std::vector<std::string>& args, Streams streams) {
  ConvertArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:O:B:Cco:l:S:pt:T:nm:WUr:qF:", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) {
                     return ParseOption(c, arg, a, help);
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(CheckOptions(a));
  const std::string target_format =
      a.target_format.empty() ? "raw" : a.target_format;
  if (HasHelpOption(a.option_texts)) {
    RETURN_IF_ERROR(CheckFormat(target_format, /*for_create=*/true));
    if (target_format == "qcow2") {
      if (operands.size() >= 2) {
        streams.out << "Supported options:\n" << Qcow2OptionHelp(true);
      } else {
        streams.out << "Supported qcow2 options:\n"
                    << Qcow2OptionHelp(false) << kProtocolHint;
      }
    } else if (operands.size() >= 2) {
      streams.out << "Supported options:\n" << kFileOptionsHelp;
    } else if (target_format == "file") {
      streams.out << "Supported file options:\n"
                  << kFileOptionsHelp << kProtocolHint;
    } else {
      streams.out << "Supported raw options:\n" << kSizeHelp << kProtocolHint;
    }
    return absl::OkStatus();
  }
  if (operands.size() < 2) {
    return absl::InvalidArgumentError("Must specify image file name");
  }
  if (a.salvage) {
    return absl::UnimplementedError("--salvage is not supported yet");
  }
  if (a.rate_limit != 0) {
    return absl::UnimplementedError("-r is not supported yet");
  }
  if (!CacheMode(a.source_cache).has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid source cache option: ", a.source_cache));
  }
  const std::vector<std::string> source_names(operands.begin(),
                                              operands.end() - 1);
  const std::string& target_name = operands.back();

  Progress progress(a.progress && !a.quiet, 1.0f, streams.out);
  progress.Print(0, 100);
  std::vector<OpenedImage> images;
  absl::Status status =
      Convert(a, source_names, target_name, progress, images, streams);
  absl::Status closed = CloseAll(images);
  if (status.ok()) status = closed;
  if (status.ok()) progress.Print(100, 0);
  progress.End();
  return status;
}

}  // namespace imgtool::cli
