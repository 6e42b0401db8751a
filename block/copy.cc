#include "block/copy.h"

#include <time.h>

#include <algorithm>
#include <climits>
#include <coroutine>
#include <cstring>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "base/zero.h"
#include "io/aligned_buffer.h"
#include "io/chain_status.h"
#include "io/sync.h"

namespace imgtool::block {
namespace {

// The largest single request (QEMU's BDRV_REQUEST_MAX_BYTES).
constexpr uint64_t kMaxRequest = static_cast<uint64_t>(INT_MAX) & ~511ull;

// Reads in flight per compared chunk (over the source and the reference).
constexpr int kCompareReadsInFlight = 16;

constexpr absl::string_view kCopyOpPayload = "imgtool.block.CopyOp";

absl::Status Tagged(absl::Status status, CopyOp op) {
  status.SetPayload(kCopyOpPayload,
                    absl::Cord(std::string(1, static_cast<char>(op))));
  return status;
}

// QEMU's bdrv_is_allocated on one node's own layer: block status that does
// not cut a qcow2 node's data at holes of its file (want_zero false).
// `offset` < node.size().
io::Task<absl::StatusOr<io::BlockStatus>> OwnAllocation(io::BlockNode& node,
                                                        uint64_t offset,
                                                        uint64_t length) {
  // Separate statements, never a conditional over two co_awaits: GCC 12
  // destroys the temporaries of such an expression twice.
  absl::StatusOr<io::BlockStatus> status;
  if (auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(&node)) {
    status = co_await qcow2->GetAllocationStatus(offset, length);
  } else {
    status = co_await node.GetBlockStatus(offset, length);
  }
  co_return status;
}

uint64_t MonotonicNs() {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<uint64_t>(ts.tv_sec) * 1'000'000'000ull +
         static_cast<uint64_t>(ts.tv_nsec);
}

void SleepNs(uint64_t ns) {
  struct timespec ts;
  ts.tv_sec = static_cast<time_t>(ns / 1'000'000'000ull);
  ts.tv_nsec = static_cast<long>(ns % 1'000'000'000ull);
  while (nanosleep(&ts, &ts) != 0) {
  }
}

// The copy itself (qemu-img's convert_do_copy, generalised). The target is
// split into chunks that are data (read, scanned for zeroes, written), zero
// (skipped on a zeroed target, else written as zeroes that may unmap) or
// skipped; workers take chunks in order and, unless out-of-order writes are
// allowed, write them in order too.
class Copier {
 public:
  Copier(std::vector<CopySource> sources, io::BlockNode& target,
         const CopySettings& settings)
      : sources_(std::move(sources)),
        target_(target),
        settings_(settings),
        limiter_(settings.rate_limit),
        waiting_(settings.num_workers) {
    for (const CopySource& s : sources_) total_ += s.length;
    stepping_ = settings_.step_by_target_allocation;
    comparing_ = stepping_ || settings_.reference != nullptr;
    if (stepping_) {
      settings_.in_order = true;
      settings_.skip_target_allocated = true;
      if (settings_.target_cluster_size > 1) {
        target_unit_ = settings_.target_cluster_size;
      } else if (auto* qcow2 = dynamic_cast<qcow2::Qcow2Node*>(&target_)) {
        target_unit_ = qcow2->cluster_size();
      }
    }
    if (comparing_ && !sources_.empty()) {
      const io::BlockNode* node = sources_.front().node;
      if (node != nullptr) source_end_ = AlignUp(node->size(), kSectorSize);
      for (; node != nullptr && settings_.reference != nullptr;
           node = node->backing()) {
        if (node == settings_.reference) reference_in_source_chain_ = true;
      }
    }
    if (settings_.reference != nullptr) {
      reference_end_ = AlignUp(settings_.reference->size(), kSectorSize);
    }
    if (settings_.progress_per_step && total_ != 0) {
      step_progress_ =
          100.0f / static_cast<float>(
                       total_ / std::min(total_, settings_.max_chunk));
    }
  }

  // Counts the bytes to write so the progress can be shown as a fraction of
  // them, then copies.
  io::Task<absl::Status> Run() {
    if (settings_.progress != nullptr && !settings_.progress_per_step) {
      uint64_t offset = 0;
      while (offset < total_) {
        CO_ASSIGN_OR_RETURN(uint64_t n, co_await NextChunk(offset));
        if (CountsForProgress(status_)) allocated_sectors_ += n / kSectorSize;
        offset += n;
      }
      next_status_end_ = 0;
    }
    if (total_ == 0) co_return co_await Finish();
    running_ = settings_.num_workers;
    for (int i = 0; i < settings_.num_workers; ++i) {
      io::Spawn(Worker(i), [this] {
        if (--running_ == 0) done_.Set();
      });
    }
    co_await done_.Wait();
    co_return co_await Finish();
  }

 private:
  enum class ChunkKind { kData, kZero, kSkip };

  struct Waiter {
    bool waiting = false;
    uint64_t offset = 0;
    std::coroutine_handle<> handle;
  };

  io::Task<absl::Status> Finish() {
    if (error_.ok() && settings_.compressed_target != nullptr) {
      // qemu-img's compressed write of 0 bytes: pads the file to a sector.
      co_return co_await settings_.compressed_target->WriteCompressed(
          0, io::ConstIoVec());
    }
    co_return error_;
  }

  bool CountsForProgress(ChunkKind kind) const {
    return kind == ChunkKind::kData ||
           (kind == ChunkKind::kZero &&
            (settings_.zero_ranges_as_data ||
             settings_.progress_counts_zero_ranges));
  }

  const CopySource& SourceAt(uint64_t offset) const {
    size_t index = 0;
    while (offset - sources_[index].start >= sources_[index].length) ++index;
    return sources_[index];
  }

  // The length of the chunk starting at target offset `offset` (a multiple
  // of 512 bytes); its kind is left in status_. Block status is asked once
  // per extent and reused for the chunks inside it. Runs under mutex_.
  io::Task<absl::StatusOr<uint64_t>> NextChunk(uint64_t offset) {
    const CopySource& source = SourceAt(offset);
    const uint64_t in_source = offset - source.start + source.node_offset;
    uint64_t n = std::min({total_ - offset, kMaxRequest,
                           source.length - (offset - source.start)});
    if (source.view == SourceView::kAboveBase) {
      co_return co_await MirrorChunk(source, offset, in_source, n);
    }
    if (stepping_) co_return co_await StepChunk(source, offset);
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
      if (settings_.skip_target_allocated && offset < target_.size()) {
        CO_ASSIGN_OR_RETURN(
            io::BlockStatus own,
            co_await AllocationOrError(target_, offset,
                                       std::min(n, target_.size() - offset)));
        if (own.data || own.zero) {
          n = AlignUp(own.length, kSectorSize);
          status_ = ChunkKind::kSkip;
          next_status_end_ = offset + n;
          co_return n;
        }
        n = std::min(n, own.length);
      }
      if (reference_in_source_chain_ && in_source < source.node->size()) {
        CO_ASSIGN_OR_RETURN(
            auto above,
            co_await AllocatedAbove(
                source.node, settings_.reference, in_source,
                std::min(n, source.node->size() - in_source)));
        n = std::min(n, above.second);
        if (!above.first) {
          n = AlignUp(n, kSectorSize);
          status_ = ChunkKind::kSkip;
          next_status_end_ = offset + n;
          co_return n;
        }
      }
      uint64_t count = n;
      ChunkKind kind = ChunkKind::kZero;
      // Past the node's end (up to the 512-byte rounding) it reads zeroes.
      if (in_source < source.node->size()) {
        CO_ASSIGN_OR_RETURN(io::BlockStatus status,
                            co_await SourceStatus(source, in_source, n));
        count = status.length;
        if (status.zero) {
          kind = past_backing_end ? ChunkKind::kSkip : ChunkKind::kZero;
        } else if (status.data || source.view != SourceView::kTopOnly) {
          kind = ChunkKind::kData;
        } else {
          kind = ChunkKind::kSkip;
        }
      }
      n = AlignUp(count, kSectorSize);
      status_ = kind;
      next_status_end_ = offset + n;
    }
    n = std::min(n, next_status_end_ - offset);
    if (status_ == ChunkKind::kData) n = std::min(n, settings_.max_chunk);
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

  // Block status of `node` (its own layer), with the copy's error text.
  static io::Task<absl::StatusOr<io::BlockStatus>> StatusOrError(
      io::BlockNode& node, uint64_t offset, uint64_t length) {
    absl::StatusOr<io::BlockStatus> status =
        co_await node.GetBlockStatus(offset, length);
    if (!status.ok()) co_return BlockStatusError(status.status(), offset);
    co_return status;
  }

  // Allocation in `node`'s own layer (OwnAllocation), with the copy's
  // error text.
  static io::Task<absl::StatusOr<io::BlockStatus>> AllocationOrError(
      io::BlockNode& node, uint64_t offset, uint64_t length) {
    absl::StatusOr<io::BlockStatus> status =
        co_await OwnAllocation(node, offset, length);
    if (!status.ok()) co_return BlockStatusError(status.status(), offset);
    co_return status;
  }

  static absl::Status BlockStatusError(const absl::Status& st,
                                       uint64_t offset) {
    return Tagged(
        WithMessage(st, absl::StrCat("error while reading block status at "
                                     "offset ",
                                     offset, ": ", st.message())),
        CopyOp::kBlockStatus);
  }

  // A step of qemu-img rebase's walk from target `offset` (see
  // CopySettings::step_by_target_allocation): the steps the target
  // allocates, or that nothing above the reference allocates, are skipped
  // together, and the chunk goes on with the step to compare after them
  // (cut at the source's and the reference's ends; skip_prefix_ is the
  // length skipped first), so that a worker's chunk is never a skip only
  // but at the end. Runs under mutex_.
  io::Task<absl::StatusOr<uint64_t>> StepChunk(const CopySource& source,
                                               uint64_t offset) {
    uint64_t at = offset;
    uint64_t n = 0;
    for (; at < total_; at += n) {
      n = std::min(settings_.max_chunk, total_ - at);
      if (at < target_.size()) {
        CO_ASSIGN_OR_RETURN(
            io::BlockStatus own,
            co_await AllocationOrError(target_, at,
                                       std::min(n, target_.size() - at)));
        n = own.length;
        if (own.data || own.zero) continue;
      }
      if (reference_in_source_chain_) {
        CO_ASSIGN_OR_RETURN(
            auto above,
            co_await AllocatedAbove(source.node, settings_.reference, at, n));
        n = above.second;
        if (!above.first) continue;
      }
      break;
    }
    next_status_end_ = 0;  // no reuse across chunks
    if (at >= total_) {
      status_ = ChunkKind::kSkip;
      co_return total_ - offset;
    }
    if (at < source_end_) n = std::min(n, source_end_ - at);
    if (at < reference_end_) n = std::min(n, reference_end_ - at);
    status_ = ChunkKind::kData;
    skip_prefix_ = at - offset;
    co_return at - offset + n;
  }

  // Block status of a source range: through its whole backing chain, or
  // of its top node only (kTopOnly).
  io::Task<absl::StatusOr<io::BlockStatus>> SourceStatus(
      const CopySource& source, uint64_t offset, uint64_t length) {
    io::BlockNode& node = *source.node;
    if (source.view == SourceView::kTopOnly) {
      // What the top node does not allocate reads as zeroes when it has no
      // backing file, or from past the end of its backing file (QEMU's
      // bdrv_block_status): zeroes to write, not the target's backing file.
      CO_ASSIGN_OR_RETURN(io::BlockStatus status,
                          co_await StatusOrError(node, offset, length));
      if (!status.data && !status.zero) {
        const io::BlockNode* backing = node.backing();
        status.zero = backing == nullptr ||
                      offset >= AlignUp(backing->size(), kSectorSize);
      }
      co_return status;
    }
    absl::StatusOr<io::ChainStatus> chain =
        co_await io::GetChainStatus(node, offset, length);
    if (!chain.ok()) co_return BlockStatusError(chain.status(), offset);
    co_return chain->status;
  }

  // Whether a layer of `source` above its base allocates the bytes at
  // `offset` (QEMU's bdrv_is_allocated_above), and for how many bytes
  // (at most `length`) the answer holds. A layer shorter than `offset`
  // allocates nothing there.
  static io::Task<absl::StatusOr<std::pair<bool, uint64_t>>> AllocatedAbove(
      const CopySource& source, uint64_t offset, uint64_t length) {
    co_return co_await AllocatedAbove(source.node, source.base, offset,
                                      length);
  }

  // The same for the layers from `top` down to `base` (excluded).
  static io::Task<absl::StatusOr<std::pair<bool, uint64_t>>> AllocatedAbove(
      io::BlockNode* top, const io::BlockNode* base, uint64_t offset,
      uint64_t length) {
    uint64_t n = length;
    for (io::BlockNode* layer = top; layer != nullptr && layer != base;
         layer = layer->backing()) {
      if (offset >= layer->size()) continue;
      CO_ASSIGN_OR_RETURN(
          io::BlockStatus st,
          co_await AllocationOrError(*layer, offset,
                                     std::min(length, layer->size() - offset)));
      if (st.data || st.zero) co_return std::make_pair(true, st.length);
      // Unallocated up to the layer's end: the rest of it is too.
      if (layer == top || offset + st.length < layer->size()) {
        n = std::min(n, st.length);
      }
    }
    co_return std::make_pair(false, n);
  }

  // Whether any byte of [offset, end) is allocated above the base.
  static io::Task<absl::StatusOr<bool>> AnyAllocatedAbove(
      const CopySource& source, uint64_t offset, uint64_t end) {
    while (offset < end) {
      CO_ASSIGN_OR_RETURN(auto allocated,
                          co_await AllocatedAbove(source, offset, end - offset));
      if (allocated.first) co_return true;
      offset += allocated.second;
    }
    co_return false;
  }

  // A kAboveBase chunk at target `offset` (source offset `in_source`, at
  // most `n` bytes), the way QEMU's mirror job takes it: dirty granules
  // (any byte allocated above base) are copied, whole-granule zero runs
  // aligned to the target's clusters as zeroes, the rest as data.
  io::Task<absl::StatusOr<uint64_t>> MirrorChunk(const CopySource& source,
                                                 uint64_t offset,
                                                 uint64_t in_source,
                                                 uint64_t n) {
    const uint64_t g = settings_.granularity;
    const uint64_t end = in_source + n;
    // Granules past the node's end (up to the source length) read zeroes
    // and nothing allocates them.
    const uint64_t node_end = std::min(end, source.node->size());
    next_status_end_ = 0;  // no reuse across chunks
    if (in_source >= node_end) {
      status_ = ChunkKind::kSkip;
      co_return n;
    }
    CO_ASSIGN_OR_RETURN(
        auto allocated,
        co_await AllocatedAbove(source, in_source, node_end - in_source));
    if (!allocated.first) {
      uint64_t clean_end = in_source + allocated.second;
      if (clean_end < node_end) clean_end = AlignDown(clean_end, g);
      if (clean_end > in_source) {
        status_ = ChunkKind::kSkip;
        co_return clean_end == node_end ? n : clean_end - in_source;
      }
    }
    // The run of dirty granules from here.
    uint64_t dirty_end = in_source;
    while (dirty_end < node_end) {
      const uint64_t granule_end = std::min(dirty_end + g, node_end);
      CO_ASSIGN_OR_RETURN(bool dirty, co_await AnyAllocatedAbove(
                                          source, dirty_end, granule_end));
      if (!dirty) break;
      dirty_end = granule_end;
    }
    const uint64_t run = dirty_end - in_source;
    absl::StatusOr<io::ChainStatus> chain =
        co_await io::GetChainStatus(*source.node, in_source, run);
    if (!chain.ok()) co_return BlockStatusError(chain.status(), in_source);
    uint64_t len = chain->status.length;
    ChunkKind kind = ChunkKind::kData;
    if (chain->status.data) {
      len = std::min(len, settings_.max_chunk);
      len = AlignDown(len, g);
      if (len < g) len = g;
    } else {
      len = AlignDown(len, g);
      const uint64_t cluster = std::max<uint64_t>(settings_.target_cluster_size, 1);
      if (len < g) {
        len = g;
      } else if (offset % cluster == 0 && len % cluster == 0) {
        kind = ChunkKind::kZero;
      }
    }
    len = std::min(len, run);
    status_ = kind;
    co_return AlignUp(len, kSectorSize);
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

  // Before a write: waits (blocking the thread: see RateLimiter) until the
  // delay the writes so far earned is over.
  void WaitForRate() {
    if (settings_.rate_limit == 0) return;
    const uint64_t now = MonotonicNs();
    if (now < not_before_ns_) SleepNs(not_before_ns_ - now);
  }

  // After a write of `bytes`: counts them; the next write waits if the
  // slice's quota is used up (QEMU's jobs and throttling also let a request
  // go and delay the next one).
  void Account(uint64_t bytes) {
    if (settings_.rate_limit == 0) return;
    const uint64_t now = MonotonicNs();
    not_before_ns_ = now + limiter_.Account(bytes, now);
  }

  io::Task<absl::Status> WriteData(uint64_t offset, io::ConstIoVec data) {
    WaitForRate();
    absl::Status st = co_await target_.Write(offset, data);
    Account(data.size());
    co_return st;
  }

  io::Task<absl::Status> WriteZeroes(uint64_t offset, uint64_t length) {
    if (settings_.rate_limit_counts_zeroes) WaitForRate();
    absl::Status st = co_await target_.WriteZeroes(
        offset, length,
        io::WriteZeroesFlags{.may_unmap = settings_.zero_writes_may_unmap});
    if (settings_.rate_limit_counts_zeroes) Account(length);
    co_return st;
  }

  io::Task<absl::Status> WriteChunk(uint64_t offset, uint64_t length,
                                    const uint8_t* buf, ChunkKind kind) {
    if (settings_.compressed_target != nullptr && kind == ChunkKind::kData &&
        (settings_.min_sparse_sectors == 0 || !IsZero(buf, length))) {
      // One cluster (or the image's last, shorter one); all-zero data is
      // treated as a zero range.
      WaitForRate();
      absl::Status st = co_await settings_.compressed_target->WriteCompressed(
          offset, io::ConstIoVec(buf, length));
      Account(length);
      co_return st;
    }
    if (settings_.compressed_target != nullptr && kind == ChunkKind::kData) {
      kind = ChunkKind::kZero;
    }
    uint64_t done = 0;
    while (done < length) {
      uint64_t n = length - done;
      if (kind == ChunkKind::kSkip) break;
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
        CO_RETURN_IF_ERROR(
            co_await WriteData(offset + done, io::ConstIoVec(buf + done, n)));
      } else if (!settings_.target_is_zero) {
        CO_RETURN_IF_ERROR(co_await WriteZeroes(offset + done, n));
      }
      done += n;
    }
    co_return absl::OkStatus();
  }

  // A compared chunk: the bytes read of the source (`buf`) and of the
  // reference (`ref`), and the ranges of each that read as zeroes without
  // being read (sorted, sector-aligned, relative to the chunk; their bytes
  // in the buffers are not set).
  struct Compared {
    uint8_t* buf = nullptr;
    uint8_t* ref = nullptr;  // null: no reference (zeroes)
    std::vector<std::pair<uint64_t, uint64_t>> buf_zero;  // [begin, end)
    std::vector<std::pair<uint64_t, uint64_t>> ref_zero;
  };

  // Whether `at` lies in one of `ranges` (walked forward with *index), and
  // where that answer ends (at most `limit`).
  static bool InZero(const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                     size_t* index, uint64_t at, uint64_t limit,
                     uint64_t* end) {
    while (*index < ranges.size() && ranges[*index].second <= at) ++*index;
    if (*index == ranges.size()) {
      *end = limit;
      return false;
    }
    const auto& r = ranges[*index];
    if (r.first <= at) {
      *end = std::min(limit, r.second);
      return true;
    }
    *end = std::min(limit, r.first);
    return false;
  }

  // Writes the sectors of the chunk at target `offset` where the source
  // differs from the reference (zeroes if there is none), chunk past the
  // source node's end if `past_source_end`: each run of differing sectors
  // (qemu-img's compare_buffers) as data or zeroes as the settings say.
  // Ranges that both read as zeroes are skipped without looking at them;
  // the source's zero ranges are zero-filled in `c.buf` only where a run
  // written as data covers them.
  io::Task<absl::Status> WriteDifferences(uint64_t offset, uint64_t length,
                                          Compared& c, bool past_source_end) {
    size_t bi = 0;
    size_t ri = 0;
    bool run_differs = false;
    uint64_t run_start = 0;
    uint64_t at = 0;
    while (at < length) {
      uint64_t buf_end = length;
      uint64_t ref_end = length;
      const bool bz = InZero(c.buf_zero, &bi, at, length, &buf_end);
      const bool rz =
          c.ref == nullptr || InZero(c.ref_zero, &ri, at, length, &ref_end);
      const uint64_t seg_end = std::min(buf_end, ref_end);
      while (at < seg_end) {
        const uint64_t n = std::min(kSectorSize, seg_end - at);
        bool differs;
        if (bz && rz) {
          differs = false;
        } else if (bz) {
          differs = !IsZero(c.ref + at, n);
        } else if (rz) {
          differs = !IsZero(c.buf + at, n);
        } else {
          differs = std::memcmp(c.buf + at, c.ref + at, n) != 0;
        }
        if (differs != run_differs) {
          if (run_differs) {
            CO_RETURN_IF_ERROR(co_await WriteRun(offset, run_start, at, c,
                                                 past_source_end));
          }
          run_differs = differs;
          run_start = at;
        }
        if (bz && rz) {
          at = seg_end;  // equal throughout
        } else {
          at += n;
        }
      }
    }
    if (run_differs) {
      CO_RETURN_IF_ERROR(
          co_await WriteRun(offset, run_start, length, c, past_source_end));
    }
    co_return absl::OkStatus();
  }

  // Writes the differing run [begin, end) of a compared chunk.
  io::Task<absl::Status> WriteRun(uint64_t offset, uint64_t begin,
                                  uint64_t end, Compared& c,
                                  bool past_source_end) {
    const uint64_t n = end - begin;
    bool zeroes;
    if (settings_.zeroes_only_past_source_end) {
      zeroes = past_source_end;
    } else {
      zeroes = !settings_.zero_ranges_as_data;
      size_t bi = 0;
      for (uint64_t at = begin; at < end && zeroes;) {
        uint64_t next = end;
        if (!InZero(c.buf_zero, &bi, at, end, &next)) {
          zeroes = IsZero(c.buf + at, next - at);
        }
        at = next;
      }
    }
    // Not a conditional over two co_awaits (GCC 12).
    absl::Status st;
    if (zeroes) {
      st = co_await WriteZeroes(offset + begin, n);
    } else {
      // The source's zero ranges in the run, as bytes.
      size_t bi = 0;
      for (uint64_t at = begin; at < end;) {
        uint64_t next = end;
        if (InZero(c.buf_zero, &bi, at, end, &next)) {
          std::memset(c.buf + at, 0, next - at);
        }
        at = next;
      }
      st = co_await WriteData(offset + begin, io::ConstIoVec(c.buf + begin, n));
    }
    if (!st.ok()) co_return WriteError(st, offset + begin);
    co_return absl::OkStatus();
  }

  static absl::Status ReadError(const absl::Status& st, uint64_t offset,
                                CopyOp op) {
    return Tagged(WithMessage(st, absl::StrCat("error while reading at byte ",
                                               offset, ": ",
                                               RequestError(st))),
                  op);
  }

  static absl::Status WriteError(const absl::Status& st, uint64_t offset) {
    return Tagged(WithMessage(st, absl::StrCat("error while writing at byte ",
                                               offset, ": ",
                                               RequestError(st))),
                  CopyOp::kWrite);
  }

  // One read of a compared chunk.
  struct Extent {
    io::BlockNode* node = nullptr;
    uint64_t offset = 0;  // in `node`
    uint64_t target_offset = 0;  // for the error message
    io::IoVec buf;
    CopyOp op = CopyOp::kRead;
  };

  // Adds the extents of `node`'s bytes [offset, offset + length) (target
  // offset `target_offset`, landing in `buf`, which maps `offset` to
  // `buf_offset` of the chunk) that its chain reports as data to
  // `extents`, and the rest to `zero` (chunk-relative; a sector partly
  // zero, partly data is zero-filled in `buf` and counts as data). The
  // copy uses `node` only below `node_end` (chunks are cut there): with no
  // node, or `offset` at or past it, the whole chunk is zeroes. Returns
  // whether the whole range reads as zeroes.
  static io::Task<absl::StatusOr<bool>> PlanReads(
      io::BlockNode* node_or_null, uint64_t offset, uint64_t node_end,
      uint64_t target_offset, uint64_t length, uint8_t* buf, CopyOp op,
      std::vector<Extent>& extents,
      std::vector<std::pair<uint64_t, uint64_t>>& zero) {
    if (node_or_null == nullptr || offset >= node_end) {
      zero.emplace_back(0, length);
      co_return true;
    }
    io::BlockNode& node = *node_or_null;
    length = std::min(length, node_end - offset);
    bool all_zero = true;
    uint64_t done = 0;
    while (done < length) {
      const uint64_t at = offset + done;
      uint64_t n = length - done;
      bool is_zero = true;
      if (at < node.size()) {
        absl::StatusOr<io::ChainStatus> chain = co_await io::GetChainStatus(
            node, at, std::min(n, node.size() - at));
        if (!chain.ok()) {
          co_return Tagged(
              WithMessage(chain.status(),
                          absl::StrCat("error while reading block status at "
                                       "offset ",
                                       at, ": ", chain.status().message())),
              op);
        }
        n = std::min(n, chain->status.length);
        is_zero = chain->status.zero || !chain->present;
      }
      if (is_zero) {
        const uint64_t begin = AlignUp(done, kSectorSize);
        const uint64_t end =
            done + n == length ? done + n : AlignDown(done + n, kSectorSize);
        if (begin < end) {
          std::memset(buf + done, 0, begin - done);
          std::memset(buf + end, 0, done + n - end);
          if (!zero.empty() && zero.back().second == begin) {
            zero.back().second = end;
          } else {
            zero.emplace_back(begin, end);
          }
        } else {
          std::memset(buf + done, 0, n);
        }
      } else if (!extents.empty() && extents.back().node == &node &&
                 extents.back().offset + extents.back().buf.size() == at) {
        all_zero = false;  // one request for adjacent data
        extents.back().buf = io::IoVec(extents.back().buf.data(),
                                       extents.back().buf.size() + n);
      } else {
        all_zero = false;
        extents.push_back(Extent{&node, at, target_offset + done,
                                 io::IoVec(buf + done, n), op});
      }
      done += n;
    }
    co_return all_zero;
  }

  // One of ReadExtents' readers: reads extents[next++] until none are left
  // or a read failed.
  static io::Task<void> ReadExtentsWorker(const std::vector<Extent>& extents,
                                          size_t& next, absl::Status& error) {
    while (error.ok() && next < extents.size()) {
      const Extent& e = extents[next++];
      absl::Status st = co_await e.node->Read(e.offset, e.buf);
      if (!st.ok() && error.ok()) error = ReadError(st, e.target_offset, e.op);
    }
  }

  // Reads every extent, kCompareReadsInFlight at a time; the first error.
  static io::Task<absl::Status> ReadExtents(
      const std::vector<Extent>& extents) {
    if (extents.size() == 1) {
      const Extent& e = extents.front();
      absl::Status st = co_await e.node->Read(e.offset, e.buf);
      if (!st.ok()) co_return ReadError(st, e.target_offset, e.op);
      co_return absl::OkStatus();
    }
    const int readers = static_cast<int>(
        std::min<size_t>(kCompareReadsInFlight, extents.size()));
    if (readers == 0) co_return absl::OkStatus();
    size_t next = 0;
    absl::Status error;
    int running = readers;
    io::Event done;
    for (int i = 0; i < readers; ++i) {
      io::Spawn(ReadExtentsWorker(extents, next, error), [&running, &done] {
        if (--running == 0) done.Set();
      });
    }
    co_await done.Wait();
    co_return error;
  }

  // Reads a compared chunk at target `offset` from the source into c.buf
  // and from the reference into c.ref (null: no reference), the ranges
  // each chain reports as zeroes left out (see Compared). *nothing: both
  // read as zeroes (so nothing differs).
  io::Task<absl::Status> ReadCompared(uint64_t offset, uint64_t length,
                                      Compared& c,
                                      std::vector<Extent>& extents,
                                      bool* nothing) {
    extents.clear();
    c.buf_zero.clear();
    c.ref_zero.clear();
    const CopySource& source = SourceAt(offset);
    CO_ASSIGN_OR_RETURN(
        const bool source_zero,
        co_await PlanReads(source.node, offset - source.start +
                                            source.node_offset,
                           source_end_, offset, length, c.buf, CopyOp::kRead,
                           extents, c.buf_zero));
    bool ref_zero = true;
    if (c.ref != nullptr) {
      CO_ASSIGN_OR_RETURN(
          ref_zero, co_await PlanReads(settings_.reference, offset,
                                       reference_end_, offset, length, c.ref,
                                       CopyOp::kReadReference, extents,
                                       c.ref_zero));
    }
    *nothing = source_zero && ref_zero;
    if (*nothing) co_return absl::OkStatus();
    co_return co_await ReadExtents(extents);
  }

  io::Task<void> Worker(int index) {
    // Not zeroed: every byte a chunk uses is read or set first, and a chunk
    // smaller than max_chunk (commit's 64 KiB granules) leaves the rest of
    // the buffer untouched, so not resident (16 workers x 1 MiB zeroed
    // were 16 MiB of commit's peak RSS).
    io::AlignedBuffer buffer = io::AlignedBuffer::Uninitialized(
        std::max(settings_.max_chunk, settings_.compressed_cluster_size));
    io::AlignedBuffer ref_buffer = io::AlignedBuffer::Uninitialized(
        settings_.reference != nullptr ? buffer.size() : 0);
    std::vector<Extent> extents;
    Compared compared_chunk;
    compared_chunk.buf = buffer.data();
    if (settings_.reference != nullptr) compared_chunk.ref = ref_buffer.data();
    for (;;) {
      io::ScopedLock lock = co_await io::ScopedLock::Take(mutex_);
      if (!error_.ok() || next_offset_ >= total_) break;
      if (stepping_ && next_offset_ % target_unit_ != 0) {
        // The writes before may allocate the target's cluster here.
        while (written_up_to_ != next_offset_ && error_.ok()) {
          co_await WaitForTurn(index, next_offset_);
        }
        if (!error_.ok()) break;
      }
      absl::StatusOr<uint64_t> chunk = co_await NextChunk(next_offset_);
      if (!chunk.ok()) {
        SetError(chunk.status());
        break;
      }
      const uint64_t chunk_offset = next_offset_;
      ChunkKind kind = status_;
      uint64_t length = *chunk;
      // Stepping: the skipped steps before the compared one.
      const uint64_t prefix = std::exchange(skip_prefix_, 0);
      if ((settings_.zero_ranges_as_data || comparing_) &&
          kind == ChunkKind::kZero) {
        length = std::min(length, settings_.max_chunk);
      }
      // Other workers may look further while this one copies.
      next_offset_ += length;
      lock.Release();
      const uint64_t chunk_end = chunk_offset + length;
      const uint64_t offset = chunk_offset + prefix;
      length -= prefix;

      if (CountsForProgress(kind) && allocated_sectors_ > 0) {
        allocated_done_ += length / kSectorSize;
        settings_.progress->Print(
            static_cast<float>(100.0 * allocated_done_ / allocated_sectors_),
            0);
      }
      bool compared = false;  // a compared chunk (its progress step)
      bool compare = false;   // ... with something to compare
      if (comparing_ && kind != ChunkKind::kSkip) {
        compared = true;
        bool nothing = false;
        absl::Status st = co_await ReadCompared(offset, length, compared_chunk,
                                                extents, &nothing);
        if (!st.ok()) SetError(std::move(st));
        compare = !nothing;
      } else if (kind == ChunkKind::kData) {
        absl::Status st = co_await ReadChunk(offset, length, buffer.data());
        if (!st.ok()) SetError(ReadError(st, offset, CopyOp::kRead));
      } else if (settings_.zero_ranges_as_data && kind == ChunkKind::kZero) {
        // -S 0 writes zero ranges as data; ranges left to the target's
        // backing file stay unallocated (qemu-img's convert_co_do_copy).
        std::memset(buffer.data(), 0, length);
        kind = ChunkKind::kData;
      }
      if (settings_.in_order) {
        while (written_up_to_ != chunk_offset && error_.ok()) {
          co_await WaitForTurn(index, chunk_offset);
        }
      }
      if (error_.ok()) {
        // Two statements, not a conditional over two co_awaits: GCC 12
        // destroys the temporaries of such an expression twice.
        absl::Status st;
        if (compare) {
          st = co_await WriteDifferences(
              offset, length, compared_chunk,
              SourceAt(offset).node == nullptr || offset >= source_end_);
        } else if (!comparing_) {
          st = co_await WriteChunk(offset, length, buffer.data(), kind);
          if (!st.ok()) st = WriteError(st, offset);
        }
        if (!st.ok()) {
          SetError(std::move(st));
        } else if (compared && settings_.progress_per_step &&
                   settings_.progress != nullptr) {
          settings_.progress->Print(step_progress_, 100);
        }
      }
      if (settings_.in_order) FinishWrite(chunk_end);
    }
  }

  // Reads target range [offset, offset + length) from the sources it
  // covers (qemu-img's convert_co_read): a compressed cluster may hold the
  // tail of one source and the start of the next ones. Bytes past a
  // source's size, up to its 512-byte rounding, read as zeroes.
  io::Task<absl::Status> ReadChunk(uint64_t offset, uint64_t length,
                                   uint8_t* buf) {
    while (length > 0) {
      const CopySource& source = SourceAt(offset);
      const uint64_t in_source = offset - source.start + source.node_offset;
      const uint64_t n =
          std::min(length, source.length - (offset - source.start));
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
  CopySettings settings_;  // in_order, skip_target_allocated as stepping_ needs
  bool stepping_ = false;    // settings_.step_by_target_allocation
  bool comparing_ = false;   // chunks are compared with the reference
  bool reference_in_source_chain_ = false;
  uint64_t source_end_ = 0;     // comparing: the source node's size, 512-aligned
  uint64_t reference_end_ = 0;  // the same for the reference
  uint64_t target_unit_ = kSectorSize;  // stepping: the target's cluster size
  float step_progress_ = 0;     // progress_per_step: percent per chunk
  uint64_t skip_prefix_ = 0;    // StepChunk's skipped bytes; under mutex_
  RateLimiter limiter_;
  uint64_t not_before_ns_ = 0;  // rate limit: no write starts before
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

}  // namespace

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

std::string RequestError(const absl::Status& status) {
  if (const int error_number = StatusErrno(status); error_number != 0) {
    return std::strerror(error_number);
  }
  return std::string(status.message());
}

RateLimiter::RateLimiter(uint64_t bytes_per_second, uint64_t slice_ns)
    : slice_ns_(slice_ns) {
  if (bytes_per_second != 0) {
    slice_quota_ = std::max<uint64_t>(
        static_cast<uint64_t>(static_cast<double>(bytes_per_second) *
                              static_cast<double>(slice_ns) / 1e9),
        1);
  }
}

uint64_t RateLimiter::Account(uint64_t bytes, uint64_t now_ns) {
  if (slice_quota_ == 0) return 0;
  if (!started_ || slice_end_ < now_ns) {
    // The previous (maybe stretched) slice is over: a new one starts.
    started_ = true;
    slice_start_ = now_ns;
    slice_end_ = now_ns + slice_ns_;
    dispatched_ = 0;
  }
  dispatched_ += bytes;
  if (dispatched_ < slice_quota_) return 0;
  // Quota used up: stretch the slice over what was dispatched in it.
  const double slices =
      static_cast<double>(dispatched_) / static_cast<double>(slice_quota_);
  slice_end_ = slice_start_ +
               static_cast<uint64_t>(slices * static_cast<double>(slice_ns_));
  return slice_end_ > now_ns ? slice_end_ - now_ns : 0;
}

CopyOp FailedOp(const absl::Status& status) {
  const auto op = status.GetPayload(kCopyOpPayload);
  if (!op.has_value() || op->size() != 1) return CopyOp::kUnknown;
  return static_cast<CopyOp>((*op)[0]);
}

io::Task<absl::Status> Copy(std::vector<CopySource> sources,
                            io::BlockNode& target,
                            const CopySettings& settings) {
  Copier copier(std::move(sources), target, settings);
  co_return co_await copier.Run();
}

}  // namespace imgtool::block
