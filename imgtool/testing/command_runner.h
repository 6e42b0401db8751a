// Test helpers for imgtool commands: run a command's Run function with
// captured streams, and make image files with a known layout in a fresh
// directory under $TEST_TMPDIR.
#ifndef IMGTOOL_IMGTOOL_TESTING_COMMAND_RUNNER_H_
#define IMGTOOL_IMGTOOL_TESTING_COMMAND_RUNNER_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "imgtool/command.h"

namespace imgtool::cli::testing {

struct CommandResult {
  absl::Status status;
  std::string out;  // what the command wrote to stdout
  std::string err;  // what it wrote to stderr (errors are in `status`)
  // What main would print on stderr: `err` followed by FormatError(status).
  std::string stderr_text() const;
};

CommandResult RunCommand(CommandFn run, const std::vector<std::string>& args);

// A new empty directory for one test (under $TEST_TMPDIR or /tmp).
std::string MakeTestDir();

// Creates `path` as a sparse file of `size` bytes (replacing it).
void MakeSparseFile(const std::string& path, uint64_t size);

// Writes `length` bytes of `byte` at `offset`, growing the file if needed.
void WriteBytes(const std::string& path, uint64_t offset, uint64_t length,
                uint8_t byte);

std::string ReadFile(const std::string& path);
uint64_t FileSize(const std::string& path);
// st_blocks * 512.
uint64_t AllocatedBytes(const std::string& path);

}  // namespace imgtool::cli::testing

#endif  // IMGTOOL_IMGTOOL_TESTING_COMMAND_RUNNER_H_
