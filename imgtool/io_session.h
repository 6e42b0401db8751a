// imgtool io (qemu-io 7.2): the session that runs qemu-io's commands on
// one open image at a time. Internal to imgtool io (io_command.cc runs it);
// the commands are defined by file: io_session.cc (the command table,
// dispatch, help), io_rw.cc (read/write/aio/discard/flush/truncate),
// io_open.cc (open, close, reopen, -s), io_misc.cc (length, info, map,
// alloc, sleep, sigraise, abort, breakpoints).
// Thread model: one thread; aio requests run on the image's engine, driven
// by the session while it waits.
#ifndef IMGTOOL_IMGTOOL_IO_SESSION_H_
#define IMGTOOL_IMGTOOL_IO_SESSION_H_

#include <cstdint>
#include <cstdlib>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "base/options.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/io_output.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"

namespace imgtool::cli::qemu_io {

// qemu-io's largest request (INT_MAX rounded down to 512 bytes).
constexpr uint64_t kMaxRequestBytes = 2147483136;
// The byte qemu-io fills write buffers with when no -P is given.
constexpr uint8_t kDefaultPattern = 0xcd;
// The byte qemu-io fills read buffers with before a read (qemu_io_alloc's
// 0xab), visible where a driver leaves bytes unread (null-co with
// read-zeroes=off).
constexpr uint8_t kReadFill = 0xab;
constexpr uint64_t kSectorSize = 512;

// How to open an image: the command line's settings or an `open` command's.
struct OpenRequest {
  ImageSpec spec;
  // The path as qemu-io names it in "can't open device PATH: ..."; empty
  // for --image-opts and for `open -o ...` without a path ("can't open:").
  std::string name;
  bool snapshot = false;         // -s: writes go to a temporary overlay
  bool copy_on_read = false;     // -C
  bool discard_ignored = false;  // -d ignore
};

struct Request {
  enum Kind {
    kRead,
    kWrite,
    kWriteZeroes,
    kDiscard,
    kWriteCompressed,
    kReadVmState,   // read -b
    kWriteVmState,  // write -b
  };
  Kind kind = kRead;
  uint64_t offset = 0;
  uint64_t bytes = 0;
  absl::Span<uint8_t> buffer;    // kRead/kWrite: `bytes` long
  bool may_unmap = false;        // kWriteZeroes (-u)
  bool no_fallback = false;      // kWriteZeroes (-n)
  bool fua = false;              // kWrite/kWriteZeroes (-f): flush afterwards
  bool discard_ignored = false;  // kDiscard with -d ignore
};

// Runs one request against `node` the way qemu's BlockBackend checks it:
// a range past `image_length` (the 512-rounded length) fails with EIO. With
// `write_through` (the writethrough and directsync cache modes: QEMU's
// BlockBackend without a write cache) every write is followed by a flush of
// the node, as QEMU emulates FUA for drivers such as qcow2: their metadata
// caches reach the file after each write.
io::Task<absl::Status> RunRequest(io::BlockNode* node, uint64_t image_length,
                                  Request r, bool write_through);

// An aio_read/aio_write in flight: owns its buffer until it completes.
struct AioRequest {
  Request request;
  std::vector<uint8_t> buffer;
  bool quiet = false;
  bool machine = false;
  bool verbose = false;
  std::optional<uint8_t> pattern;  // aio_read -P
  Clock::time_point start;
};

// The options of the request commands (read, write, readv, writev, aio_read,
// aio_write, discard); each command's optstring says which it takes.
struct IoOptions {
  bool machine = false;                    // -C
  bool quiet = false;                      // -q
  bool verbose = false;                    // -v
  bool vmstate = false;                    // -b
  bool compressed = false;                 // -c
  bool fua = false;                        // -f
  bool invalid = false;                    // -i
  bool no_fallback = false;                // -n
  bool unmap = false;                      // -u
  bool zero = false;                       // -z
  std::optional<uint8_t> pattern;          // -P
  std::optional<uint64_t> pattern_offset;  // read -s
  std::optional<uint64_t> pattern_count;   // read -l
  std::optional<std::string> source_file;  // write -s
};

class Session;

struct CommandDef {
  const char* name;
  const char* alias;  // or nullptr
  int min_args;
  int max_args;  // -1: no limit
  bool writes;   // refused on a read-only image
  bool needs_image;
  const char* args;     // synopsis after the name
  const char* oneline;  // what it does
  bool (Session::*run)(const CommandDef& def, std::vector<std::string>& words);
};

std::string OneLineHelp(absl::string_view name, const CommandDef& def);

// The command named `name` (or aliased so), or null.
const CommandDef* FindCommand(absl::string_view name);

class Session {
 public:
  explicit Session(Streams streams) : streams_(streams) {}

  // Opens the image `request` describes; no image may be open. Errors are
  // qemu-io's text after "qemu-io: ": "can't open device PATH: <cause>", or
  // "can't open: <cause>" where qemu-io has no path to name.
  absl::Status Open(const OpenRequest& request);

  // Runs one command line. Returns false once `quit` ran.
  bool Execute(const std::string& line);

  // Waits for the aio requests, prints their completions and closes the
  // image (if one is open). As qemu-io, a close never fails: what went
  // wrong is reported on stderr, one "qemu-io: " line per line of the
  // error (QEMU's error_report calls in the drivers' close, e.g. qcow2's
  // "Failed to flush the L2 table cache: ..."), and nothing else changes.
  void Close();

  // --image-opts on the command line: `open PATH` then parses PATH as
  // options, and `open -o` is refused.
  void set_image_opts(bool image_opts) { image_opts_ = image_opts; }

  bool failed() const { return failed_; }

  // --- commands (each returns false if it failed; kCommands lists them).

  bool CmdRead(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWrite(const CommandDef& def, std::vector<std::string>& words);
  bool CmdReadv(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWritev(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioRead(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioWrite(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAioFlush(const CommandDef& def, std::vector<std::string>& words);
  bool CmdDiscard(const CommandDef& def, std::vector<std::string>& words);
  bool CmdFlush(const CommandDef& def, std::vector<std::string>& words);
  bool CmdTruncate(const CommandDef& def, std::vector<std::string>& words);
  bool CmdLength(const CommandDef& def, std::vector<std::string>& words);
  bool CmdInfo(const CommandDef& def, std::vector<std::string>& words);
  bool CmdMap(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAlloc(const CommandDef& def, std::vector<std::string>& words);
  bool CmdSleep(const CommandDef& def, std::vector<std::string>& words);
  bool CmdHelp(const CommandDef& def, std::vector<std::string>& words);
  bool CmdQuit(const CommandDef& def, std::vector<std::string>& words);
  bool CmdOpen(const CommandDef& def, std::vector<std::string>& words);
  bool CmdClose(const CommandDef& def, std::vector<std::string>& words);
  bool CmdReopen(const CommandDef& def, std::vector<std::string>& words);
  bool CmdSigraise(const CommandDef& def, std::vector<std::string>& words);
  bool CmdAbort(const CommandDef& def, std::vector<std::string>& words);
  bool CmdBreak(const CommandDef& def, std::vector<std::string>& words);
  bool CmdWaitBreak(const CommandDef& def, std::vector<std::string>& words);
  bool CmdResume(const CommandDef& def, std::vector<std::string>& words);
  bool CmdRemoveBreak(const CommandDef& def, std::vector<std::string>& words);

 private:
  std::ostream& out() { return streams_.out; }
  std::ostream& err() { return streams_.err; }
  io::BlockNode& node() { return *image_.node; }
  io::Engine& engine() { return *image_.engine; }
  uint64_t ImageLength() const { return VirtualSize(image_); }
  // QEMU's BlockBackend has no write cache in these modes.
  bool WriteThrough() const {
    return current_.spec.cache == "writethrough" ||
           current_.spec.cache == "directsync";
  }

  // Drives the engine until `task` is done, printing the completions of aio
  // requests as they finish (qemu-io's event loop runs while it waits).
  template <typename T>
  T Wait(io::Task<T> task) {
    std::optional<T> result;
    io::Spawn(std::move(task),
              [&result](T v) { result.emplace(std::move(v)); });
    PrintAioOutput();
    while (!result.has_value()) {
      absl::Status st = engine().Poll(/*wait=*/true);
      PrintAioOutput();
      if (!st.ok() || (engine().in_flight() == 0 && !result.has_value())) {
        std::abort();  // An engine failure or a task waiting on nothing.
      }
    }
    return std::move(*result);
  }

  // The errno text of a failed request ("read failed: <text>"). A qcow2
  // corruption event in it ("qcow2: Marking image as corrupt: ...") goes to
  // stderr first, once per session, as qemu-io shows QEMU's report of it
  // (later events are suppressed there too). Once an image opened
  // read-write was marked corrupt, QEMU has dropped its driver and later
  // requests fail with ENOMEDIUM.
  std::string FailureText(const absl::Status& status);

  void PrintAioOutput() {
    if (aio_output_.empty()) return;
    out() << aio_output_;
    aio_output_.clear();
  }

  void DrainAio();

  // --- argument helpers (each prints qemu-io's message and returns false).

  bool Usage(const CommandDef& def) {
    out() << OneLineHelp(def.name, def);
    return false;
  }

  // getopt over words[1..] with words[0] as the program name, permuting
  // like glibc; prints glibc's messages and the usage line on errors.
  bool GetOptions(const CommandDef& def, std::vector<std::string>& words,
                  const char* optstring,
                  const std::function<bool(int, const char*)>& on_option,
                  std::vector<std::string>* operands);

  // GetOptions for the request commands: `optstring` is a subset of
  // "bcCfilnpP:qs:uvz" (-p is accepted and ignored, as by qemu-io); -s is the
  // pattern verification offset where `optstring` has -l, else the source
  // file. Values are checked as they come, so the first bad one is reported.
  bool GetIoOptions(const CommandDef& def, std::vector<std::string>& words,
                    const char* optstring, IoOptions* opts,
                    std::vector<std::string>* operands);

  // Runs `r`, setting *seconds to how long it took; prints "<op> failed:
  // <error>" and returns false if it failed.
  bool RunTimed(const Request& r, absl::string_view op, double* seconds);

  // What read and readv (`op`, named in the failure message) do once their
  // arguments are checked: reads `count` bytes at `offset`; with -P, checks
  // that bytes [check_offset, check_offset + check_count) of them all hold
  // the pattern (false and a message if not); then, unless -q, prints the
  // hex dump (-v) and the report.
  bool ReadAndCheck(const IoOptions& o, absl::string_view op, uint64_t offset,
                    uint64_t count, uint64_t check_offset,
                    uint64_t check_count);

  // A number as qemu-io's cvtnum reads it (base/size.h grammar).
  bool ParseNumber(const std::string& text, uint64_t* value);

  bool ParsePattern(const char* text, uint8_t* pattern);

  // The lengths of a vectored command (readv, writev, aio_*): each at most
  // kMaxRequestBytes, and so is their sum.
  bool ParseLengths(absl::Span<const std::string> texts, uint64_t* total);

  // -b / -c requests work on whole sectors.
  bool CheckSectorAligned(uint64_t offset, uint64_t count);

  // Fills `buffer` by repeating the bytes of the file `path` (write -s).
  bool FillFromFile(const std::string& path, std::vector<uint8_t>& buffer);

  // The operands of readv, writev, aio_read and aio_write: an offset, then
  // lengths summed into `count`. False after a message if one is bad.
  bool ParseOffsetAndLengths(const std::vector<std::string>& operands,
                             uint64_t* offset, uint64_t* count);

  // -n and -u only go with -z (write, aio_write). False after a message.
  bool CheckZeroOnlyOptions(const IoOptions& o);

  // The request of write and aio_write: with -z a write zeroes (-u, -n),
  // else a write of `buffer` filled with `count` bytes of the -P pattern
  // (or of the -s file's bytes). False after a message if -s's file fails.
  bool MakeWriteRequest(const IoOptions& o, uint64_t offset, uint64_t count,
                        std::vector<uint8_t>& buffer, Request* r);

  // Whether [offset, offset + n) of the top node is allocated there (not in
  // a backing file), with n in 1..max_bytes. The bytes between the node's
  // end and the 512-rounded image length count as allocated, as for raw.
  absl::StatusOr<std::pair<bool, uint64_t>> IsAllocated(uint64_t offset,
                                                        uint64_t max_bytes);

  void SubmitAio(std::shared_ptr<AioRequest> aio, const char* op);

  // The cache mode named `arg` (open -t, reopen -c) into *mode; false after
  // qemu-io's "Invalid cache option" if there is none.
  bool ParseCacheOption(const char* arg, std::string* mode);

  // Appends the option string `arg` (open -o, reopen -o) to *options, comma
  // separated; false after the parser's message if it is malformed.
  bool AppendOptions(const char* arg, std::string* options);

  // reopen of an image opened with -s, as QEMU's fails or not (the new
  // read-only flag and cache mode, and reopen's -o options).
  bool ReopenSnapshot(std::optional<bool> read_only,
                      const std::optional<std::string>& cache,
                      const OptionList& options);

  // -s: opens `spec`'s image read-only as the backing file of a new
  // temporary qcow2 overlay (deleted once open), which takes the writes.
  absl::StatusOr<OpenedImage> OpenSnapshot(const ImageSpec& spec);

  // A qemu-io error line on stderr ("qemu-io: <message>").
  void Error(absl::string_view message) {
    err() << ProgramName() << ": " << message << "\n";
  }

  Streams streams_;
  OpenedImage image_;
  OpenRequest current_;  // how image_ was opened
  // -s: the temporary overlay's path (unlinked once open) and whether a
  // reopen has happened since (QEMU's later reopens all fail).
  std::string snapshot_overlay_;
  bool snapshot_reopened_ = false;
  int generated_node_names_ = 0;  // QEMU's "#blockNNN" names in messages
  bool image_opts_ = false;
  bool discard_ignored_ = false;
  bool failed_ = false;
  bool quit_ = false;
  bool corruption_reported_ = false;  // a qcow2 corruption event was printed
  // The image was marked corrupt: QEMU has no driver for it any more
  // (ENOMEDIUM for every request, length and info).
  bool driver_dropped_ = false;
  int aio_in_flight_ = 0;
  std::string aio_output_;  // completion lines not printed yet
};

}  // namespace imgtool::cli::qemu_io

#endif  // IMGTOOL_IMGTOOL_IO_SESSION_H_
