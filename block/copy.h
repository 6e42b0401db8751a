// The copy engine of the commands that move data from images into an image:
// convert (qemu-img's convert_do_copy), commit (QEMU's active commit, the
// mirror job qemu-img commit runs), dd and rebase's safe mode. Block status
// decides what is read: a source range is data (read, maybe scanned for
// zeroes, written), zero (never read; written as zeroes unless the target
// reads as zeroes already) or skipped (left to the target as it is). Up to
// `num_workers` coroutines copy chunks, writing in order unless !in_order,
// optionally throttled to a rate, with qemu-img's progress records.
//
// Units: offsets and lengths are bytes. Source lengths and the chunking are
// in whole 512-byte sectors, as QEMU counts them: a source's `length` is its
// node's size rounded up to 512, and the bytes past node->size() read as
// zeroes. Alignment: the target takes any request the sectors give
// (BlockNode bounces what its file needs); `granularity` and compressed
// clusters align chunks further where set.
//
// Errors: the first failed request stops the copy (the workers finish the
// requests they have in flight first) and is returned as qemu-img words it:
// "error while reading at byte N: <strerror>" or "error while writing at
// byte N: <strerror>" (N the chunk's target offset; strerror of the
// request's errno, or the message of an error without one), "error while
// reading block status at offset N: <message>" (N the offset in the
// source). The status code and payloads (the errno) are the failed
// request's, so RequestError() of the returned status is its strerror.
//
// Ownership: the engine owns nothing; sources, reference, target,
// compressed_target and progress must outlive the copy.
// Thread model: one coroutine task on the engine thread of every node
// involved (they share one engine); the rate limit's waits block that
// thread (see RateLimiter), which has nothing else to do meanwhile.
#ifndef IMGTOOL_BLOCK_COPY_H_
#define IMGTOOL_BLOCK_COPY_H_

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "block/progress.h"
#include "io/block_node.h"
#include "io/task.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::block {

inline constexpr uint64_t kSectorSize = 512;
// qemu-img convert's IO_BUF_SIZE: the largest data chunk one worker copies.
inline constexpr uint64_t kConvertChunkSize = 2 << 20;
// The mirror job's largest data request (MAX_IO_BYTES): commit's chunk.
inline constexpr uint64_t kMirrorChunkSize = 1 << 20;

// Which layers of a source's backing chain decide what is copied.
enum class SourceView {
  // The whole chain (convert, rebase -b "", dd): data in any layer is read;
  // ranges that read as zeroes (zero clusters, holes, allocated nowhere)
  // are zero ranges.
  kWholeChain,
  // The top node only (convert -B, whose target's backing file provides
  // what the source's backing chain did): ranges the top does not allocate
  // are skipped, except where it has no backing file or the range lies
  // past its backing file's end (zero ranges then, as QEMU's block status).
  kTopOnly,
  // The layers above `base` (commit): a range no layer from `node` down to
  // (not including) `base` allocates is skipped; the rest is copied as the
  // whole chain reads it, in `granularity` pieces the way QEMU's mirror job
  // does (see CopySettings::granularity).
  kAboveBase,
};

// One source: the bytes [start, start + length) of the target come from
// `node`'s bytes [node_offset, node_offset + length). Several sources are
// concatenated (convert).
struct CopySource {
  // Not owned; null only with step_by_target_allocation (reads zeroes).
  io::BlockNode* node = nullptr;
  uint64_t start = 0;             // target offset of its first byte
  uint64_t length = 0;            // bytes; past node->size() reads zeroes
  SourceView view = SourceView::kWholeChain;
  // kAboveBase: a node of node's backing chain (not `node` itself), or null
  // for "above nothing" (every layer counts).
  const io::BlockNode* base = nullptr;
  // Where in `node` the copy starts (dd's skip), a multiple of 512; 0 for
  // kAboveBase.
  uint64_t node_offset = 0;
};

struct CopySettings {
  // Zero detection inside data (convert -S): data chunks are scanned in
  // 512-byte sectors and runs of at least this many zero sectors are
  // written as zeroes (or skipped on a target that reads as zeroes);
  // shorter runs are written with the data around them. 0: data is written
  // as read.
  uint64_t min_sparse_sectors = 8;
  // A power of two: zero runs found in data start and end on multiples of
  // this many sectors (qemu-img: the largest power of two <= -S).
  uint64_t alignment_sectors = 8;
  // Zero ranges are written as zero-filled data (convert -S 0, dd), and
  // count for the progress.
  bool zero_ranges_as_data = false;
  // The target reads as zeroes (new file, --target-is-zero): zero ranges
  // are skipped rather than written.
  bool target_is_zero = false;
  // Zero ranges written as zeroes may be unmapped (deallocated) on the
  // target (QEMU's BDRV_REQ_MAY_UNMAP; convert and commit both do).
  bool zero_writes_may_unmap = true;
  // Zero ranges count for the progress even when not written as data
  // (commit: the mirror job counts every byte it processes).
  bool progress_counts_zero_ranges = false;
  bool in_order = true;       // writes in target order (convert without -W)
  int num_workers = 8;        // requests in flight (-m)
  uint64_t max_chunk = kConvertChunkSize;  // largest data chunk, bytes
  // kAboveBase sources (QEMU's mirror): ranges are taken in whole
  // granules of this many bytes (a power of two, >= 512): a granule is
  // copied if a layer above base allocates any byte of it; a run of whole
  // granules that the chain reads as zeroes and that starts and ends on a
  // multiple of `target_cluster_size` is written as zeroes, anything else
  // (data, or zeroes mixed with data inside a granule) is read and written
  // as data. 0 for the other views.
  uint64_t granularity = 0;
  uint64_t target_cluster_size = 0;  // 0 or 1: no alignment needed
  // convert -C: no zero detection in data.
  bool copy_whole_chunks = false;
  // convert -c: whole target clusters of this many bytes are written
  // compressed (through `compressed_target`); 0 = no compression.
  uint64_t compressed_cluster_size = 0;
  qcow2::Qcow2Node* compressed_target = nullptr;
  // A new target with a backing file: that file's length in bytes. Zeroes
  // past it need no writing (the target reads zeroes there).
  std::optional<uint64_t> target_backing_end;
  // Bytes per second written to the target (-r); 0 = unlimited. See
  // RateLimiter. Zero writes count unless !rate_limit_counts_zeroes
  // (QEMU's mirror job, behind commit, counts only the data it copies).
  uint64_t rate_limit = 0;
  bool rate_limit_counts_zeroes = true;

  // Comparing with a reference (rebase's safe mode), for one source of
  // view kWholeChain:
  //  - `reference`: what the target would read without the copy (the new
  //    backing chain, read through its whole chain; bytes past its size
  //    read as zeroes). A chunk is written only where it differs from the
  //    reference, compared in 512-byte sectors: the extents that each
  //    chain reports as zeroes (holes, zero clusters, allocated nowhere,
  //    past its end) are taken as zeroes without reading; the others are
  //    read, up to 16 requests at once per chunk over both chains (buffers
  //    of 2 * max_chunk bytes per worker with a reference). Each run
  //    of differing sectors is written as data or (all-zero runs, unless
  //    zero_ranges_as_data) as zeroes. When the reference is a node of the
  //    source's backing chain, ranges no layer of the source above it
  //    allocates read the same through both and are skipped unread.
  //  - `skip_target_allocated`: ranges that the target's own (top) layer
  //    allocates, as data or as zeroes, are skipped without reading
  //    anything (the overlay's own data wins over any backing file). Asked
  //    as QEMU's bdrv_is_allocated does (qcow2: GetAllocationStatus, which
  //    does not cut data at the file's holes under preallocated metadata).
  io::BlockNode* reference = nullptr;
  bool skip_target_allocated = false;

  // qemu-img 7.2 rebase's walk (its safe mode and -b ""), so that the
  // target's clusters are allocated in the same order and -p prints the
  // same records; implies comparing (with zeroes when `reference` is null),
  // in-order writes and skip_target_allocated. The source's node may be
  // null (no old backing file: it reads as zeroes). Chunks are steps of at
  // most max_chunk bytes from the start, cut where the target's own
  // allocation changes (bdrv_is_allocated), where allocation above the
  // reference changes (reference in the source's chain) and at the ends
  // of the source and reference nodes (their sizes rounded up to 512
  // bytes). A step that starts inside a target cluster (target_cluster_size
  // if set, else a qcow2 target's cluster size) is looked up only once the
  // writes before it are done: they may have allocated that cluster, which
  // the step then skips, as in qemu-img.
  bool step_by_target_allocation = false;
  // Progress without a counting pass: each compared chunk, once written,
  // adds 100 / (total / min(total, max_chunk)) percent, whether it wrote
  // anything or not (qemu-img rebase's local_progress).
  bool progress_per_step = false;
  // Comparing: differing runs are written as data, all-zero ones too,
  // except in chunks past the end of the source node, which are written
  // as zeroes (qemu-img rebase's buf_old_is_zero).
  bool zeroes_only_past_source_end = false;

  // So `rebase -b NEW OVERLAY`: sources = {{old backing node or null, 0,
  // overlay length, kWholeChain}}, reference = the new backing node (null
  // with -b ""), target = the overlay, step_by_target_allocation,
  // progress_per_step and zeroes_only_past_source_end set,
  // zero_writes_may_unmap false, max_chunk 2 MiB; then rewrite the header
  // once Copy() has returned ok and the target is flushed.

  // Progress records (block/progress.h), or null: the bytes to write are
  // counted first (one block status pass), then each chunk taken adds its
  // share. The caller prints the 0 and 100 records and ends the line.
  Progress* progress = nullptr;
};

// What a failed copy was doing, for callers that word its errors their own
// way (rebase): kBlockStatus (block status asked to pick the chunks),
// kRead (the sources, block status of a compared chunk included),
// kReadReference, kWrite; kUnknown for other statuses.
enum class CopyOp : char {
  kUnknown = 0,
  kBlockStatus = 'b',
  kRead = 'r',
  kReadReference = 'f',
  kWrite = 'w',
};
CopyOp FailedOp(const absl::Status& status);

// Copies the sources into `target` as `settings` say. Errors: see the file
// comment. With a compressed target, ends with its compressed write of 0
// bytes (qemu-img's padding of the file to a sector).
io::Task<absl::Status> Copy(std::vector<CopySource> sources,
                            io::BlockNode& target,
                            const CopySettings& settings);

// QEMU's rate limit (include/qemu/ratelimit.h, used by block jobs with
// 100 ms slices): time runs in slices of `slice_ns`, each allowing
// speed * slice / 1 s bytes (at least 1). Account(n) counts a request of n
// bytes and returns 0 while the current slice's quota is not used up; once
// it is, it returns how long to wait (ns) until the slice, stretched to
// cover everything dispatched in it, ends; a request after that starts a
// new slice. The copy counts each write when it is done and makes the next
// write wait for that delay (as QEMU's jobs sleep before their next
// request, and convert's throttling lets a request go and delays the next):
// the first writes of a copy go at once, then it runs at `speed` bytes/s
// on average over each slice; the wait blocks the engine thread, with the
// requests already submitted still running in the kernel.
// Not thread-safe.
class RateLimiter {
 public:
  static constexpr uint64_t kDefaultSliceNs = 100'000'000;
  // `bytes_per_second` 0: no limit (Account always returns 0).
  explicit RateLimiter(uint64_t bytes_per_second,
                       uint64_t slice_ns = kDefaultSliceNs);
  // `now_ns`: a monotonic clock (CLOCK_MONOTONIC in the copy).
  uint64_t Account(uint64_t bytes, uint64_t now_ns);

 private:
  uint64_t slice_ns_;
  uint64_t slice_quota_ = 0;
  uint64_t slice_start_ = 0;
  uint64_t slice_end_ = 0;
  uint64_t dispatched_ = 0;
  bool started_ = false;
};

// The leading run of sectors in `buf` (`sectors` sectors, the first one
// being target sector `first_sector`) that are all zero or all non-zero.
// A run that stops before the end of the buffer is made to end on a
// multiple of `alignment` sectors (a power of two): a data run is extended,
// a zero run cut back, and a zero run too short to survive the cut counts
// as data (its sectors would be rewritten with the data next to them).
struct SectorRun {
  bool data = false;  // false: every byte is zero
  uint64_t sectors = 0;
};
SectorRun LeadingRun(const uint8_t* buf, uint64_t sectors,
                     uint64_t first_sector, uint64_t alignment);

// Splits the start of a data buffer into what must be written and what can
// stay a hole: the first run if it is zero, else the data up to the first
// zero run of at least `min_zero` sectors (shorter zero runs are written
// with the data around them, so requests are not broken up for small gaps).
SectorRun DataOrHole(const uint8_t* buf, uint64_t sectors,
                     uint64_t first_sector, uint64_t min_zero,
                     uint64_t alignment);

// What qemu-img prints after "error while reading/writing at byte N: ":
// strerror of the request's errno, not the file layer's message naming the
// file and the syscall ("dst.qcow2: pwritev: No space left on device");
// messages without an errno stay as they are.
std::string RequestError(const absl::Status& status);

}  // namespace imgtool::block

#endif  // IMGTOOL_BLOCK_COPY_H_
