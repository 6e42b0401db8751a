// Test helpers for qcow2/format: make images with qemu-img (the oracle) in
// the test's temporary directory and read/write whole files.
#ifndef IMGTOOL_QCOW2_FORMAT_TEST_UTIL_H_
#define IMGTOOL_QCOW2_FORMAT_TEST_UTIL_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace imgtool::qcow2::format::testing {

// $TEST_TMPDIR/<name> (or /tmp/<name> outside Bazel).
std::string TempPath(absl::string_view name);

// Runs `command` with /bin/sh; returns stdout+stderr. kInternal with the
// output if it exits non-zero.
absl::StatusOr<std::string> RunShell(const std::string& command);

// `qemu-img create -q -f qcow2 [-o options] <TempPath(name)> <size>`, run
// in TempPath("") so relative file names in `options` resolve there;
// returns the path.
absl::StatusOr<std::string> QemuImgCreate(absl::string_view name,
                                          absl::string_view options,
                                          absl::string_view size);

absl::StatusOr<std::vector<uint8_t>> ReadFileBytes(const std::string& path);
absl::Status WriteFileBytes(const std::string& path,
                            absl::Span<const uint8_t> bytes);

}  // namespace imgtool::qcow2::format::testing

#endif  // IMGTOOL_QCOW2_FORMAT_TEST_UTIL_H_
