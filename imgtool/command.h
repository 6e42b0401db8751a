// The interface every imgtool command implements. main.cc only dispatches:
// `imgtool <command> args...` calls the command's Run with the arguments
// after the command name. Tests call Run directly.
#ifndef IMGTOOL_IMGTOOL_COMMAND_H_
#define IMGTOOL_IMGTOOL_COMMAND_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace imgtool::cli {

// Standard output and standard error of a command. Errors are not printed
// by the command: it returns them and main prints "imgtool: <message>".
struct Streams {
  std::ostream& out;
  std::ostream& err;
};

// Exit code a command asks for besides 0 (ok) and 1 (error): attach it to
// a status with SetExitCode (check's 2/3, compare's 1..4, check's 63).
absl::Status WithExitCode(absl::Status status, int exit_code);
int ExitCodeOf(const absl::Status& status);  // 0 for ok, 1 by default

using CommandFn = absl::Status (*)(const std::vector<std::string>& args,
                                   Streams streams);

absl::Status RunCreate(const std::vector<std::string>& args, Streams streams);
absl::Status RunInfo(const std::vector<std::string>& args, Streams streams);
absl::Status RunMap(const std::vector<std::string>& args, Streams streams);
absl::Status RunResize(const std::vector<std::string>& args, Streams streams);
absl::Status RunBench(const std::vector<std::string>& args, Streams streams);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_COMMAND_H_
