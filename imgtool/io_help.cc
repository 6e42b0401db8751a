// qemu-io 7.2's extended command help (`help CMD`), as the real qemu-io
// prints it after the command's one-line summary; captured from qemu-io 7.2
// (Debian qemu-utils 1:7.2) with `qemu-io -c "help CMD"`.
#include "imgtool/io_help.h"

#include "absl/strings/string_view.h"

namespace imgtool::cli {
namespace {

struct HelpText {
  const char* name;
  const char* text;
};

constexpr HelpText kHelpTexts[] = {
    {"aio_read", R"(
 asynchronously reads a range of bytes from the given offset

 Example:
 'aio_read -v 512 1k 1k ' - dumps 2 kilobytes read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 The read is performed asynchronously and the aio_flush command must be
 used to ensure all outstanding aio requests have been completed.
 Note that due to its asynchronous nature, this command will be
 considered successful once the request is submitted, independently
 of potential I/O errors or pattern mismatches.
 -C, -- report statistics in a machine parsable format
 -P, -- use a pattern to verify read data
 -i, -- treat request as invalid, for exercising stats
 -v, -- dump buffer to standard output
 -q, -- quiet mode, do not show I/O statistics

)"},
    {"aio_write", R"(
 asynchronously writes a range of bytes from the given offset source
 from multiple buffers

 Example:
 'aio_write 512 1k 1k' - writes 2 kilobytes at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 The write is performed asynchronously and the aio_flush command must be
 used to ensure all outstanding aio requests have been completed.
 Note that due to its asynchronous nature, this command will be
 considered successful once the request is submitted, independently
 of potential I/O errors or pattern mismatches.
 -P, -- use different pattern to fill file
 -C, -- report statistics in a machine parsable format
 -f, -- use Force Unit Access semantics
 -i, -- treat request as invalid, for exercising stats
 -q, -- quiet mode, do not show I/O statistics
 -u, -- with -z, allow unmapping
 -z, -- write zeroes using blk_aio_pwrite_zeroes

)"},
    {"discard", R"(
 discards a range of bytes from the given offset

 Example:
 'discard 512 1k' - discards 1 kilobyte from 512 bytes into the file

 Discards a segment of the currently open file.
 -C, -- report statistics in a machine parsable format
 -q, -- quiet mode, do not show I/O statistics

)"},
    {"open", R"(
 opens a new file in the requested mode

 Example:
 'open -n -o driver=raw /tmp/data' - opens raw data file read-write, uncached

 Opens a file for subsequent use by all of the other qemu-io commands.
 -r, -- open file read-only
 -s, -- use snapshot file
 -C, -- use copy-on-read
 -n, -- disable host cache, short for -t none
 -U, -- force shared permissions
 -k, -- use kernel AIO implementation (Linux only, prefer use of -i)
 -i, -- use AIO mode (threads, native or io_uring)
 -t, -- use the given cache mode for the image
 -d, -- use the given discard mode for the image
 -o, -- options to be given to the block driver
)"},
    {"read", R"(
 reads a range of bytes from the given offset

 Example:
 'read -v 512 1k' - dumps 1 kilobyte read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 -b, -- read from the VM state rather than the virtual disk
 -C, -- report statistics in a machine parsable format
 -l, -- length for pattern verification (only with -P)
 -p, -- ignored for backwards compatibility
 -P, -- use a pattern to verify read data
 -q, -- quiet mode, do not show I/O statistics
 -s, -- start offset for pattern verification (only with -P)
 -v, -- dump buffer to standard output

)"},
    {"readv", R"(
 reads a range of bytes from the given offset into multiple buffers

 Example:
 'readv -v 512 1k 1k ' - dumps 2 kilobytes read from 512 bytes into the file

 Reads a segment of the currently open file, optionally dumping it to the
 standard output stream (with -v option) for subsequent inspection.
 Uses multiple iovec buffers if more than one byte range is specified.
 -C, -- report statistics in a machine parsable format
 -P, -- use a pattern to verify read data
 -v, -- dump buffer to standard output
 -q, -- quiet mode, do not show I/O statistics

)"},
    {"reopen", R"(
 Changes the open options of an already opened image

 Example:
 'reopen -o lazy-refcounts=on' - activates lazy refcount writeback on a qcow2 image

 -r, -- Reopen the image read-only
 -w, -- Reopen the image read-write
 -c, -- Change the cache mode to the given value
 -o, -- Changes block driver options (cf. 'open' command)

)"},
    {"sigraise", R"(
 raises the given signal

 Example:
 'sigraise 15' - raises SIGTERM

 Invokes raise(signal), where "signal" is the mandatory integer argument
 given to sigraise.

)"},
    {"write", R"(
 writes a range of bytes from the given offset

 Example:
 'write 512 1k' - writes 1 kilobyte at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 -b, -- write to the VM state rather than the virtual disk
 -c, -- write compressed data with blk_write_compressed
 -f, -- use Force Unit Access semantics
 -n, -- with -z, don't allow slow fallback
 -p, -- ignored for backwards compatibility
 -P, -- use different pattern to fill file
 -s, -- use a pattern file to fill the write buffer
 -C, -- report statistics in a machine parsable format
 -q, -- quiet mode, do not show I/O statistics
 -u, -- with -z, allow unmapping
 -z, -- write zeroes using blk_co_pwrite_zeroes

)"},
    {"writev", R"(
 writes a range of bytes from the given offset source from multiple buffers

 Example:
 'writev 512 1k 1k' - writes 2 kilobytes at 512 bytes into the open file

 Writes into a segment of the currently open file, using a buffer
 filled with a set pattern (0xcdcdcdcd).
 -P, -- use different pattern to fill file
 -C, -- report statistics in a machine parsable format
 -f, -- use Force Unit Access semantics
 -q, -- quiet mode, do not show I/O statistics

)"},
};

}  // namespace

absl::string_view QemuIoCommandHelp(absl::string_view name) {
  for (const HelpText& h : kHelpTexts) {
    if (name == h.name) return h.text;
  }
  return "";
}

}  // namespace imgtool::cli
