// crash_writer: opens a qcow2 image read-write as qcow2 -> preallocate ->
// file and writes it sequentially (64 KiB at 1 KiB + i * 64 KiB, 64 in
// flight, a flush every 256 writes, cache mode from the command line) until
// it is killed. Prints
// nothing while all goes well; a failed request prints its status on
// stderr and exits with 1.
//
//   crash_writer <image> <seed> <cache> <prealloc-size>
#include <unistd.h>

#include <cstdio>
#include <string>

#include "absl/strings/numbers.h"
#include "prealloc_filter/testing/chain.h"

namespace imgtool::prealloc_filter::testing {
namespace {

[[noreturn]] void Fail(const char* what, const absl::Status& st) {
  std::fprintf(stderr, "crash_writer: %s: %s\n", what, st.ToString().c_str());
  std::fflush(stderr);
  _exit(1);
}

int Main(int argc, char** argv) {
  uint64_t seed = 0, prealloc_size = 0;
  if (argc != 5 || !absl::SimpleAtoi(argv[2], &seed) ||
      !absl::SimpleAtoi(argv[4], &prealloc_size)) {
    std::fprintf(
        stderr, "usage: crash_writer <image> <seed> <cache> <prealloc-size>\n");
    return 2;
  }
  qcow2::testing::Env env(io::EngineKind::kIoUring, 64);
  PreallocFilterOptions options;
  options.set_prealloc_size(prealloc_size);
  absl::StatusOr<Chain> chain =
      OpenChain(env, argv[1], argv[3], /*with_filter=*/true, options);
  if (!chain.ok()) Fail("open", chain.status());
  constexpr uint64_t kLength = 65536;
  constexpr int kBatch = 256;
  for (uint64_t batch = 0;; ++batch) {
    const uint64_t start = 1024 + batch * kBatch * kLength;
    if (start + kBatch * kLength > chain->qcow2->size()) break;
    absl::Status st = WriteSequential(env, *chain->qcow2, start, kLength,
                                      kBatch, 64, seed + batch * kBatch);
    if (!st.ok()) Fail("write", st);
    // Metadata reaches the file too, so the killed image has some.
    st = env.Run(chain->qcow2->Flush());
    if (!st.ok()) Fail("flush", st);
  }
  absl::Status st = env.Run(chain->qcow2->Close());
  if (!st.ok()) Fail("close", st);
  return 0;
}

}  // namespace
}  // namespace imgtool::prealloc_filter::testing

int main(int argc, char** argv) {
  return imgtool::prealloc_filter::testing::Main(argc, argv);
}
