#include "block/copy.h"

#include <time.h>

#include <algorithm>
#include <climits>
#include <coroutine>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "io/aligned_buffer.h"
#include "io/chain_status.h"
#include "io/sync.h"

namespace imgtool::block {
namespace {

// The largest single request (QEMU's BDRV_REQUEST_MAX_BYTES).
constexpr uint64_t kMaxRequest = static_cast<uint64_t>(INT_MAX) & ~511ull;

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
  }

  // Counts the bytes to write so the progress can be shown as a fraction of
  // them, then copies.
  io::Task<absl::Status> Run() {
    if (settings_.progress != nullptr) {
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
            co_await StatusOrError(target_, offset,
                                   std::min(n, target_.size() - offset)));
        if (own.data || own.zero) {
          n = AlignUp(own.length, kSectorSize);
          status_ = ChunkKind::kSkip;
          next_status_end_ = offset + n;
          co_return n;
        }
        n = std::min(n, own.length);
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

  static absl::Status BlockStatusError(const absl::Status& st,
                                       uint64_t offset) {
    return WithMessage(st, absl::StrCat("error while reading block status at "
                                        "offset ",
                                        offset, ": ", st.message()));
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
    uint64_t n = length;
    for (io::BlockNode* layer = source.node;
         layer != nullptr && layer != source.base; layer = layer->backing()) {
      if (offset >= layer->size()) continue;
      CO_ASSIGN_OR_RETURN(
          io::BlockStatus st,
          co_await StatusOrError(*layer, offset,
                                 std::min(length, layer->size() - offset)));
      if (st.data || st.zero) co_return std::make_pair(true, st.length);
      // Unallocated up to the layer's end: the rest of it is too.
      if (layer == source.node || offset + st.length < layer->size()) {
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

  // Writes the sectors of `buf` that differ from `ref` (rebase's safe
  // mode): runs of differing sectors, as data or (all-zero runs, unless
  // zero_ranges_as_data) as zeroes.
  io::Task<absl::Status> WriteDifferences(uint64_t offset, uint64_t length,
                                          const uint8_t* buf,
                                          const uint8_t* ref) {
    uint64_t done = 0;
    while (done < length) {
      const auto same = [&](uint64_t at) {
        const uint64_t n = std::min(kSectorSize, length - at);
        return std::memcmp(buf + at, ref + at, n) == 0;
      };
      const bool equal = same(done);
      uint64_t n = kSectorSize;
      while (done + n < length && same(done + n) == equal) n += kSectorSize;
      n = std::min(n, length - done);
      if (!equal) {
        if (!settings_.zero_ranges_as_data && IsZero(buf + done, n)) {
          CO_RETURN_IF_ERROR(co_await WriteZeroes(offset + done, n));
        } else {
          CO_RETURN_IF_ERROR(co_await WriteData(
              offset + done, io::ConstIoVec(buf + done, n)));
        }
      }
      done += n;
    }
    co_return absl::OkStatus();
  }

  // With a reference: whether the reference chain reads zeroes over the
  // whole range (then a zero chunk needs nothing).
  io::Task<absl::StatusOr<bool>> ReferenceIsZero(uint64_t offset,
                                                 uint64_t length) {
    io::BlockNode& ref = *settings_.reference;
    const uint64_t end = offset + length;
    while (offset < end && offset < ref.size()) {
      absl::StatusOr<io::ChainStatus> chain = co_await io::GetChainStatus(
          ref, offset, std::min(end, ref.size()) - offset);
      if (!chain.ok()) co_return BlockStatusError(chain.status(), offset);
      if (!chain->status.zero) co_return false;
      offset += chain->status.length;
    }
    co_return true;
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
      if ((settings_.zero_ranges_as_data || settings_.reference != nullptr) &&
          kind == ChunkKind::kZero) {
        length = std::min(length, settings_.max_chunk);
      }
      // Other workers may look further while this one copies.
      next_offset_ += length;
      lock.Release();

      if (CountsForProgress(kind) && allocated_sectors_ > 0) {
        allocated_done_ += length / kSectorSize;
        settings_.progress->Print(
            static_cast<float>(100.0 * allocated_done_ / allocated_sectors_),
            0);
      }
      bool compare = false;
      if (settings_.reference != nullptr && kind != ChunkKind::kSkip) {
        // Rebase: what the reference reads decides what is written.
        absl::StatusOr<bool> ref_zero = true;
        if (kind == ChunkKind::kZero) {
          ref_zero = co_await ReferenceIsZero(offset, length);
        }
        if (!ref_zero.ok()) {
          SetError(ref_zero.status());
        } else if (kind == ChunkKind::kZero && *ref_zero) {
          kind = ChunkKind::kSkip;
        } else {
          absl::Status st = co_await settings_.reference->Read(
              offset, io::IoVec(ref_buffer.data(), length));
          if (!st.ok()) {
            SetError(WithMessage(st, absl::StrCat("error while reading at byte ",
                                                  offset, ": ",
                                                  RequestError(st))));
          }
          if (kind == ChunkKind::kZero) std::memset(buffer.data(), 0, length);
          compare = true;
        }
      }
      if (kind == ChunkKind::kData) {
        absl::Status st = co_await ReadChunk(offset, length, buffer.data());
        if (!st.ok()) {
          SetError(WithMessage(st, absl::StrCat("error while reading at byte ",
                                                offset, ": ",
                                                RequestError(st))));
        }
      } else if (settings_.zero_ranges_as_data && kind == ChunkKind::kZero &&
                 !compare) {
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
        // Two statements, not a conditional over two co_awaits: GCC 12
        // destroys the temporaries of such an expression twice.
        absl::Status st;
        if (compare) {
          st = co_await WriteDifferences(offset, length, buffer.data(),
                                         ref_buffer.data());
        } else {
          st = co_await WriteChunk(offset, length, buffer.data(), kind);
        }
        if (!st.ok()) {
          SetError(WithMessage(st, absl::StrCat("error while writing at byte ",
                                                offset, ": ",
                                                RequestError(st))));
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
  const CopySettings settings_;
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

io::Task<absl::Status> Copy(std::vector<CopySource> sources,
                            io::BlockNode& target,
                            const CopySettings& settings) {
  Copier copier(std::move(sources), target, settings);
  co_return co_await copier.Run();
}

}  // namespace imgtool::block
