// The seed experiment at small scale, on a real XFS loop mount: 4 KiB
// O_DIRECT writes every 8 KiB (first at 0, then at 4096, 64 in flight)
// fragment a raw file without an extent size hint into thousands of
// extents; the default 1 MiB hint keeps it to about one extent per MiB
// (file-posix.md §2). Needs root (tags = ["local"]); skips otherwise.
#include <unistd.h>

#include <cstdint>
#include <iostream>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "base/testing/loop_mount.h"
#include "benchmarks/workloads.h"
#include "gtest/gtest.h"

namespace imgtool::benchmarks {
namespace {

constexpr uint64_t kImageSize = 64ull << 20;  // 16384 writes of 4 KiB

// Extents after the interleaved write phase on a fresh image.
uint64_t ExtentsAfterInterleavedWrites(const std::string& path,
                                       std::optional<uint64_t> hint) {
  absl::StatusOr<RawImage> image = CreateAndOpenRaw(path, kImageSize, hint);
  EXPECT_TRUE(image.ok()) << image.status();
  if (!image.ok()) return 0;
  absl::Status st = WriteInterleaved(*image->engine, *image->node, 64);
  EXPECT_TRUE(st.ok()) << st;
  absl::StatusOr<uint64_t> extents = image->node->ExtentCount();
  EXPECT_TRUE(extents.ok()) << extents.status();
  st = CloseRaw(*image);
  EXPECT_TRUE(st.ok()) << st;
  return extents.ok() ? *extents : 0;
}

TEST(FragmentationTest, DefaultHintKeepsInterleavedWritesTenTimesLessFragmented) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to loop-mount XFS";
  absl::StatusOr<std::unique_ptr<testing::LoopMount>> mount =
      testing::LoopMount::Create(testing::FsKind::kXfs, 512ull << 20);
  if (!mount.ok()) GTEST_SKIP() << mount.status();

  const uint64_t with_hint = ExtentsAfterInterleavedWrites(
      (*mount)->path() + "/hint.raw", std::nullopt);
  const uint64_t without_hint =
      ExtentsAfterInterleavedWrites((*mount)->path() + "/nohint.raw", 0);
  std::cout << "extents after interleaved writes on " << (kImageSize >> 20)
            << " MiB: default hint " << with_hint << ", hint 0 "
            << without_hint << "\n";
  RecordProperty("extents_default_hint", static_cast<int>(with_hint));
  RecordProperty("extents_no_hint", static_cast<int>(without_hint));
  ASSERT_GT(with_hint, 0u);
  EXPECT_GE(without_hint, 10 * with_hint)
      << "default hint: " << with_hint << " extents, hint 0: " << without_hint;
  // One 1 MiB hint extent per MiB written, give or take the first block.
  EXPECT_LE(with_hint, 2 * (kImageSize >> 20));
}

}  // namespace
}  // namespace imgtool::benchmarks
