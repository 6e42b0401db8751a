// The bench loop of `imgtool bench` (bench.cc) for other commands: `imgtool
// advise` runs its matrix through it in-process, with bench's own options.
#ifndef IMGTOOL_IMGTOOL_BENCH_H_
#define IMGTOOL_IMGTOOL_BENCH_H_

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "imgtool/bench_result.pb.h"

namespace imgtool::cli {

// Runs `imgtool bench ARGS` (the arguments after "bench", e.g. {"-w", "-t",
// "none", "-d", "64", "-s", "4096", "-c", "1000", "--random", "-f", "raw",
// "f.raw"}) and returns what `--output=json` would print, without the
// latency percentiles (not measured: no clock read per request). Prints
// nothing; warnings of opening the image go to `err`. Errors: bench's own
// (option errors kInvalidArgument, "Could not open ...", "Failed request:
// ..."); --help is kInvalidArgument. Not thread-safe (getopt).
absl::StatusOr<BenchResult> BenchForResult(const std::vector<std::string>& args,
                                           std::ostream& err);

}  // namespace imgtool::cli

#endif  // IMGTOOL_IMGTOOL_BENCH_H_
