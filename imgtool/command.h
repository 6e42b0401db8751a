// The interface every imgtool command implements. main.cc only dispatches:
// `imgtool <command> args...` calls the command's Run with the arguments
// after the command name. Tests call Run directly.
#ifndef IMGTOOL_IMGTOOL_COMMAND_H_
#define IMGTOOL_IMGTOOL_COMMAND_H_

#include <getopt.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "base/options.h"

namespace imgtool::cli {

// Standard output and standard error of a command. Errors are not printed
// by the command: it returns them and main prints "imgtool: <message>".
struct Streams {
  std::ostream& out;
  std::ostream& err;
};

// Exit code a command asks for besides 0 (ok) and 1 (error): attach it to
// a status with WithExitCode (check's 2/3, compare's 1..4, check's 63).
absl::Status WithExitCode(absl::Status status, int exit_code);
int ExitCodeOf(const absl::Status& status);  // 0 for ok, 1 by default

// The name messages give the program: "imgtool", or the tool it stands in
// for when the binary runs under that name (main: "qemu-img", "qemu-io"),
// so that "qemu-img: Could not open ..." reads as qemu-img's own. Set once by
// main before any command runs; not thread-safe to change.
void SetProgramName(absl::string_view name);
const std::string& ProgramName();

// imgtool's release, and the QEMU release whose behaviour it reproduces.
inline constexpr char kImgtoolVersion[] = "0.2.0";
inline constexpr char kQemuVersion[] = "7.2.0";

// The --version text (`imgtool --version`, `imgtool io -V`, and under a
// drop-in name `qemu-img --version` / `qemu-io -V`): imgtool's own line, or
// "<tool> version 7.2.0 (imgtool 0.2.0)" first, which the callers that parse
// it accept (Cinder's `qemu-img version ([0-9.]*)`). Ends with a newline.
std::string VersionText();

// How main prints a failed status (FormatError): ProgramName() + ": " +
// message.
// A message of several lines is printed the way qemu-img prints it: by
// default only the first line gets the prefix (qemu-img's error + hint, e.g.
// `Failed to get "write" lock` / `Is another process using the image [x]?`);
// PrefixEachLine marks messages qemu-img prints as separate reports, where
// every line is prefixed (the two "Invalid image size specified..." lines).
absl::Status PrefixEachLine(absl::Status status);

// A command-line usage error (unknown option, missing operand): main prints
// "imgtool: <message>", then `usage` (one line, no prefix; left out under a
// drop-in name, as qemu-img prints none) and "Try 'imgtool --help' for more
// information". Exit code 1. kInvalidArgument.
absl::Status UsageError(absl::string_view message, absl::string_view usage);

// The complete text main writes to stderr for `status` (not ok), ending
// with a newline. A qcow2 corruption event in it (see WithCorruptionEvent)
// is printed as QEMU reports one: the event on a line of its own, without
// prefix, then the error with "Input/output error" where the event stood
// ("qcow2: Image is corrupt: Invalid cluster entry found ...", then
// "imgtool: Could not read file metadata: Input/output error").
std::string FormatError(const absl::Status& status);

// For an error whose message does not quote its cause (compare's "Sector
// allocation test failed for F"): if `cause` is a qcow2 corruption event
// (kDataLoss from Qcow2Node::SignalCorruption, "qcow2: Image is corrupt:
// ..." or "qcow2: Marking image as corrupt: ..."), returns `status` with the
// event attached, so that FormatError prints it first as qemu-img does;
// otherwise `status` unchanged.
absl::Status WithCorruptionEvent(absl::Status status,
                                 const absl::Status& cause);

// A command that stops early and successfully after `text` was asked for
// (--object help): main writes `text` to stdout and exits 0. The status is
// not ok (kCancelled, empty message) so that the command returns at once.
absl::Status StopWithOutput(std::string text);
// The text of a StopWithOutput status, or nullopt for any other status.
std::optional<std::string> OutputOf(const absl::Status& status);

// Writes library warnings (lines written to a std::ostream* warnings
// argument, without a prefix) to `err` as qemu-img prints warnings:
// "imgtool: warning: <line>" for each line.
void PrintWarnings(absl::string_view warnings, std::ostream& err);

// The cache modes QEMU's tools accept for -t and -T ("off" is "none"): the
// mode's name as posix_file takes it, or nullopt for anything else.
std::optional<std::string> CacheMode(const std::string& name);

// qemu-img's check on each -o argument: not empty, no leading comma, an even
// number of trailing commas (a lone trailing comma would be an escape).
bool IsValidOptionList(const std::string& text);

// Splits an -o argument at its single commas (",," stays, as an escaped
// comma inside a value), so that each item is parsed on its own and a key
// given twice is not an error (the last value wins, as in qemu-img).
std::vector<std::string> SplitOptionItems(const std::string& text);

// Every item of an -o argument (SplitOptionItems), each parsed by
// base/options.h ParseOptionString, in order. Its errors.
absl::StatusOr<OptionList> ParseOptionItems(const std::string& text);

// The types of qemu-img's -o options (QEMU's QemuOptType) and one value
// parsed by its type: sizes by ParseSizeOption ("64k"), numbers as QEMU's
// strtoull with base 0 and nothing after ("-1" wraps), booleans by
// ParseBoolOption (on/off), strings as given. kInvalidArgument with
// qemu-img's texts ("Parameter 'refcount_bits' expects a number", ...).
enum class OptionType { kSize, kNumber, kBool, kString };
struct OptionValue {
  std::string text;  // as given
  uint64_t number = 0;
  bool flag = false;
};
absl::StatusOr<OptionValue> ParseTypedOption(const std::string& key,
                                             const std::string& value,
                                             OptionType type);

// One line of `-o help`: "  name=<type>" padded to 24 columns, "- help".
std::string OptionHelpLine(const char* name, OptionType type,
                           const char* help);

// Whether `name` has a protocol prefix as QEMU's path_has_protocol sees it
// ("json:{...}", "nbd:..."): a ':' before any '/'.
bool HasProtocol(const std::string& name);

// realpath(3) of `path` (symlinks resolved, absolute), or nullopt if it
// does not name an existing file.
std::optional<std::string> RealPath(const std::string& path);

// Parses the options of a command with getopt_long, qemu-img's way: options
// and operands may be mixed, "--" ends the options, an unknown option is
// UsageError("unrecognized option '<word>'"), a missing argument
// UsageError("missing argument for option '<word>'"). `on_option` is called
// with each option's code (the short letter or the long option's `val`) and
// its argument ("" if none) in command-line order; an error from it stops
// the parse and is returned. Returns the operands in order.
// QEMU's --object is handled here for every command whose table has a long
// option named "object" (on_option never sees it): its argument is added
// to block::ObjectRegistry::Default() as qemu-img adds it, in command-line
// order, and its error (block/objects.h) stops the parse; `--object help`
// stops it with StopWithOutput(the help text).
// `short_options` is a getopt string without the leading ':' (added here).
// Not thread-safe: getopt keeps global state.
absl::StatusOr<std::vector<std::string>> ParseOptions(
    const std::vector<std::string>& args, const char* short_options,
    const struct option* long_options, absl::string_view usage,
    const std::function<absl::Status(int option, const std::string& arg)>&
        on_option);

// qemu-img's --output check: "human" or "json", else kInvalidArgument
// "--output must be used with human or json as argument.". Returns true for
// json.
absl::StatusOr<bool> ParseOutputFormat(const std::string& value);

using CommandFn = absl::Status (*)(const std::vector<std::string>& args,
                                   Streams streams);

absl::Status RunCreate(const std::vector<std::string>& args, Streams streams);
absl::Status RunInfo(const std::vector<std::string>& args, Streams streams);
absl::Status RunMap(const std::vector<std::string>& args, Streams streams);
absl::Status RunResize(const std::vector<std::string>& args, Streams streams);
absl::Status RunSnapshot(const std::vector<std::string>& args,
                         Streams streams);
absl::Status RunBitmap(const std::vector<std::string>& args, Streams streams);
absl::Status RunBench(const std::vector<std::string>& args, Streams streams);
// check (check.cc): exit codes 2 (corruptions), 3 (leaks only) and 63 (no
// checks for the format) come with an empty message or "This image format
// does not support checks"; "Check failed" is exit code 1.
absl::Status RunCheck(const std::vector<std::string>& args, Streams streams);
// convert and compare (convert.cc, compare.cc). compare's "images differ"
// (exit 1) has been printed on stdout: its status has an empty message.
absl::Status RunConvert(const std::vector<std::string>& args, Streams streams);
absl::Status RunCompare(const std::vector<std::string>& args, Streams streams);
// commit (commit.cc) and dd (dd.cc): qemu-img 7.2's, on the copy engine.
absl::Status RunCommit(const std::vector<std::string>& args, Streams streams);
absl::Status RunDd(const std::vector<std::string>& args, Streams streams);
// rebase (rebase.cc): qemu-img rebase, safe and unsafe (-u) modes.
absl::Status RunRebase(const std::vector<std::string>& args, Streams streams);
// qemu-io's commands (io_command.cc). When a command fails it has printed
// its own error: the status then has an empty message, and main prints
// nothing more (exit code 1).
absl::Status RunIo(const std::vector<std::string>& args, Streams streams);
// measure (measure.cc) and amend (amend.cc).
absl::Status RunMeasure(const std::vector<std::string>& args, Streams streams);
absl::Status RunAmend(const std::vector<std::string>& args, Streams streams);
// nbd (nbd.cc): the NBD server, qemu-nbd 7.2's command line. Its getopt
// errors are printed by the command (qemu-nbd's form); the status then has
// an empty message (exit code 1).
absl::Status RunNbd(const std::vector<std::string>& args, Streams streams);
// advise (advise.cc): measures image configurations on a directory's
// filesystem and prints the best per workload (an imgtool extension).
absl::Status RunAdvise(const std::vector<std::string>& args, Streams streams);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_COMMAND_H_
