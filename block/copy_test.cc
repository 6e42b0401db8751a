#include "block/copy.h"

#include <time.h>

#include <coroutine>
#include <cstdint>
#include <deque>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "base/zero.h"
#include "block/progress.h"
#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "io/testing/memory_node.h"

namespace imgtool::block {
namespace {

constexpr uint64_t kS = 512;

// A format-like node over bytes whose block status is given per 512-byte
// sector (data, zero or unallocated, the last reading from `backing`),
// logging every request it gets.
class FakeNode final : public io::BlockNode {
 public:
  enum State : char { kData = 'd', kZero = 'z', kUnallocated = '.' };

  // `layout`: one character per sector; the bytes of data sectors are
  // `fill` + sector index.
  FakeNode(std::string name, const std::string& layout, uint8_t fill,
           FakeNode* backing = nullptr)
      : BlockNode(std::move(name), /*read_only=*/false),
        layout_(layout),
        bytes_(layout.size() * kS, 0),
        backing_(backing) {
    for (size_t i = 0; i < layout.size(); ++i) {
      if (layout[i] == kData) {
        std::fill_n(bytes_.begin() + i * kS, kS,
                    static_cast<uint8_t>(fill + i));
      }
    }
  }

  uint64_t size() const override { return bytes_.size(); }
  io::BlockNode* backing() const override { return backing_; }
  io::Task<absl::Status> Close() override { co_return absl::OkStatus(); }

  // What the node reads, sector by sector (through its backing node).
  std::vector<uint8_t> Contents() const {
    std::vector<uint8_t> out(bytes_.size(), 0);
    for (size_t i = 0; i < layout_.size(); ++i) {
      if (layout_[i] == kData) {
        std::copy_n(bytes_.begin() + i * kS, kS, out.begin() + i * kS);
      } else if (layout_[i] == kUnallocated && backing_ != nullptr &&
                 (i + 1) * kS <= backing_->size()) {
        const std::vector<uint8_t> b = backing_->Contents();
        std::copy_n(b.begin() + i * kS, kS, out.begin() + i * kS);
      }
    }
    return out;
  }
  const std::string& layout() const { return layout_; }
  // "r<offset>+<len>", "w<offset>+<len>", "z<offset>+<len>" per request.
  const std::vector<std::string>& log() const { return log_; }
  void FailReadsAt(uint64_t offset) { fail_read_at_ = offset; }
  // Writes stay in flight (suspended, other requests going on) until
  // ResumeOneWrite() completes the oldest one.
  void DeferWrites() { defer_writes_ = true; }
  bool ResumeOneWrite() {
    if (deferred_.empty()) return false;
    const std::coroutine_handle<> h = deferred_.front();
    deferred_.pop_front();
    io::Resume(h);
    return true;
  }
  // Writes allocate whole units of this many sectors (qcow2's clusters,
  // the rest copied from the backing node) rather than the sectors written.
  void AllocateInUnits(uint64_t sectors) { unit_sectors_ = sectors; }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override {
    log_.push_back(absl::StrCat("r", offset, "+", buf.size()));
    if (fail_read_at_.has_value() && *fail_read_at_ >= offset &&
        *fail_read_at_ < offset + buf.size()) {
      co_return ErrnoStatus(filename(), "preadv", EIO);
    }
    const std::vector<uint8_t> all = Contents();
    std::copy_n(all.begin() + offset, buf.size(), buf.begin());
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    if (defer_writes_) co_await Deferred{this};
    log_.push_back(absl::StrCat("w", offset, "+", data.size()));
    std::copy(data.begin(), data.end(), bytes_.begin() + offset);
    Mark(offset, data.size(), kData);
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags) override {
    log_.push_back(absl::StrCat("z", offset, "+", length));
    std::fill_n(bytes_.begin() + offset, length, 0);
    Mark(offset, length, kZero);
    co_return absl::OkStatus();
  }
  io::Task<absl::Status> DoFlush() override { co_return absl::OkStatus(); }
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override {
    const size_t first = offset / kS;
    size_t end = first + 1;
    while (end < layout_.size() && layout_[end] == layout_[first] &&
           (end - first) * kS < max_length) {
      ++end;
    }
    io::BlockStatus st;
    st.length = std::min<uint64_t>((end - first) * kS, max_length);
    st.data = layout_[first] == kData;
    st.zero = layout_[first] == kZero;
    co_return st;
  }

 private:
  void Mark(uint64_t offset, uint64_t length, State state) {
    uint64_t first = offset / kS;
    uint64_t end = (offset + length + kS - 1) / kS;
    if (unit_sectors_ > 1) {
      // Copy-on-write of the rest of each unit touched.
      const std::vector<uint8_t> old = Contents();
      first = first / unit_sectors_ * unit_sectors_;
      end = std::min<uint64_t>((end + unit_sectors_ - 1) / unit_sectors_ *
                                   unit_sectors_,
                               layout_.size());
      for (uint64_t s = first; s < end; ++s) {
        if (s * kS < offset || s * kS >= offset + length) {
          std::copy_n(old.begin() + s * kS, kS, bytes_.begin() + s * kS);
          layout_[s] = kData;
        } else {
          layout_[s] = state;
        }
      }
      return;
    }
    for (uint64_t s = first; s < end; ++s) layout_[s] = state;
  }

  std::string layout_;
  std::vector<uint8_t> bytes_;
  FakeNode* backing_;
  std::vector<std::string> log_;
  struct Deferred {
    FakeNode* node;
    bool await_ready() const { return false; }
    void await_suspend(std::coroutine_handle<> h) {
      node->deferred_.push_back(h);
    }
    void await_resume() {}
  };

  std::optional<uint64_t> fail_read_at_;
  uint64_t unit_sectors_ = 1;
  bool defer_writes_ = false;
  std::deque<std::coroutine_handle<>> deferred_;
};

absl::Status RunCopy(std::vector<CopySource> sources, io::BlockNode& target,
                     const CopySettings& settings) {
  std::optional<absl::Status> st =
      io::testing::RunInline(Copy(std::move(sources), target, settings));
  if (!st.has_value()) return absl::InternalError("copy did not finish");
  return *st;
}

// The settings of qemu-img rebase's walk (CopySettings's "So `rebase...").
CopySettings RebaseSettings(io::BlockNode* reference, uint64_t step) {
  CopySettings settings;
  settings.reference = reference;
  settings.step_by_target_allocation = true;
  settings.progress_per_step = true;
  settings.zeroes_only_past_source_end = true;
  settings.zero_writes_may_unmap = false;
  settings.min_sparse_sectors = 0;
  settings.max_chunk = step;
  return settings;
}

CopySource Whole(FakeNode& node, uint64_t start = 0) {
  return CopySource{&node, start, node.size(), SourceView::kWholeChain,
                    nullptr};
}

std::vector<std::string> Writes(const FakeNode& node) {
  std::vector<std::string> out;
  for (const std::string& e : node.log()) {
    if (e[0] != 'r') out.push_back(e);
  }
  return out;
}

TEST(SectorRunTest, LeadingRunAlignsARunThatStopsEarly) {
  std::vector<uint8_t> buf(16 * kS, 0);
  std::fill_n(buf.begin(), 3 * kS, 1);  // 3 data sectors, then zeroes
  // Data extends to the next multiple of 8 sectors.
  SectorRun run = LeadingRun(buf.data(), 16, 0, 8);
  EXPECT_TRUE(run.data);
  EXPECT_EQ(run.sectors, 8u);
  // Starting at target sector 6, the run (3 sectors) is extended to end at
  // target sector 16.
  run = LeadingRun(buf.data(), 16, 6, 8);
  EXPECT_TRUE(run.data);
  EXPECT_EQ(run.sectors, 10u);
  // A zero run is cut back to the alignment.
  std::vector<uint8_t> z(16 * kS, 0);
  std::fill_n(z.begin() + 11 * kS, kS, 1);
  run = LeadingRun(z.data(), 16, 0, 8);
  EXPECT_FALSE(run.data);
  EXPECT_EQ(run.sectors, 8u);
}

TEST(SectorRunTest, DataOrHoleWritesShortGapsWithTheData) {
  std::vector<uint8_t> buf(32 * kS, 0);
  std::fill_n(buf.begin(), kS, 1);               // sector 0
  std::fill_n(buf.begin() + 9 * kS, kS, 1);      // sector 9 (gap of 8)
  std::fill_n(buf.begin() + 31 * kS, kS, 1);     // sector 31
  // min_zero 16: the 8-sector gap is written with the data, the long one
  // (16..31 after alignment) is not.
  SectorRun run = DataOrHole(buf.data(), 32, 0, 16, 1);
  EXPECT_TRUE(run.data);
  EXPECT_EQ(run.sectors, 10u);
  EXPECT_TRUE(IsZero(buf.data() + kS, 8 * kS));
  EXPECT_FALSE(IsZero(buf.data(), 8 * kS));
}

TEST(CopyTest, WholeChainNeverReadsZeroesAndSkipsThemOnAZeroTarget) {
  FakeNode base("base", "dddd....", 0x10);
  FakeNode top("top", "..zz..dd", 0x80, &base);
  FakeNode target("target", "........", 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.target_is_zero = true;
  ASSERT_TRUE(RunCopy({Whole(top)}, target, settings).ok());
  EXPECT_EQ(target.Contents(), top.Contents());
  // Sectors 0-1 from base, 2-3 zero (not written), 4-5 nowhere (zero),
  // 6-7 the top's data.
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+1024", "w3072+1024"}));
  // Only data was read: base's two sectors through the top, and the top's.
  EXPECT_EQ(top.log(), (std::vector<std::string>{"r0+1024", "r3072+1024"}));
}

TEST(CopyTest, ZeroRangesAreWrittenAsZeroesOnATargetThatMayHoldData) {
  FakeNode src("src", "dd..zzdd", 1);
  FakeNode target("target", "dddddddd", 0x77);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  EXPECT_EQ(target.Contents(), src.Contents());
  // One request per extent: the unallocated sectors 2-3, the zero 4-5.
  EXPECT_EQ(Writes(target),
            (std::vector<std::string>{"w0+1024", "z1024+1024", "z2048+1024",
                                      "w3072+1024"}));
}

TEST(CopyTest, ZeroRangesAsDataAreWrittenAsData) {
  FakeNode src("src", "dd..", 1);
  FakeNode target("target", "....", 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.zero_ranges_as_data = true;
  settings.target_is_zero = true;
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  EXPECT_EQ(target.layout(), "dddd");
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+1024", "w1024+1024"}));
}

TEST(CopyTest, ZeroDetectionInDataKeepsTheTargetSparse) {
  // The source's "data" sectors 2..9 hold zeroes: with -S 4k (8 sectors)
  // and alignment 8 they stay a hole.
  FakeNode src("src", "dddddddddddddddd", 1);
  std::vector<uint8_t> zero(8 * kS, 0);
  ASSERT_TRUE(io::testing::RunInline(src.Write(8 * kS, zero))->ok());
  FakeNode target("target", "................", 0);
  CopySettings settings;  // min_sparse_sectors 8, alignment 8
  settings.target_is_zero = true;
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  EXPECT_EQ(target.Contents(), src.Contents());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+4096"}));
}

TEST(CopyTest, ConcatenatesSources) {
  FakeNode a("a", "dd", 1);
  FakeNode b("b", ".d", 9);
  FakeNode target("target", "....", 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.target_is_zero = true;
  ASSERT_TRUE(RunCopy({Whole(a, 0), Whole(b, 2 * kS)}, target, settings).ok());
  std::vector<uint8_t> expected = a.Contents();
  const std::vector<uint8_t> bb = b.Contents();
  expected.insert(expected.end(), bb.begin(), bb.end());
  EXPECT_EQ(target.Contents(), expected);
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+1024", "w1536+512"}));
}

TEST(CopyTest, TopOnlyLeavesUnallocatedRangesToTheTargetsBacking) {
  FakeNode base("base", "dddd", 1);
  FakeNode top("top", "d..z", 5, &base);
  FakeNode target("target", "....", 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  CopySource s = Whole(top);
  s.view = SourceView::kTopOnly;
  ASSERT_TRUE(RunCopy({s}, target, settings).ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+512", "z1536+512"}));
}

TEST(CopyTest, AboveBaseCopiesDirtyGranulesAsTheChainReadsThem) {
  // Granules of 2 sectors. base <- mid <- top; commit top and mid into
  // base: granule 0 (top data in sector 1) is copied whole as data
  // (sector 0 from base), granule 1 nothing above base, granule 2 zero in
  // mid (a zero write), granule 3 mid's data.
  FakeNode base("base", "dddddddd", 0x10);
  FakeNode mid("mid", "....zzdd", 0x40, &base);
  FakeNode top("top", ".d......", 0x80, &mid);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.max_chunk = 1 << 20;
  settings.granularity = 2 * kS;
  settings.progress_counts_zero_ranges = true;
  const std::vector<uint8_t> view = top.Contents();
  CopySource s{&top, 0, top.size(), SourceView::kAboveBase, &base};
  ASSERT_TRUE(RunCopy({s}, base, settings).ok());
  EXPECT_EQ(base.Contents(), view);
  EXPECT_EQ(Writes(base), (std::vector<std::string>{"w0+1024", "z2048+1024",
                                                    "w3072+1024"}));
}

TEST(CopyTest, AboveBaseZeroesMixedWithDataInAGranuleAreCopiedAsData) {
  FakeNode base("base", "dddd", 0x10);
  FakeNode top("top", "zd..", 0x80, &base);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.granularity = 2 * kS;
  const std::vector<uint8_t> view = top.Contents();
  CopySource s{&top, 0, top.size(), SourceView::kAboveBase, &base};
  ASSERT_TRUE(RunCopy({s}, base, settings).ok());
  EXPECT_EQ(base.Contents(), view);
  EXPECT_EQ(Writes(base), (std::vector<std::string>{"w0+1024"}));
}

TEST(CopyTest, AboveBaseZeroRunsNotAlignedToTargetClustersAreData) {
  FakeNode base("base", "dddddddd", 0x10);
  FakeNode top("top", "..zz....", 0x80, &base);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.granularity = 2 * kS;
  settings.target_cluster_size = 4 * kS;
  CopySource s{&top, 0, top.size(), SourceView::kAboveBase, &base};
  ASSERT_TRUE(RunCopy({s}, base, settings).ok());
  EXPECT_EQ(Writes(base), (std::vector<std::string>{"w1024+1024"}));
  EXPECT_EQ(base.layout(), "dddddddd");
  EXPECT_TRUE(IsZero(base.Contents().data() + 2 * kS, 2 * kS));
}

TEST(CopyTest, ReferenceWritesOnlyWhatDiffersAndSkipsTargetAllocations) {
  // Rebase: old chain `old`, new chain `ref`, overlay `target` (allocates
  // sector 3 itself).
  FakeNode old_base("old", "dddd..", 0x10);
  FakeNode ref("new", "d.dd..", 0x10);  // sector 1 differs (zero), 2-3 same
  FakeNode target("overlay", "...d..", 0x99);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.zero_ranges_as_data = true;
  settings.reference = &ref;
  settings.skip_target_allocated = true;
  ASSERT_TRUE(RunCopy({Whole(old_base)}, target, settings).ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w512+512"}));
  // Sectors 4-5 are zero in both chains: neither is read there.
  for (const std::string& e : ref.log()) EXPECT_EQ(e.rfind("r4", 0), std::string::npos) << e;
  EXPECT_EQ(old_base.log(), (std::vector<std::string>{"r0+1536"}));
}

TEST(CopyTest, ReferenceWithDataOverOldZeroesWritesZeroes) {
  FakeNode old_base("old", "zz", 0);
  FakeNode ref("new", "dz", 0x20);
  FakeNode target("overlay", "..", 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.reference = &ref;
  ASSERT_TRUE(RunCopy({Whole(old_base)}, target, settings).ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"z0+512"}));
}

TEST(CopyTest, StepsSkipAClusterTheStepBeforeAllocated) {
  // Steps of 3 sectors over a target allocating 4-sector clusters: the
  // write of step [0, 3) allocates sector 3 too, so the next step starts
  // at 4 (qemu-img rebase's walk), even with 4 workers looking ahead.
  FakeNode old_base("old", "dddddddd", 1);
  FakeNode target("overlay", "........", 0, &old_base);
  target.AllocateInUnits(4);
  target.DeferWrites();  // the other workers run while a write is going
  CopySettings settings = RebaseSettings(nullptr, 3 * kS);
  settings.target_cluster_size = 4 * kS;
  settings.num_workers = 4;
  std::ostringstream out;
  Progress progress(true, 0.0f, out);
  settings.progress = &progress;
  std::optional<absl::Status> result;
  io::Spawn(Copy({Whole(old_base)}, target, settings),
            [&result](absl::Status st) { result = std::move(st); });
  while (!result.has_value() && target.ResumeOneWrite()) {
  }
  ASSERT_TRUE(result.has_value());
  ASSERT_TRUE(result->ok()) << *result;
  EXPECT_EQ(Writes(target),
            (std::vector<std::string>{"w0+1536", "w2048+1536"}));
  EXPECT_EQ(target.layout(), "dddddddd");
  EXPECT_EQ(target.Contents(), old_base.Contents());
  // 100 / (8 / 3) = 50 % per compared step.
  EXPECT_EQ(out.str(), "    (50.00/100%)\r    (100.00/100%)\r");
}

TEST(CopyTest, StepsWriteDifferingZeroDataAsDataAndZeroesPastTheSourceEnd) {
  // The source (2 sectors, the first one all zero bytes) is shorter than
  // the target; the reference has data everywhere.
  FakeNode old_base("old", "dd", 0);
  FakeNode ref("new", "dddd", 0x20);
  FakeNode target("overlay", "....", 0, &old_base);
  CopySettings settings = RebaseSettings(&ref, 4 * kS);
  ASSERT_TRUE(RunCopy({CopySource{&old_base, 0, 4 * kS,
                                  SourceView::kWholeChain, nullptr}},
                      target, settings)
                  .ok());
  EXPECT_EQ(Writes(target),
            (std::vector<std::string>{"w0+1024", "z1024+1024"}));
}

TEST(CopyTest, StepsWithoutASourceNodeCompareZeroes) {
  FakeNode ref("new", "d.", 0x20);
  FakeNode target("overlay", "..", 0);
  CopySettings settings = RebaseSettings(&ref, 4 * kS);
  ASSERT_TRUE(RunCopy({CopySource{nullptr, 0, 2 * kS,
                                  SourceView::kWholeChain, nullptr}},
                      target, settings)
                  .ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"z0+512"}));
  EXPECT_EQ(ref.log(), (std::vector<std::string>{"r0+512"}));
}

TEST(CopyTest, StepsWithoutAReferenceWriteTheNonZeroSectorsOnly) {
  // Flatten: sector 0 is data of zero bytes, sector 2 a hole.
  FakeNode old_base("old", "dd.dzz", 0);
  FakeNode target("overlay", "......", 0, &old_base);
  CopySettings settings = RebaseSettings(nullptr, 16 * kS);
  ASSERT_TRUE(RunCopy({Whole(old_base)}, target, settings).ok());
  EXPECT_EQ(Writes(target),
            (std::vector<std::string>{"w512+512", "w1536+512"}));
  // Holes and zero clusters are not read.
  EXPECT_EQ(old_base.log(),
            (std::vector<std::string>{"r0+1024", "r1536+512"}));
}

TEST(CopyTest, StepsSkipWhatNothingAboveAReferenceInTheChainAllocates) {
  // Rebase onto `base`, already below `mid` in the chain: only the sector
  // mid allocates is compared; the rest is never read.
  FakeNode base("base", "dddd", 1);
  FakeNode mid("mid", "d...", 0x40, &base);
  FakeNode target("overlay", "....", 0, &mid);
  CopySettings settings = RebaseSettings(&base, 4 * kS);
  std::ostringstream out;
  Progress progress(true, 0.0f, out);
  settings.progress = &progress;
  ASSERT_TRUE(RunCopy({Whole(mid)}, target, settings).ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+512"}));
  EXPECT_EQ(mid.log(), (std::vector<std::string>{"r0+512"}));
  EXPECT_EQ(base.log(), (std::vector<std::string>{"r0+512"}));
  EXPECT_EQ(out.str(), "    (100.00/100%)\r");
}

TEST(CopyTest, StepsSkipWhatTheTargetAllocates) {
  FakeNode old_base("old", "dddd", 1);
  FakeNode ref("new", "....", 0);
  FakeNode target("overlay", ".zd.", 0x70, &old_base);
  CopySettings settings = RebaseSettings(&ref, 4 * kS);
  ASSERT_TRUE(RunCopy({Whole(old_base)}, target, settings).ok());
  EXPECT_EQ(Writes(target), (std::vector<std::string>{"w0+512", "w1536+512"}));
  EXPECT_EQ(old_base.log(), (std::vector<std::string>{"r0+512", "r1536+512"}));
}

TEST(CopyTest, FailedOpTellsWhatFailed) {
  FakeNode old_base("old", "dd", 1);
  FakeNode ref("new", "dd", 2);
  FakeNode target("overlay", "..", 0, &old_base);
  ref.FailReadsAt(kS);
  absl::Status st =
      RunCopy({Whole(old_base)}, target, RebaseSettings(&ref, 4 * kS));
  EXPECT_EQ(FailedOp(st), CopyOp::kReadReference);
  EXPECT_EQ(st.message(), "error while reading at byte 0: Input/output error");
  old_base.FailReadsAt(0);
  st = RunCopy({Whole(old_base)}, target, RebaseSettings(&ref, 4 * kS));
  EXPECT_EQ(FailedOp(st), CopyOp::kRead);
  EXPECT_EQ(FailedOp(absl::InternalError("x")), CopyOp::kUnknown);
}

TEST(CopyTest, ReadErrorNamesTheByteAndStrerror) {
  FakeNode src("src", "dddddddd", 1);
  src.FailReadsAt(4 * kS);
  FakeNode target("target", "........", 0);
  CopySettings settings;
  settings.max_chunk = 2 * kS;
  settings.min_sparse_sectors = 0;
  absl::Status st = RunCopy({Whole(src)}, target, settings);
  EXPECT_EQ(st.message(), "error while reading at byte 2048: Input/output error");
  // In order: nothing at or after the failed chunk was written.
  for (const std::string& w : Writes(target)) {
    EXPECT_TRUE(w == "w0+1024" || w == "w1024+1024") << w;
  }
}

TEST(CopyTest, InOrderWritesWithManyWorkers) {
  FakeNode src("src", "dddddddddddddddd", 1);
  FakeNode target("target", "................", 0);
  CopySettings settings;
  settings.max_chunk = kS;
  settings.min_sparse_sectors = 0;
  settings.num_workers = 4;
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  std::vector<std::string> expected;
  for (int i = 0; i < 16; ++i) expected.push_back(absl::StrCat("w", i * kS, "+512"));
  EXPECT_EQ(Writes(target), expected);
}

TEST(CopyTest, ProgressIsAFractionOfTheBytesToWrite) {
  FakeNode src("src", "dddd....", 1);
  FakeNode target("target", "........", 0);
  std::ostringstream out;
  Progress progress(true, 1.0f, out);
  CopySettings settings;
  settings.max_chunk = 2 * kS;
  settings.min_sparse_sectors = 0;
  settings.target_is_zero = true;
  settings.progress = &progress;
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  EXPECT_EQ(out.str(), "    (50.00/100%)\r    (100.00/100%)\r");
}

TEST(RateLimiterTest, SlicesAsQemusRatelimit) {
  RateLimiter limiter(1000, 100'000'000);  // 100 bytes per 100 ms slice
  EXPECT_EQ(limiter.Account(50, 0), 0u);
  // 110 bytes dispatched in the slice: it stretches to 110 ms.
  EXPECT_EQ(limiter.Account(60, 10'000'000), 100'000'000u);
  // Still inside the stretched slice: 120 bytes -> 120 ms.
  EXPECT_EQ(limiter.Account(10, 110'000'000), 10'000'000u);
  // After it, a new slice starts.
  EXPECT_EQ(limiter.Account(10, 130'000'001), 0u);
  RateLimiter off(0);
  EXPECT_EQ(off.Account(1 << 30, 0), 0u);
}

TEST(CopyTest, RateLimitSlowsTheCopy) {
  // 640 KiB in 64 KiB writes at 1 MiB/s (quota 104857 bytes per 100 ms
  // slice): every second write waits 125 ms, the first two go at once.
  std::string layout(1280, 'd');
  FakeNode src("src", layout, 1);
  FakeNode target("target", std::string(1280, '.'), 0);
  CopySettings settings;
  settings.min_sparse_sectors = 0;
  settings.max_chunk = 64 << 10;
  settings.rate_limit = 1 << 20;
  struct timespec a, b;
  clock_gettime(CLOCK_MONOTONIC, &a);
  ASSERT_TRUE(RunCopy({Whole(src)}, target, settings).ok());
  clock_gettime(CLOCK_MONOTONIC, &b);
  const double seconds = (b.tv_sec - a.tv_sec) + (b.tv_nsec - a.tv_nsec) / 1e9;
  EXPECT_GE(seconds, 0.45);
  EXPECT_LT(seconds, 5.0);
  EXPECT_EQ(target.Contents(), src.Contents());
}

}  // namespace
}  // namespace imgtool::block
