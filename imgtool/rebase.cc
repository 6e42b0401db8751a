// imgtool rebase [-f FMT] [-t CACHE] [-T SRC_CACHE] [-p] [-u] [-U] [-q]
// -b BACKING [-F BACKING_FMT] FILE (and --image-opts): qemu-img 7.2's
// rebase. Changes the backing file FILE's header names (qcow2 only:
// qcow2::Qcow2Node::ChangeBackingFile, one write of the header cluster
// after everything before it is durable).
//
// Unsafe mode (-u) only rewrites the header: FILE is opened without its
// backing file and the new one is never opened, so neither needs to exist.
// Safe mode first makes FILE's contents independent of the change: FILE is
// opened with its backing chain (the old chain), the new backing file
// (resolved against FILE's directory) is opened read-only, and every range
// FILE's own layer does not allocate and where the two chains read
// differently is copied from the old chain into FILE, in runs of differing
// 512-byte sectors as qemu-img writes them (zeroes past the end of the old
// chain are written as zeroes). `-b ""` compares against nothing, so it
// copies everything the old chain provides (flatten). Ranges that both
// chains report as zeroes are never read. The walk is qemu-img's, step for
// step (2 MiB steps cut at FILE's allocation changes and at the ends of
// the backing files), so that -p prints the same progress lines and FILE's
// clusters are allocated in the same order: the resulting files are
// byte-identical to qemu-img's.
//
// A crash during the copy leaves FILE readable with the old backing file
// and the same guest view (the copied data equals what the old chain
// showed there); the header names the new backing file only after that
// data is durable.
//
// Errors are qemu-img's, exit code 1: "Could not open new backing file
// 'B': ...", "Could not change the backing file to 'B': ..." (raw FILE:
// "Operation not supported"; a name that does not fit in the first
// cluster: "No space left in the file header"), and the copy's "error
// while reading from old backing file" / "Error while writing to COW
// image: ...". Rebasing an image onto an image whose chain holds it fails
// on its lock, as in qemu-img, before anything is written.
#include <getopt.h>
#include <stdlib.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "block/registry.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/progress.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/chain_status.h"
#include "io/engine.h"
#include "io/sync.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool rebase [-f FMT] [-t CACHE] [-T SRC_CACHE] [-p] [-u] [-U] "
    "[-q] -b BACKING [-F BACKING_FMT] FILE";

constexpr char kHelp[] =
    "Usage: imgtool rebase [--image-opts] [-U] [-q] [-f FMT] [-t CACHE] "
    "[-T SRC_CACHE] [-p] [-u]\n"
    "        -b BACKING [-F BACKING_FMT] FILE\n"
    "Changes the backing file of the qcow2 image FILE to BACKING.\n"
    "Safe mode (default) first copies into FILE whatever reads differently "
    "through\nthe new backing file, so the guest sees the same data; "
    "-b \"\" removes the\nbacking file after copying everything it provided "
    "into FILE.\n"
    "  -f FMT            format of FILE (raw, file, qcow2); probed if absent\n"
    "  --image-opts      FILE is an option string (driver=qcow2,...)\n"
    "  -b BACKING        the new backing file (relative names are relative "
    "to FILE's\n"
    "                    directory); \"\" for none\n"
    "  -F BACKING_FMT    format of the new backing file (needed with -b)\n"
    "  -u                unsafe mode: only change the name in the header; "
    "the backing\n"
    "                    files are not opened and need not exist\n"
    "  -t CACHE          cache mode of FILE (default writeback)\n"
    "  -T SRC_CACHE      cache mode of the backing files (default "
    "writeback)\n"
    "  -p                show progress\n"
    "  -q                quiet\n"
    "  -U, --force-share open the new backing file without taking its "
    "locks\n";

// qemu-img's IO_BUF_SIZE: the largest range one step of the walk compares.
constexpr uint64_t kStepSize = 2 << 20;
constexpr uint64_t kSectorSize = 512;

enum LongOption {
  kObject = 256,
  kImageOpts,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

struct RebaseArgs {
  std::string format;
  std::optional<std::string> backing;         // -b
  std::optional<std::string> backing_format;  // -F
  std::string cache = "writeback";
  std::string source_cache = "writeback";
  bool unsafe = false;
  bool progress = false;
  bool quiet = false;
  bool force_share = false;
  bool image_opts = false;
};

// The length QEMU gives a node (bdrv_getlength: whole sectors): a qcow2
// node's virtual size rounded down to 512 bytes, a raw file's length
// rounded up (the bytes past its end read as zeroes).
uint64_t NodeLength(const io::BlockNode& node) {
  if (dynamic_cast<const qcow2::Qcow2Node*>(&node) != nullptr) {
    return node.size() / kSectorSize * kSectorSize;
  }
  return AlignUp(node.size(), kSectorSize);
}

// QEMU's bdrv_find_backing_image(FILE, name): the node of FILE's backing
// chain (below FILE) that `name` designates, compared level by level as
// QEMU does: a relative `name` is resolved against the image naming each
// level's backing file and both sides are canonicalized (realpath; a
// level where either does not exist is skipped), protocol names are
// compared as strings. Null if none.
io::BlockNode* FindInChain(io::BlockNode& top, const std::string& name) {
  for (io::BlockNode* curr = &top; curr->backing() != nullptr;
       curr = curr->backing()) {
    auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(curr);
    if (qcow2 == nullptr) break;
    io::BlockNode* below = curr->backing();
    if (HasProtocol(name) || HasProtocol(qcow2->backing_filename())) {
      if (name == qcow2->backing_filename() ||
          name == qcow2->full_backing_filename()) {
        return below;
      }
      continue;
    }
    const std::optional<std::string> wanted =
        RealPath(ResolveBackingFilename(curr->filename(), name));
    if (!wanted.has_value()) continue;
    const std::optional<std::string> actual =
        RealPath(qcow2->full_backing_filename());
    if (!actual.has_value()) continue;
    if (*wanted == *actual) return below;
  }
  return nullptr;
}

// QEMU's bdrv_is_allocated on one node's own layer: whether
// [offset, offset + *bytes) starts with a range the node allocates (data
// or zeroes), and in *bytes how long the answer holds.
io::Task<absl::StatusOr<bool>> IsAllocated(io::BlockNode& node,
                                           uint64_t offset, uint64_t* bytes) {
  if (offset >= node.size()) {
    // Past the end: no answer of any length (QEMU's BDRV_BLOCK_EOF).
    *bytes = 0;
    co_return false;
  }
  const uint64_t n = std::min(*bytes, node.size() - offset);
  // Not the file's holes under preallocated metadata (want_zero false).
  // Separate statements, never a conditional over two co_awaits: GCC 12
  // destroys the temporaries of such an expression twice.
  auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(&node);
  absl::StatusOr<io::BlockStatus> s;
  if (qcow2 != nullptr) {
    s = co_await qcow2->GetAllocationStatus(offset, n);
  } else {
    s = co_await node.GetBlockStatus(offset, n);
  }
  if (!s.ok()) co_return s.status();
  *bytes = s->length;
  co_return s->data || s->zero;
}

// QEMU's bdrv_is_allocated_above(top, base, include_base=false): whether
// a node from `top` down to `base` (excluded) allocates the start of the
// range, in *bytes how long; QEMU's answer for an allocated range is the
// length the allocating node reports, whatever the nodes above said.
io::Task<absl::StatusOr<bool>> IsAllocatedAbove(io::BlockNode* top,
                                                io::BlockNode* base,
                                                uint64_t offset,
                                                uint64_t* bytes) {
  uint64_t n = *bytes;
  for (io::BlockNode* node = top; node != nullptr && node != base;
       node = node->backing()) {
    uint64_t inter = *bytes;
    CO_ASSIGN_OR_RETURN(bool allocated,
                        co_await IsAllocated(*node, offset, &inter));
    if (allocated) {
      *bytes = inter;
      co_return true;
    }
    const uint64_t size = NodeLength(*node);
    if (n > inter && (node == top || offset + inter < size)) n = inter;
  }
  *bytes = n;
  co_return false;
}

// Reading one step of both chains: the bytes each chain reports as zeroes
// (holes, zero clusters, allocated nowhere, past its end) are set to 0
// without reading; the other extents are read with up to kReadsInFlight
// requests at once over both chains (qemu-img reads each chain's step with
// one request, which its qcow2 driver splits into up to 8 parallel ones).
constexpr int kReadsInFlight = 16;

struct ReadExtent {
  io::BlockNode* chain = nullptr;
  uint64_t offset = 0;  // in the chain
  uint64_t length = 0;
  uint8_t* dst = nullptr;
  bool old_chain = false;  // for the error message
};

// Adds the extents of [offset, offset + length) of `chain` that hold data
// to `extents` and the rest to `zeroes` (to be zeroed in `buf`, which maps
// `offset`, if the step is compared at all). Returns whether the whole
// range reads as zeroes.
io::Task<absl::StatusOr<bool>> PlanReads(io::BlockNode& chain, uint64_t offset,
                                         uint64_t length, uint8_t* buf,
                                         bool old_chain,
                                         std::vector<ReadExtent>& extents,
                                         std::vector<io::IoVec>& zeroes) {
  bool all_zero = true;
  uint64_t done = 0;
  while (done < length) {
    const uint64_t at = offset + done;
    uint64_t n = length - done;
    bool zero = true;
    if (at < chain.size()) {
      CO_ASSIGN_OR_RETURN(io::ChainStatus cs,
                          co_await io::GetChainStatus(
                              chain, at, std::min(n, chain.size() - at)));
      n = std::min(n, cs.status.length);
      zero = cs.status.zero || !cs.present;
    }
    if (zero) {
      zeroes.push_back(io::IoVec(buf + done, n));
    } else if (!extents.empty() && extents.back().chain == &chain &&
               extents.back().offset + extents.back().length == at) {
      all_zero = false;
      extents.back().length += n;  // one request for adjacent data
    } else {
      all_zero = false;
      extents.push_back(ReadExtent{&chain, at, n, buf + done, old_chain});
    }
    done += n;
  }
  co_return all_zero;
}

// One of ReadAll's workers: reads extents[next++] until none are left or a
// read failed.
io::Task<void> ReadWorker(const std::vector<ReadExtent>& extents, size_t& next,
                          absl::Status& error) {
  while (error.ok() && next < extents.size()) {
    const ReadExtent& e = extents[next++];
    absl::Status st =
        co_await e.chain->Read(e.offset, io::IoVec(e.dst, e.length));
    if (!st.ok() && error.ok()) {
      error = absl::Status(st.code(), e.old_chain
                                          ? "error while reading from old "
                                            "backing file"
                                          : "error while reading from new "
                                            "backing file");
    }
  }
}

// Reads every extent, kReadsInFlight at a time; the first error.
io::Task<absl::Status> ReadAll(const std::vector<ReadExtent>& extents) {
  const int workers =
      static_cast<int>(std::min<size_t>(kReadsInFlight, extents.size()));
  if (workers == 0) co_return absl::OkStatus();
  size_t next = 0;
  absl::Status error;
  int running = workers;
  io::Event done;
  for (int i = 0; i < workers; ++i) {
    io::Spawn(ReadWorker(extents, next, error), [&running, &done] {
      if (--running == 0) done.Set();
    });
  }
  co_await done.Wait();
  co_return error;
}

// qemu-img's compare_buffers: whether the first 512-byte sector of the two
// buffers differs, and in *run how many bytes from the start share that
// answer (whole sectors, the last one possibly shorter).
bool CompareSectors(const uint8_t* a, const uint8_t* b, uint64_t length,
                    uint64_t* run) {
  uint64_t i = std::min(length, kSectorSize);
  const bool differs = std::memcmp(a, b, i) != 0;
  while (i < length) {
    const uint64_t n = std::min(length - i, kSectorSize);
    if ((std::memcmp(a + i, b + i, n) != 0) != differs) break;
    i += n;
  }
  *run = i;
  return differs;
}

std::string ErrnoText(const absl::Status& status) {
  if (const int e = StatusErrno(status); e != 0) return std::strerror(e);
  return std::string(status.message());
}

// The copy of safe mode (qemu-img's loop over FILE): walks FILE in steps
// of at most 2 MiB; a step FILE's layer allocates, or (new backing file in
// FILE's chain) that no node between FILE's backing file and the new one
// allocates, is skipped; otherwise the old chain's and the new one's bytes
// are compared and each run of differing sectors is written into FILE.
// The steps, their lengths and the writes are qemu-img's, so that progress
// and the resulting file match; what differs is that ranges both chains
// report as zeroes are not read, a step's data extents are read in
// parallel, and the next step is read while this one's differences are
// written (when this step ends on a cluster boundary of FILE).
// Not block::Copy: its rebase mode chunks by the old chain's block status,
// counts progress by the bytes to write and writes zero runs as zeroes by
// their content; qemu-img 7.2 steps by FILE's allocation, adds 100/steps %
// per compared step and writes zeroes only past the old chain's end, so
// the files and -p lines would differ.
class SafeRebase {
 public:
  // `old_backing` and `new_backing` may be null (no old backing file;
  // flatten). `new_in_chain`: `new_backing` is a node of FILE's backing
  // chain (qemu-img's prefix_chain_bs).
  SafeRebase(io::BlockNode& file, io::BlockNode* old_backing,
             io::BlockNode* new_backing, bool new_in_chain, Progress& progress)
      : file_(file),
        old_(old_backing),
        new_(new_backing),
        new_in_chain_(new_in_chain),
        progress_(progress) {}

  io::Task<absl::Status> Run() {
    size_ = NodeLength(file_);
    old_size_ = old_ != nullptr ? NodeLength(*old_) : 0;
    new_size_ = new_ != nullptr ? NodeLength(*new_) : 0;
    float step_progress = 0;
    if (size_ != 0) {
      step_progress =
          100.0f / static_cast<float>(size_ / std::min(size_, kStepSize));
    }
    // FILE's allocation unit: a step's writes change FILE's allocation
    // only in the clusters they touch.
    uint64_t unit = kSectorSize;
    if (auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(&file_)) {
      unit = qcow2->cluster_size();
    }
    Step steps[2];
    for (Step& st : steps) {
      st.old_buf = io::AlignedBuffer(kStepSize);
      st.new_buf = io::AlignedBuffer(kStepSize);
    }
    int cur = 0;
    uint64_t offset = 0;
    CO_ASSIGN_OR_RETURN(bool found, co_await FindStep(&offset, steps[cur]));
    if (found) steps[cur].StartReads();
    while (found) {
      Step& step = steps[cur];
      Step& next = steps[1 - cur];
      CO_RETURN_IF_ERROR(co_await step.FinishReads());
      uint64_t next_offset = step.offset + step.length;
      // While this step's differences are written, the next step is found
      // and read, when this step's writes cannot change FILE's allocation
      // there (the step ends on a cluster boundary of FILE). Else after
      // them, as in qemu-img: a write that allocates FILE's cluster across
      // the step's end makes the next step skip that cluster.
      bool next_found = false;
      absl::Status lookahead;
      const bool ahead = next_offset % unit == 0;
      if (ahead) {
        absl::StatusOr<bool> f = co_await FindStep(&next_offset, next);
        if (f.ok()) {
          next_found = *f;
          if (next_found) next.StartReads();
        } else {
          lookahead = f.status();  // reported after this step, as qemu-img
        }
      }
      if (!step.both_zero) {
        step.ZeroGaps();
        absl::Status st = co_await WriteDifferences(
            step.offset, step.length, step.old_buf.data(),
            step.new_buf.data(), step.old_is_zero);
        if (!st.ok()) {
          // The next step's reads use this frame: let them end first.
          if (next_found) (void)co_await next.FinishReads();
          co_return st;
        }
      }
      progress_.Print(step_progress, 100);
      if (!ahead) {
        CO_ASSIGN_OR_RETURN(next_found, co_await FindStep(&next_offset, next));
        if (next_found) next.StartReads();
      } else if (!lookahead.ok()) {
        co_return lookahead;
      }
      found = next_found;
      cur = 1 - cur;
    }
    co_return absl::OkStatus();
  }

 private:
  // One compared step: its range, what each chain reads there, and the
  // reads in flight.
  struct Step {
    uint64_t offset = 0;
    uint64_t length = 0;
    bool old_is_zero = false;  // past the old chain's end
    bool read_new = false;     // the new chain has bytes here
    bool both_zero = false;    // both chains read zeroes: nothing to do
    std::vector<ReadExtent> extents;
    std::vector<io::IoVec> zeroes;
    io::AlignedBuffer old_buf;
    io::AlignedBuffer new_buf;
    // The reads: started by StartReads, waited for by FinishReads.
    std::unique_ptr<io::Event> done;
    absl::Status read_status;

    void StartReads() {
      done = std::make_unique<io::Event>();
      if (both_zero) {
        done->Set();
        return;
      }
      io::Spawn(ReadAll(extents), [this](absl::Status st) {
        read_status = std::move(st);
        done->Set();
      });
    }
    io::Task<absl::Status> FinishReads() {
      co_await done->Wait();
      co_return read_status;
    }
    // The bytes the chains report as zeroes, and a chain without bytes
    // here, read as zeroes.
    void ZeroGaps() {
      for (io::IoVec z : zeroes) std::memset(z.data(), 0, z.size());
      if (old_is_zero) std::memset(old_buf.data(), 0, length);
      if (!read_new) std::memset(new_buf.data(), 0, length);
    }
  };

  // qemu-img's walk from *offset: skips the steps FILE allocates (or, the
  // new backing file being in FILE's chain, that nothing above it
  // allocates), and fills `step` with the next step to compare, its reads
  // planned. *offset ends at that step. False at the end of FILE.
  io::Task<absl::StatusOr<bool>> FindStep(uint64_t* offset, Step& step) {
    uint64_t n = 0;
    for (; *offset < size_; *offset += n) {
      n = std::min(kStepSize, size_ - *offset);
      absl::StatusOr<bool> allocated = co_await IsAllocated(file_, *offset, &n);
      if (!allocated.ok()) co_return MetadataError(allocated.status());
      if (*allocated) continue;
      if (new_in_chain_) {
        allocated =
            co_await IsAllocatedAbove(file_.backing(), new_, *offset, &n);
        if (!allocated.ok()) co_return MetadataError(allocated.status());
        if (!*allocated) continue;
      }
      break;
    }
    if (*offset >= size_) co_return false;
    step.offset = *offset;
    step.old_is_zero = *offset >= old_size_;
    if (!step.old_is_zero) n = std::min(n, old_size_ - *offset);
    step.read_new = new_ != nullptr && *offset < new_size_;
    if (step.read_new) n = std::min(n, new_size_ - *offset);
    step.length = n;
    step.extents.clear();
    step.zeroes.clear();
    bool old_reads_zero = true;
    bool new_reads_zero = true;
    if (!step.old_is_zero) {
      absl::StatusOr<bool> zero =
          co_await PlanReads(*old_, step.offset, n, step.old_buf.data(),
                             /*old_chain=*/true, step.extents, step.zeroes);
      if (!zero.ok()) {
        co_return absl::Status(zero.status().code(),
                               "error while reading from old backing file");
      }
      old_reads_zero = *zero;
    }
    if (step.read_new) {
      absl::StatusOr<bool> zero =
          co_await PlanReads(*new_, step.offset, n, step.new_buf.data(),
                             /*old_chain=*/false, step.extents, step.zeroes);
      if (!zero.ok()) {
        co_return absl::Status(zero.status().code(),
                               "error while reading from new backing file");
      }
      new_reads_zero = *zero;
    }
    step.both_zero = old_reads_zero && new_reads_zero;
    co_return true;
  }

  static absl::Status MetadataError(const absl::Status& st) {
    return absl::Status(st.code(),
                        absl::StrCat("error while reading image metadata: ",
                                     ErrnoText(st)));
  }

  io::Task<absl::Status> WriteDifferences(uint64_t offset, uint64_t length,
                                          const uint8_t* old_data,
                                          const uint8_t* new_data,
                                          bool old_is_zero) {
    uint64_t done = 0;
    while (done < length) {
      uint64_t run = 0;
      if (CompareSectors(old_data + done, new_data + done, length - done,
                         &run)) {
        absl::Status st;  // not a conditional over two co_awaits (GCC 12)
        if (old_is_zero) {
          st = co_await file_.WriteZeroes(offset + done, run,
                                          io::WriteZeroesFlags{});
        } else {
          st = co_await file_.Write(offset + done,
                                    io::ConstIoVec(old_data + done, run));
        }
        if (!st.ok()) {
          co_return absl::Status(
              st.code(),
              absl::StrCat("Error while writing to COW image: ", ErrnoText(st)));
        }
      }
      done += run;
    }
    co_return absl::OkStatus();
  }

  io::BlockNode& file_;
  io::BlockNode* old_;
  io::BlockNode* new_;
  bool new_in_chain_;
  Progress& progress_;
  uint64_t size_ = 0;      // FILE's length, bytes
  uint64_t old_size_ = 0;  // 0 without an old backing file
  uint64_t new_size_ = 0;  // 0 for -b ""
};

// Everything after the option checks, in qemu-img's order; `images` holds
// what was opened (FILE first), closed by the caller.
absl::Status Rebase(const RebaseArgs& a, const std::string& filename,
                    Progress& progress, std::vector<OpenedImage>& images,
                    Streams streams) {
  const std::optional<std::string> cache = CacheMode(a.cache);
  if (!cache.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid cache option: ", a.cache));
  }
  const std::optional<std::string> source_cache = CacheMode(a.source_cache);
  if (!source_cache.has_value()) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid source cache option: ", a.source_cache));
  }

  // The old backing file is not opened in unsafe mode: -u also repairs
  // the name of a backing file that moved.
  ImageSpec spec;
  spec.filename = filename;
  spec.format = a.format;
  spec.image_opts = a.image_opts;
  spec.cache = *cache;
  spec.read_only = false;
  spec.no_backing = a.unsafe;
  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(spec, streams.err));
  images.reserve(2);  // `file` below stays valid
  images.push_back(std::move(image));
  OpenedImage& file = images.front();

  if (a.backing_format.has_value() &&
      CheckFormat(*a.backing_format, /*for_create=*/false).code() ==
          absl::StatusCode::kInvalidArgument) {
    return absl::InvalidArgumentError(
        absl::StrCat("Invalid format name: '", *a.backing_format, "'"));
  }

  if (!a.unsafe) {
    io::BlockNode* old_backing = file.node->backing();
    io::BlockNode* new_backing = nullptr;
    bool new_in_chain = false;
    if (!a.backing->empty()) {
      const std::string& name = *a.backing;
      if (IsRelativeFilename(name) &&
          absl::StartsWith(file.display_name, "json:")) {
        return absl::InvalidArgumentError(absl::StrCat(
            "Could not resolve backing filename: Cannot use relative backing "
            "file names for '",
            file.display_name, "'"));
      }
      const std::string path = ResolveBackingFilename(file.display_name, name);
      new_backing = FindInChain(*file.node, path);
      if (new_backing != nullptr) {
        new_in_chain = true;
      } else {
        ImageSpec b;
        b.filename = path;
        b.format = a.backing_format.value_or("");
        b.cache = *source_cache;
        b.read_only = true;
        b.force_share = a.force_share;
        absl::StatusOr<OpenedImage> opened =
            OpenImage(b, streams.err, file.engine);
        if (!opened.ok()) {
          // blk_new_open's error, without img_open's "Could not open
          // '<file>': " that OpenImage puts before it.
          absl::string_view cause = opened.status().message();
          absl::ConsumePrefix(&cause,
                              absl::StrCat("Could not open '", path, "': "));
          return absl::Status(
              opened.status().code(),
              absl::StrCat("Could not open new backing file '", name, "': ",
                           cause));
        }
        images.push_back(*std::move(opened));
        new_backing = images.back().node.get();
      }
    }
    SafeRebase copy(*file.node, old_backing, new_backing, new_in_chain,
                    progress);
    RETURN_IF_ERROR(io::RunSync(*file.engine, copy.Run()));
  }

  // Every range that reads differently through the new backing file is in
  // FILE now (and durable before the header names it: ChangeBackingFile
  // flushes first).
  std::optional<std::string> name;
  std::optional<std::string> format;
  if (a.backing.has_value() && !a.backing->empty()) {
    name = a.backing;
    format = a.backing_format;
  }
  // The name as qemu-img prints it: "(null)" for -u without -b.
  const std::string shown = a.backing.has_value() ? *a.backing : "(null)";
  absl::Status changed;
  if (name.has_value() && !format.has_value()) {
    changed = absl::InvalidArgumentError(
        absl::StrCat("Could not change the backing file to '", shown,
                     "': backing format must be specified"));
  } else if (file.qcow2 == nullptr) {
    changed = absl::UnimplementedError(
        absl::StrCat("Could not change the backing file to '", shown,
                     "': ", std::strerror(ENOTSUP)));
  } else {
    changed = io::RunSync(*file.engine,
                          file.qcow2->ChangeBackingFile(name, format));
    if (absl::IsResourceExhausted(changed)) {
      changed = absl::Status(
          changed.code(),
          absl::StrCat("Could not change the backing file to '", shown,
                       "': No space left in the file header"));
    } else if (absl::IsInvalidArgument(changed)) {
      changed = absl::Status(
          changed.code(), absl::StrCat("Could not change the backing file to '",
                                       shown, "': ", std::strerror(EINVAL)));
    } else if (!changed.ok()) {
      changed = absl::Status(
          changed.code(), absl::StrCat("Could not change the backing file to '",
                                       shown, "': ", ErrnoText(changed)));
    }
  }
  // qemu-img prints 100% whether or not the header could be changed.
  progress.Print(100, 0);
  return changed;
}

}  // namespace

absl::Status RunRebase(const std::vector<std::string>& args, Streams streams) {
  RebaseArgs a;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hf:F:b:upt:T:qU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     switch (c) {
                       case 'h':
                         help = true;
                         break;
                       case 'f':
                         a.format = arg;
                         break;
                       case 'F':
                         a.backing_format = arg;
                         break;
                       case 'b':
                         a.backing = arg;
                         break;
                       case 'u':
                         a.unsafe = true;
                         break;
                       case 'p':
                         a.progress = true;
                         break;
                       case 't':
                         a.cache = arg;
                         break;
                       case 'T':
                         a.source_cache = arg;
                         break;
                       case 'q':
                         a.quiet = true;
                         break;
                       case 'U':
                         a.force_share = true;
                         break;
                       case kObject:
                         return absl::UnimplementedError(
                             "--object is not supported yet");
                       case kImageOpts:
                         a.image_opts = true;
                         break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (a.quiet) a.progress = false;
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", "");
  }
  if (!a.unsafe && !a.backing.has_value()) {
    return UsageError("Must specify backing file (-b) or use unsafe mode (-u)",
                      "");
  }
  Progress progress(a.progress, 2.0f, streams.out);
  progress.Print(0, 100);
  std::vector<OpenedImage> images;
  absl::Status status = Rebase(a, operands[0], progress, images, streams);
  // The new backing file first, FILE (which flushes) last.
  absl::Status closed;
  for (auto it = images.rbegin(); it != images.rend(); ++it) {
    absl::Status st = CloseImage(*it);
    if (closed.ok() && !st.ok()) closed = st;
  }
  if (status.ok()) status = closed;
  progress.End();
  return status;
}

}  // namespace imgtool::cli
