// BlockNode: one node of a block graph (a protocol driver such as `file`, a
// filter such as `preallocate`, a format such as `qcow2`). Callers use the
// public non-virtual operations; they do the checks that every node shares
// (length overflow, read-only, the write-zeroes fallback) once, then call the
// driver's Do* override. Drivers never repeat those checks.
//
// Units: offsets and lengths are bytes. Alignment: any, unless a driver says
// otherwise (posix_file bounces unaligned O_DIRECT requests itself).
// Thread model: used from its engine's thread only.
#ifndef IMGTOOL_IO_BLOCK_NODE_H_
#define IMGTOOL_IO_BLOCK_NODE_H_

#include <coroutine>
#include <cstdint>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "io/task.h"

namespace imgtool::io {

using IoVec = absl::Span<uint8_t>;
using ConstIoVec = absl::Span<const uint8_t>;

// How a truncate that grows a node backs the new range (QEMU's
// PreallocMode for protocol nodes; qcow2 adds kMetadata).
enum class PreallocMode { kOff, kMetadata, kFalloc, kFull };

// Parses "off", "metadata", "falloc", "full". kInvalidArgument otherwise.
absl::StatusOr<PreallocMode> ParsePreallocMode(const std::string& name);
const char* PreallocModeName(PreallocMode mode);

struct WriteZeroesFlags {
  bool may_unmap = false;    // the range may be deallocated (punch a hole)
  bool no_fallback = false;  // fail with kUnimplemented rather than write zeroes
};

// The state of a range, from one node's point of view (QEMU's
// BDRV_BLOCK_DATA / ZERO / OFFSET_VALID).
struct BlockStatus {
  uint64_t length = 0;         // bytes from the queried offset with this state
  bool data = false;           // allocated at this layer
  bool zero = false;           // reads as zeroes
  bool offset_valid = false;   // host_offset means something
  uint64_t host_offset = 0;    // where the range's bytes are in `file`
  const class BlockNode* file = nullptr;  // node holding the bytes, if any
};

// The debug events of QEMU 7.2's blkdebug (qapi/block-core.json,
// BlkdebugEvent; the same names and order): points in a driver's work where
// a blkdebug node below can inject errors, change state or suspend the
// request. Raised with BlockNode::DebugEvent.
enum class BlkdebugEvent : int {
  kL1Update,
  kL1GrowAllocTable,
  kL1GrowWriteTable,
  kL1GrowActivateTable,
  kL2Load,
  kL2Update,
  kL2UpdateCompressed,
  kL2AllocCowRead,
  kL2AllocWrite,
  kReadAio,
  kReadBackingAio,
  kReadCompressed,
  kWriteAio,
  kWriteCompressed,
  kVmstateLoad,
  kVmstateSave,
  kCowRead,
  kCowWrite,
  kReftableLoad,
  kReftableGrow,
  kReftableUpdate,
  kRefblockLoad,
  kRefblockUpdate,
  kRefblockUpdatePart,
  kRefblockAlloc,
  kRefblockAllocHookup,
  kRefblockAllocWrite,
  kRefblockAllocWriteBlocks,
  kRefblockAllocWriteTable,
  kRefblockAllocSwitchTable,
  kClusterAlloc,
  kClusterAllocBytes,
  kClusterFree,
  kFlushToOs,
  kFlushToDisk,
  kPwritevRmwHead,
  kPwritevRmwAfterHead,
  kPwritevRmwTail,
  kPwritevRmwAfterTail,
  kPwritev,
  kPwritevZero,
  kPwritevDone,
  kEmptyImagePrepare,
  kL1ShrinkWriteTable,
  kL1ShrinkFreeL2Clusters,
  kCorWrite,
  kClusterAllocSpace,
  kNone,
};
inline constexpr int kBlkdebugEventCount =
    static_cast<int>(BlkdebugEvent::kNone) + 1;

// QEMU's name of `event` ("l1_update", "l1_grow_alloc_table",
// "refblock_alloc_write", ...: the QAPI names, with '_' where QEMU 2.x's
// config files had '.').
absl::string_view BlkdebugEventName(BlkdebugEvent event);
// The event named `name` (exactly one of the names above), or nullopt.
std::optional<BlkdebugEvent> ParseBlkdebugEvent(absl::string_view name);

// What BlockNode::DebugEvent returns: co_await it. Ready at once (no
// coroutine frame) when the node does not handle debug events.
class [[nodiscard]] DebugEventAwaitable {
 public:
  DebugEventAwaitable() = default;
  explicit DebugEventAwaitable(Task<void> task) : task_(std::move(task)) {}
  bool await_ready() const noexcept { return !task_.has_value(); }
  bool await_suspend(std::coroutine_handle<> awaiting) noexcept {
    return task_->await_suspend(awaiting);
  }
  void await_resume() {}

 private:
  std::optional<Task<void>> task_;
};

class BlockNode {
 public:
  virtual ~BlockNode() = default;

  // Name of the image as given by the user (used in every error message).
  const std::string& filename() const { return filename_; }
  bool read_only() const { return read_only_; }

  // Length of the node in bytes.
  virtual uint64_t size() const = 0;

  // Reads buf.size() bytes at `offset`. Bytes past size() read as zeroes.
  // Errors: kOutOfRange if offset + length overflows; I/O errors from the
  // driver.
  Task<absl::Status> Read(uint64_t offset, IoVec buf);

  // Writes `data` at `offset`. kFailedPrecondition on a read-only node,
  // kOutOfRange on overflow. Raises the debug events pwritev before and
  // pwritev_done after the driver's write on this node (block/io.c).
  Task<absl::Status> Write(uint64_t offset, ConstIoVec data);

  // Makes [offset, offset + length) read as zeroes. If the driver has no
  // efficient way (kUnimplemented) and !flags.no_fallback, writes zero
  // buffers of at most 1 MiB instead. Raises pwritev_zero and pwritev_done
  // on this node.
  Task<absl::Status> WriteZeroes(uint64_t offset, uint64_t length,
                                 WriteZeroesFlags flags);

  // Hints that the range is unused; it may read back as anything the driver
  // documents (zeroes for files that punch holes). kUnimplemented is not an
  // error to callers: discard is advisory.
  Task<absl::Status> Discard(uint64_t offset, uint64_t length);

  // Makes completed writes durable (fdatasync for files). Raises
  // flush_to_os on primary_child() first, and flush_to_disk there too if
  // this node was written since its last successful flush (bdrv_co_flush's
  // write_gen/flushed_gen).
  Task<absl::Status> Flush();

  // Sets the length to `size`. Growing backs the new range per `prealloc`;
  // shrinking with prealloc != kOff is kInvalidArgument.
  Task<absl::Status> Truncate(uint64_t size, PreallocMode prealloc);

  // State of the range starting at `offset` (< size()), for at most
  // `max_length` bytes (the answer's length is in 1..max_length).
  Task<absl::StatusOr<BlockStatus>> GetBlockStatus(uint64_t offset,
                                                   uint64_t max_length);

  // Bytes the node occupies on its storage ("disk size"), if known.
  virtual absl::StatusOr<uint64_t> AllocatedSize() const {
    return absl::UnimplementedError("allocated size unknown");
  }

  // The directory that relative backing file names of an image stored on
  // this node are resolved against (QEMU 7.2's bdrv_dirname): "" or a path
  // ending in '/'. Default: primary_child()'s if there is one, else the
  // part of filename() up to and including its last '/'. A node that has
  // no directory (quorum: its children may lie in several) overrides this
  // to fail; kInvalidArgument "Cannot generate a base directory for quorum
  // nodes" (QEMU's text).
  virtual absl::StatusOr<std::string> Dirname() const;

  // The backing node whose data shows through where this node has none
  // (qcow2's backing file), or null. Not owned by the caller.
  virtual BlockNode* backing() const { return nullptr; }

  // Flushes what needs flushing and releases the node's resources. Errors
  // are returned here, never hidden in a destructor.
  virtual Task<absl::Status> Close() = 0;

  // --- Debug events and breakpoints (QEMU's bdrv_debug_*; blkdebug) ---
  //
  // A driver raises an event on the node it is about to do I/O on, as QEMU's
  // BLKDBG_EVENT(child, event): the qcow2 driver on its `file` child before
  // it writes an L2 table there (`co_await file().DebugEvent(
  // BlkdebugEvent::kL2Update)`), io on the node a request is written to.
  // Only a node that handles debug events (HandlesDebugEvents(): blkdebug)
  // acts on it: an inject-error rule arms itself so that the node's next
  // matching request fails, a set-state rule changes its state, a
  // breakpoint suspends the calling coroutine until DebugResume. Every other
  // node ignores it, without looking at its children, exactly as QEMU 7.2's
  // bdrv_debug_event does (so an event raised on a qcow2 node over blkdebug
  // is not seen by the blkdebug node; only the events qcow2 raises on its
  // file are). Never fails.
  DebugEventAwaitable DebugEvent(BlkdebugEvent event) {
    if (!HandlesDebugEvents()) return DebugEventAwaitable();
    return DebugEventAwaitable(DoDebugEvent(event));
  }

  // The breakpoint operations of qemu-io's break, remove_break, resume and
  // wait_break (QEMU's bdrv_debug_breakpoint/_remove_breakpoint/_resume/
  // _is_suspended). Each acts on the first node that handles debug events
  // going down from this one through primary_child() (QEMU's
  // bdrv_find_debug_node); if there is none, the first three return
  // kUnimplemented "Operation not supported" and DebugIsSuspended false.
  // Error messages are exactly strerror's text (qemu-io prints "Could not
  // set breakpoint: <message>"), and StatusErrno() gives the errno.
  //
  // Sets a one-shot breakpoint: the next request that raises `event` on the
  // debug node is suspended under `tag` (blkdebug prints "blkdebug:
  // Suspended request '<tag>'"). kNotFound "No such file or directory" if
  // `event` is not an event name (ParseBlkdebugEvent).
  absl::Status DebugBreakpoint(absl::string_view event, absl::string_view tag);
  // Removes every breakpoint with `tag` and resumes every request suspended
  // under it. kNotFound "No such file or directory" if no breakpoint was
  // removed, even if requests were resumed (as QEMU 7.2's blkdebug).
  absl::Status DebugRemoveBreakpoint(absl::string_view tag);
  // Resumes one request suspended under `tag` (it runs until its next
  // suspension before this returns). kNotFound "No such file or directory"
  // if none is.
  absl::Status DebugResume(absl::string_view tag);
  // Whether a request is suspended under `tag`.
  bool DebugIsSuspended(absl::string_view tag);

  // The child that breakpoint operations go down to when this node does not
  // handle them (QEMU's bdrv_primary_bs): a filter's filtered child, a
  // format's `file`; null for protocol nodes (the default). A filter or
  // format driver overrides only this. Not owned by the caller.
  virtual BlockNode* primary_child() const { return nullptr; }

  // The child a filter passes requests to (QEMU's bdrv_filter_bs for
  // drivers with is_filter: preallocate, copy-on-read, blkdebug, compress); null for
  // formats and protocols (the default). A backing chain is looked for
  // through filters (io/chain_status.h), as QEMU's bdrv_cow_bs of
  // bdrv_skip_filters. Not owned by the caller.
  virtual BlockNode* filtered_child() const { return nullptr; }

  // Whether this node acts on debug events and breakpoints (blkdebug
  // returns true; every other driver false). Raising events on a node that
  // does not is free.
  virtual bool HandlesDebugEvents() const { return false; }

 protected:
  // A driver that handles debug events overrides the five Do* below and
  // HandlesDebugEvents; the defaults handle nothing.
  // Whether DoWrite raises pwritev and pwritev_done itself (blkdebug: after
  // its read-modify-write of an unaligned request and its wait for
  // overlapping requests, where block/io.c's bdrv_aligned_pwritev raises
  // them). Otherwise Write raises them around DoWrite.
  virtual bool RaisesWriteEvents() const { return false; }
  virtual Task<void> DoDebugEvent(BlkdebugEvent event);
  // `event` already parsed. Errors as the public functions.
  virtual absl::Status DoDebugBreakpoint(BlkdebugEvent event,
                                         absl::string_view tag);
  virtual absl::Status DoDebugRemoveBreakpoint(absl::string_view tag);
  virtual absl::Status DoDebugResume(absl::string_view tag);
  virtual bool DoDebugIsSuspended(absl::string_view tag);

  BlockNode(std::string filename, bool read_only)
      : filename_(std::move(filename)), read_only_(read_only) {}

  // Whether a write, zero write, discard or truncate of this node finished
  // (with any outcome) since the start of its last successful Flush (QEMU's
  // write_gen != flushed_gen). A driver whose flush has nothing to do
  // otherwise (blkdebug's rule check) looks at it in DoFlush.
  bool WrittenSinceFlush() const {
    return write_generation_ != flushed_generation_;
  }

  virtual Task<absl::Status> DoRead(uint64_t offset, IoVec buf) = 0;
  virtual Task<absl::Status> DoWrite(uint64_t offset, ConstIoVec data) = 0;
  virtual Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                           WriteZeroesFlags flags);
  virtual Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length);
  virtual Task<absl::Status> DoFlush() = 0;
  virtual Task<absl::Status> DoTruncate(uint64_t size, PreallocMode prealloc);
  virtual Task<absl::StatusOr<BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) = 0;

 private:
  // The node breakpoint operations act on (see DebugBreakpoint), or null.
  BlockNode* FindDebugNode();

  std::string filename_;
  bool read_only_;
  uint64_t write_generation_ = 0;    // write-type requests finished
  uint64_t flushed_generation_ = 0;  // write_generation_ at the last flush
};

}  // namespace imgtool::io

#endif  // IMGTOOL_IO_BLOCK_NODE_H_
