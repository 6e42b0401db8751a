// The `blkdebug` filter driver (QEMU 7.2's block/blkdebug.c and
// docs/devel/blkdebug.txt, for the semantics): sits over an image (its child
// is called `image`) and injects errors into the requests passed to it, at
// points a driver above names by raising debug events on it
// (io::BlockNode::DebugEvent; the qcow2 driver raises them on its `file`).
//
// Rules. An inject-error rule names an event; when that event is raised
// (and the node's state matches the rule's, if the rule names one), the
// rule is armed: every rule the event arms replaces the rules armed before
// (QEMU's active_rules). Each later request through the node (read, write,
// zero write, discard, flush, block status) is checked against the armed
// rules, the first armed by the event coming first: the first rule whose
// iotype matches the request (default: all but block-status) and whose
// sector, if set, lies in the request fails it with the rule's errno
// (default EIO). A `once` rule is deleted when it fails a request; another
// stays armed until an event arms other rules. A set-state rule moves the
// node's state (1 at open) to new_state when its event is raised in its
// state. A breakpoint (DebugBreakpoint; qemu-io's `break`) suspends the
// request that raises its event, once, under a tag, printing "blkdebug:
// Suspended request '<tag>'" on the message stream; DebugResume prints
// "blkdebug: Resuming request '<tag>'" and lets it go on. The event `none`
// is raised once when the node opens. `immediately` is accepted and changes
// nothing (in QEMU it only decides whether the failure waits a turn of the
// event loop).
//
// Limits. `align` (a power of two) makes the node serve only aligned
// requests: the rest are widened (reads) or read-modify-written (writes;
// the events pwritev_rmw_head/_after_head/_tail/_after_tail are raised on
// this node around the reads, as QEMU's block layer does). `max-transfer`
// cuts reads and writes, `opt-write-zero`/`max-write-zero` and
// `opt-discard`/`max-discard` cut zero writes and discards; the parts of a
// zero write smaller than max(align, opt-write-zero) are written as zero
// buffers, the parts of a discard smaller than align are dropped. Each piece
// is checked against the rules separately. pwritev_zero is raised before
// each zero write (by io::BlockNode); pwritev and pwritev_done around each
// write, after its read-modify-write (by this node, as block/io.c).
//
// Serialisation (block/io.c's tracked requests): a read-modify-write is
// serialising over its aligned range: it waits before its reads until no
// overlapping request is in flight, and every read or write that overlaps
// it waits until it ends, so that no write falls between its reads and its
// write.
//
// Size: the image's length rounded up to 512 bytes (QEMU's sector count).
// Units: bytes. Thread model: like every node, used from its engine's
// thread only.
#ifndef IMGTOOL_BLKDEBUG_BLKDEBUG_H_
#define IMGTOOL_BLKDEBUG_BLKDEBUG_H_

#include <cstdint>
#include <list>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/options.h"
#include "blkdebug/blkdebug_options.pb.h"
#include "io/block_node.h"
#include "io/sync.h"
#include "io/task.h"

namespace imgtool::blkdebug {

// QEMU's BlkdebugIOType (qapi/block-core.json), the `iotype` of a rule.
enum class IoType { kRead, kWrite, kWriteZeroes, kDiscard, kFlush, kBlockStatus };

// One rule of a blkdebug node.
struct Rule {
  enum class Action { kInjectError, kSetState, kSuspend };
  Action action = Action::kInjectError;
  io::BlkdebugEvent event = io::BlkdebugEvent::kNone;
  int state = 0;  // the state the rule acts in; 0: any
  // inject-error: which request types fail (bit 1 << IoType), the errno
  // (0: the rule matches but fails nothing), `once`, `immediately`, and the
  // byte offset (sector * 512) that a failing request must contain (-1:
  // any request).
  uint64_t iotype_mask = 0;
  int error = 0;
  bool once = false;
  bool immediately = false;
  int64_t offset = -1;
  // set-state: the state the node moves to.
  int new_state = 0;
  // suspend (a breakpoint): its tag.
  std::string tag;
};

// The rules of a config file (QEMU's qemu_config_parse syntax: `[group]`
// lines, `key = "value"` lines, `#` comment lines and empty lines; groups
// inject-error and set-state), in file order: every [inject-error] section,
// then every [set-state] one, as QEMU adds them. Errors (kInvalidArgument
// unless said otherwise), QEMU 7.2's texts:
//   Could not read blkdebug config file: <strerror>   (kNotFound, ...)
//   no group defined / parse error / There is no option group 'foo'
//   Invalid parameter 'foo'                  (a key the section lacks)
//   Missing event name for rule
//   invalid parameter value: <value>         (event, iotype)
//   Parameter 'errno' expects a number       (errno, sector, state, ...)
//   Parameter 'once' expects 'on' or 'off'   (once, immediately)
absl::StatusOr<std::vector<Rule>> ParseConfigFile(const std::string& path);

// The rules given as options of the node: its `inject-error` and
// `set-state` children, each either a list (inject-error.0.event=...,
// inject-error.1.event=..., in index order) or one rule
// (inject-error.event=...). Same errors as ParseConfigFile's.
absl::StatusOr<std::vector<Rule>> RulesFromOptions(const NodeOptions& node);

// blkdebug's filename syntax (QEMU's bdrv_parse_filename for blkdebug):
// "blkdebug:CONFIG:IMAGE" (CONFIG may be empty: "blkdebug::IMAGE") sets
// `config` (if not empty) and image.filename (IMAGE up to the end: it may
// hold more colons) in `node`. kInvalidArgument "blkdebug requires both
// config file and image path" without the second colon.
absl::Status ParseBlkdebugFilename(absl::string_view filename,
                                   NodeOptions* node);

// Checks the limits against the image's request alignment (1 unless the
// image needs more), with QEMU's texts (kInvalidArgument): "Cannot meet
// constraints with align N" (not a power of two below 2^31), "... with
// max-transfer N" (not a multiple of max(align, image alignment)),
// opt-write-zero / opt-discard likewise, max-write-zero / max-discard (not
// multiples of max(opt-*, alignment)).
absl::Status ValidateOptions(const BlkdebugOptions& options,
                             uint64_t image_request_alignment);

class BlkdebugNode final : public io::BlockNode {
 public:
  ~BlkdebugNode() override;

  // The image's length rounded up to 512 bytes. AllocatedSize is
  // unknown (kUnimplemented: qemu-img info says "disk size: unavailable").
  uint64_t size() const override;
  // Resumes nothing (a suspended request at close is the caller's bug) and
  // closes the image, returning its status.
  io::Task<absl::Status> Close() override;
  io::BlockNode* primary_child() const override { return image_.get(); }
  io::BlockNode* filtered_child() const override { return image_.get(); }

  // The node below. Owned by this node.
  io::BlockNode& image() const { return *image_; }
  // The node's state (1 at open; set-state rules move it).
  int state() const { return state_; }
  // Where "blkdebug: Suspended request ..." lines go (std::cout unless set,
  // qemu-io's stdout). Not owned; must outlive the node.
  void set_message_stream(std::ostream* out) { messages_ = out; }
  bool HandlesDebugEvents() const override { return true; }

 protected:
  bool RaisesWriteEvents() const override { return true; }
  io::Task<void> DoDebugEvent(io::BlkdebugEvent event) override;
  absl::Status DoDebugBreakpoint(io::BlkdebugEvent event,
                                 absl::string_view tag) override;
  absl::Status DoDebugRemoveBreakpoint(absl::string_view tag) override;
  absl::Status DoDebugResume(absl::string_view tag) override;
  bool DoDebugIsSuspended(absl::string_view tag) override;

  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  // Checked against the rules (iotype block-status), then the image's
  // answer (reads past the image's end: zeroes, not allocated).
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 private:
  friend io::Task<absl::StatusOr<std::unique_ptr<BlkdebugNode>>> OpenBlkdebug(
      std::unique_ptr<io::BlockNode> image, const BlkdebugOptions& options,
      std::vector<Rule> rules);

  struct Suspended {
    std::string tag;
    std::shared_ptr<io::Event> resumed;
  };

  // A request in flight; a read-modify-write is serialising over its range
  // widened to `align`.
  using Tracked = io::TrackedRequests::Request;

  BlkdebugNode(std::unique_ptr<io::BlockNode> image,
               const BlkdebugOptions& options);
  // Adds `rule` in front of its event's rules (QEMU's QLIST_INSERT_HEAD).
  void AddRule(Rule rule);
  // Deletes `rule` (its event's list and the armed rules).
  void RemoveRule(Rule* rule);
  // QEMU's rule_check: the error of the first armed rule matching a request
  // of `type` over [offset, offset + length), or OK.
  absl::Status CheckRules(uint64_t offset, uint64_t length, IoType type);
  // Aligned pieces: read/write [offset, offset + length) in max_transfer_
  // pieces, each checked.
  io::Task<absl::Status> ReadAligned(uint64_t offset, io::IoVec buf);
  io::Task<absl::Status> WriteAligned(uint64_t offset, io::ConstIoVec data);
  // Resumes the first request suspended under `tag`; false if none is.
  bool ResumeOne(absl::string_view tag);
  // The write of DoWrite without tracking or events: unaligned requests
  // read-modify-written (pwritev_rmw_* events), then written in pieces.
  // `tracked` (or null) waits for conflicts after its reads.
  io::Task<absl::Status> WriteRmw(uint64_t offset, io::ConstIoVec data,
                                  Tracked* tracked);

  std::unique_ptr<io::BlockNode> image_;
  const uint64_t align_;  // >= 1
  const uint64_t max_transfer_;
  const uint64_t opt_write_zero_;
  const uint64_t max_write_zero_;
  const uint64_t opt_discard_;
  const uint64_t max_discard_;
  int state_ = 1;
  std::list<Rule> rules_[io::kBlkdebugEventCount];
  std::list<Rule*> armed_;
  std::list<Suspended> suspended_;
  io::TrackedRequests tracked_;  // requests in flight
  std::ostream* messages_;
};

// Opens the filter over `image` (ownership passes, also on error; the image
// is not closed on error) with `rules` (config file's first, then the
// options'), after ValidateOptions with alignment 1, and raises the event
// `none`. kInvalidArgument from ValidateOptions.
io::Task<absl::StatusOr<std::unique_ptr<BlkdebugNode>>> OpenBlkdebug(
    std::unique_ptr<io::BlockNode> image, const BlkdebugOptions& options,
    std::vector<Rule> rules);

}  // namespace imgtool::blkdebug

#endif  // IMGTOOL_BLKDEBUG_BLKDEBUG_H_
