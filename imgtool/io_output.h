// imgtool io (qemu-io 7.2): the texts qemu-io prints for finished requests
// and failures. Pure functions; thread-safe.
#ifndef IMGTOOL_IMGTOOL_IO_OUTPUT_H_
#define IMGTOOL_IMGTOOL_IO_OUTPUT_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace imgtool::cli::qemu_io {

using Clock = std::chrono::steady_clock;

// A byte count or rate as qemu-io prints it: binary units with three
// decimals, ".000" left out; below 1 KiB plain "%f bytes" with ".000000"
// left out: 1536 -> "1.500 KiB", 4096 -> "4 KiB", 1 -> "1 bytes".
std::string HumanBytes(double value);

// Elapsed time: "00.01 sec" under a second, else "H:MM:SS.cc"; the machine
// format (-C) always uses the second form.
std::string ElapsedText(double seconds, bool machine);

// `d` in seconds, at least 1 ns (rates divide by it).
double Seconds(Clock::duration d);

// The two report lines of a finished request, or the one -C line
// (bytes,ops,time,bytes/sec,ops/sec). `offset`, `count`, `total` in bytes.
std::string Report(absl::string_view op, double seconds, uint64_t offset,
                   uint64_t count, uint64_t total, int ops, bool machine);

// 16 bytes a line: "%08x:  " offset, "xx " per byte, a space, and the bytes
// as text (letters and digits only, '.' for the rest). `offset` is the
// image offset (bytes) of data[0].
std::string HexDump(absl::Span<const uint8_t> data, uint64_t offset);

// The errno a failed request reports ("write failed: <strerror>"): the one
// the status carries (base/errno_status.h), else one for its code (EIO for
// codes without a closer errno).
int ErrnoOf(const absl::Status& status);

// strerror(ErrnoOf(status)).
std::string ErrorText(const absl::Status& status);

// A node's message without the file name in front (qemu-io's errors do not
// name the image): "x.raw: Unsupported ..." -> "Unsupported ...".
std::string WithoutFilename(const absl::Status& status,
                            const std::string& filename);

// Whether every byte of `data` is `byte` (true for empty data).
bool AllBytesAre(absl::Span<const uint8_t> data, uint8_t byte);

}  // namespace imgtool::cli::qemu_io

#endif  // IMGTOOL_IMGTOOL_IO_OUTPUT_H_
