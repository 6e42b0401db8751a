// Crash consistency of the qcow2 driver: crash_writer runs a random
// write-heavy workload (64 requests in flight) on an image and is killed
// with SIGKILL at a random moment; then
//  * `qemu-img check` must find no corruption (leaks are allowed; with lazy
//    refcounts a dirty image may also have too-low refcounts and COPIED
//    flags that do not match them, nothing else; a dirty image is opened
//    by crash_writer once more and killed within 60 ms, which may land in
//    the refcount rebuild of the open),
//  * CheckQcow2 must report exactly what qemu-img check reports,
//  * repairing (CheckQcow2 -r all, or for a dirty image opening it
//    read-write, which rebuilds the refcounts) must leave an image that
//    `qemu-img check` finds clean (exit 0),
//  * the image must read: `qemu-img convert -O raw` succeeds and reading it
//    through Qcow2Node gives the same bytes,
//  * a read-write open with the file growing ahead (as imgtool's) and a
//    close must cut the hole a kill left after the data, if the writer had
//    grown the file ahead (it then carries posix_file::kGrownAheadMarker;
//    a hole tail otherwise, from discards or freed leaks, stays as QEMU
//    keeps it), down to the last
//    data or the end of the last refcounted cluster, whichever is later
//    (posix_file::FileNode::AdoptHoleTail; refcounted clusters past the end
//    of the file, which a kill can leave and no check looks at, count
//    too), leaving an image that qemu-img
//    check finds clean, that reads the same, and that `qemu-img resize
//    --preallocation=falloc` can grow when the cut reached its clusters.
// Configurations: cluster sizes 512, 4k, 64k, 2M; refcount_bits 16 and 1;
// lazy refcounts off and on; no backing file, a raw or a qcow2 one; and
// extended L2 entries at 64k and 2M; crash_writer's file growing its length
// 64 MiB or 1 MiB ahead of the data, or not (by seed).
//
// Environment: CRASH_SEED (default 1) picks configurations, kill times and
// workloads; CRASH_ITERATIONS scales the number of kills (default 56 mixed
// + 22 allocation-heavy); CRASH_ONLY=i runs iteration i alone (its
// configuration depends on CRASH_SEED only), CRASH_WRITER_SEED and
// CRASH_KILL_MS set its workload seed and kill time (to repeat a failure).
#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "posix_file/file_node.h"
#include "qcow2/check.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/testing/harness.h"

namespace imgtool::qcow2::testing {
namespace {

constexpr uint64_t kMiB = 1 << 20;

uint64_t EnvNumber(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  uint64_t n = 0;
  if (v == nullptr || !absl::SimpleAtoi(v, &n)) return fallback;
  return n;
}

std::string WriterPath() {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  const char* ws = std::getenv("TEST_WORKSPACE");
  if (srcdir == nullptr || ws == nullptr) return "qcow2/testing/crash_writer";
  return absl::StrCat(srcdir, "/", ws, "/qcow2/testing/crash_writer");
}

enum class Backing { kNone, kRaw, kQcow2 };

struct Config {
  uint64_t cluster_size = 65536;
  uint32_t refcount_bits = 16;
  bool lazy = false;
  bool extended_l2 = false;
  Backing backing = Backing::kNone;
  bool alloc = false;  // crash_writer mode
  uint64_t seed = 0;
  uint64_t kill_ms = 0;

  std::string Name() const {
    return absl::StrCat(alloc ? "alloc" : "mixed",
                        " cluster_size=", cluster_size,
                        " refcount_bits=", refcount_bits,
                        " lazy_refcounts=", lazy ? "on" : "off",
                        extended_l2 ? " extended_l2=on" : "", " backing=",
                        backing == Backing::kNone
                            ? "none"
                            : (backing == Backing::kRaw ? "raw" : "qcow2"),
                        " seed=", seed, " kill_after_ms=", kill_ms);
  }
};

// Starting virtual size: small enough for the disk, for `alloc` placed so
// that growing truncates move the L1 table.
uint64_t StartSize(const Config& c) {
  if (!c.alloc) return c.cluster_size == (2 * kMiB) ? 64 * kMiB : 32 * kMiB;
  switch (c.cluster_size) {
    case 512:
    case 4096:
      return 16 * kMiB;
    case 65536:
      return 1024 * kMiB - 4 * kMiB;  // L1 entry 1 ends at 1 GiB
    default:
      return 64 * kMiB;
  }
}

// Lines of a dirty (lazy refcounts) image that are expected: refcounts lower
// than the references, COPIED flags that disagree with such refcounts.
bool ExpectedDirtyLine(const std::string& line) {
  static const std::regex kLow(
      R"(ERROR cluster \d+ refcount=(\d+) reference=(\d+))");
  std::smatch m;
  if (std::regex_match(line, m, kLow)) {
    return std::stoull(m[1].str()) < std::stoull(m[2].str());
  }
  return line.rfind("ERROR OFLAG_COPIED ", 0) == 0 ||
         line.rfind("Leaked cluster ", 0) == 0;
}

// The L1 table's place in the image's header (qcow2 spec, "Header": l1_size
// at byte 36, 4 bytes; l1_table_offset at byte 40, 8 bytes; big-endian) and
// the virtual size (byte 24, 8 bytes).
struct L1Place {
  uint64_t size = 0;  // virtual size, bytes
  uint64_t entries = 0;
  uint64_t offset = 0;
};
L1Place ReadL1Place(const std::string& image) {
  uint8_t h[48] = {};
  L1Place p;
  const int fd = open(image.c_str(), O_RDONLY);
  if (fd < 0) return p;
  const bool ok = pread(fd, h, sizeof(h), 0) == sizeof(h);
  close(fd);
  if (!ok) return p;
  auto be = [&](int at, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | h[at + i];
    return v;
  };
  p.size = be(24, 8);
  p.entries = be(36, 4);
  p.offset = be(40, 8);
  return p;
}

// The dirty bit (incompatible feature bit 0) of the image's header.
bool IsDirty(const std::string& image) {
  uint8_t b = 0;
  const int fd = open(image.c_str(), O_RDONLY);
  if (fd < 0) return false;
  const bool ok = pread(fd, &b, 1, 79) == 1;
  close(fd);
  return ok && (b & 1) != 0;
}

class CrashTest : public ::testing::Test {
 protected:
  // Creates the backing file (if any) and the image; returns the image path.
  std::string CreateImages(const Config& c, int iteration) {
    const uint64_t size = StartSize(c);
    const std::string image =
        TempPath(absl::StrCat("crash", iteration, ".qcow2"));
    Qcow2CreateOptions o;
    o.set_size(size);
    o.set_cluster_size(c.cluster_size);
    o.set_refcount_bits(c.refcount_bits);
    o.set_lazy_refcounts(c.lazy);
    o.set_extended_l2(c.extended_l2);
    if (c.backing != Backing::kNone) {
      const bool raw = c.backing == Backing::kRaw;
      const std::string backing = TempPath(
          absl::StrCat("crash", iteration, raw ? ".base.raw" : ".base.qcow2"));
      // The backing file is a bit shorter or longer than the image.
      const uint64_t bsize = size - 4 * kMiB + (c.seed % 8) * kMiB;
      CommandResult r = RunCommand(absl::StrCat(
          "qemu-img create -q -f ", raw ? "raw" : "qcow2 -o cluster_size=4k",
          " ", backing, " ", bsize, " && qemu-io -f ", raw ? "raw" : "qcow2",
          " -c 'write -P 0x5a 0 1M' -c 'write -P 0x33 1000k 300k'",
          " -c 'write -P 0x77 ", bsize - 3 * kMiB, " 2M' ", backing));
      EXPECT_EQ(r.exit_code, 0) << r.err;
      o.set_backing_file(backing);
      o.set_backing_fmt(raw ? "raw" : "qcow2");
    }
    absl::Status st = env_.CreateImage(image, o);
    EXPECT_TRUE(st.ok()) << st;
    return image;
  }

  // Runs crash_writer on `image` and kills it after c.kill_ms.
  void RunAndKill(const Config& c, const std::string& image) {
    const std::string writer = WriterPath();
    const std::string err_path = image + ".stderr";
    const std::string seed = absl::StrCat(c.seed);
    const char* mode = c.alloc ? "alloc" : "mixed";
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_addopen(&actions, 2, err_path.c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&actions, 1, "/dev/null", O_WRONLY, 0);
    char* argv[] = {
        const_cast<char*>(writer.c_str()), const_cast<char*>(image.c_str()),
        const_cast<char*>(seed.c_str()), const_cast<char*>(mode), nullptr};
    pid_t pid = 0;
    const int rc =
        posix_spawn(&pid, writer.c_str(), &actions, nullptr, argv, environ);
    posix_spawn_file_actions_destroy(&actions);
    ASSERT_EQ(rc, 0) << "cannot start " << writer << ": " << strerror(rc);
    std::this_thread::sleep_for(std::chrono::milliseconds(c.kill_ms));
    kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    const std::vector<uint8_t> err = ReadFile(err_path);
    unlink(err_path.c_str());
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
        << "crash_writer ended before the kill (status " << status
        << "): " << std::string(err.begin(), err.end());
  }

  // A killed writer's requests still in the kernel keep its file (and its
  // locks) for a moment.
  void WaitUntilUnlocked(const std::string& image) {
    for (int i = 0; i < 200; ++i) {
      absl::StatusOr<std::unique_ptr<io::BlockNode>> f =
          env_.OpenFile(image, /*read_only=*/false);
      if (f.ok()) {
        ASSERT_TRUE(env_.Run((*f)->Close()).ok());
        return;
      }
      usleep(25000);
    }
    FAIL() << image << " stays locked";
  }

  // CheckQcow2 on the file; `messages` gets its problem lines.
  absl::StatusOr<CheckResult> OurCheck(const std::string& image,
                                       RepairMode mode, std::string* messages) {
    absl::StatusOr<std::unique_ptr<io::BlockNode>> file =
        env_.OpenFile(image, /*read_only=*/mode == RepairMode::kNone);
    if (!file.ok()) return file.status();
    std::ostringstream out;
    absl::StatusOr<CheckResult> r = env_.Run(CheckQcow2(**file, mode, out));
    absl::Status closed = env_.Run((*file)->Close());
    if (messages != nullptr) *messages = out.str();
    if (r.ok() && !closed.ok()) return closed;
    return r;
  }

  void VerifyAfterCrash(const Config& c, const std::string& image,
                        int iteration) {
    // 1. qemu-img check: no corruption, except stale refcounts of a dirty
    //    image with lazy refcounts.
    QemuCheck q = RunQemuCheck(image);
    ASSERT_TRUE(q.exit_code == 0 || q.exit_code == 2 || q.exit_code == 3)
        << "qemu-img check exit " << q.exit_code << "\n"
        << q.err << q.output;
    absl::StatusOr<std::unique_ptr<io::BlockNode>> probe =
        env_.OpenFile(image, /*read_only=*/true);
    ASSERT_TRUE(probe.ok()) << probe.status();
    uint8_t incompat[8] = {};
    ASSERT_TRUE(env_.Run((*probe)->Read(72, io::IoVec(incompat, 8))).ok());
    const bool dirty = (incompat[7] & 1) != 0;
    const bool corrupt_bit = (incompat[7] & 2) != 0;
    std::printf(
        "%d: %s: file %llu bytes%s, qemu-img check exit %d, %llu leaks, "
        "%llu corruptions\n",
        iteration, c.Name().c_str(),
        static_cast<unsigned long long>((*probe)->size()),
        dirty ? ", dirty" : "", q.exit_code,
        static_cast<unsigned long long>(q.leaks),
        static_cast<unsigned long long>(q.corruptions));
    ASSERT_TRUE(env_.Run((*probe)->Close()).ok());
    EXPECT_FALSE(corrupt_bit) << "the corrupt bit is set";
    EXPECT_EQ(q.check_errors, 0u) << q.err;
    if (!dirty) {
      EXPECT_EQ(q.corruptions, 0u) << "qemu-img check:\n" << q.err;
      EXPECT_NE(q.exit_code, 2) << q.err;
    } else {
      EXPECT_TRUE(c.lazy) << "dirty bit without lazy refcounts";
      for (absl::string_view line :
           absl::StrSplit(q.err, '\n', absl::SkipEmpty())) {
        EXPECT_TRUE(ExpectedDirtyLine(std::string(line)))
            << "unexpected problem in a dirty image: " << line;
      }
    }

    // 2. Our checker agrees with qemu-img check.
    std::string ours;
    absl::StatusOr<CheckResult> r = OurCheck(image, RepairMode::kNone, &ours);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_EQ(r->corruptions, q.corruptions);
    EXPECT_EQ(r->leaks, q.leaks);
    EXPECT_EQ(r->check_errors, q.check_errors);
    EXPECT_EQ(r->image_end_offset, q.image_end_offset);
    EXPECT_EQ(r->total_clusters, q.total_clusters);
    EXPECT_EQ(r->allocated_clusters, q.allocated_clusters);
    EXPECT_EQ(r->fragmented_clusters, q.fragmented_clusters);
    EXPECT_EQ(r->compressed_clusters, q.compressed_clusters);
    EXPECT_EQ(ours, q.err) << "CheckQcow2 lines differ from qemu-img check's";

    // 3. Repair, then qemu-img check finds nothing.
    if (dirty && iteration % 2 == 1) {
      // Opening a dirty image read-write rebuilds its refcounts.
      absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
          env_.OpenQcow2(image, /*read_only=*/false);
      ASSERT_TRUE(node.ok()) << node.status();
      absl::Status st = env_.Run((*node)->Close());
      ASSERT_TRUE(st.ok()) << st;
    } else {
      std::string repaired;
      absl::StatusOr<CheckResult> fixed =
          OurCheck(image, RepairMode::kAll, &repaired);
      ASSERT_TRUE(fixed.ok()) << fixed.status();
      EXPECT_EQ(fixed->corruptions, 0u) << repaired;
      EXPECT_EQ(fixed->leaks, 0u) << repaired;
      EXPECT_EQ(fixed->check_errors, 0u) << repaired;
    }
    QemuCheck after = RunQemuCheck(image);
    EXPECT_EQ(after.exit_code, 0) << "after repair:\n"
                                  << after.err << after.output;

    // 4. The image reads, through qemu-img and through Qcow2Node alike.
    const std::string qemu_raw = image + ".qemu.raw";
    const std::string our_raw = image + ".ours.raw";
    CommandResult conv = RunCommand(
        absl::StrCat("qemu-img convert -O raw ", image, " ", qemu_raw));
    ASSERT_EQ(conv.exit_code, 0) << conv.err;
    absl::StatusOr<std::unique_ptr<Qcow2Node>> node =
        env_.OpenQcow2(image, /*read_only=*/true);
    ASSERT_TRUE(node.ok()) << node.status();
    absl::Status dumped = env_.DumpToRaw(**node, our_raw);
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    ASSERT_TRUE(dumped.ok()) << dumped;
    EXPECT_EQ(FirstDifference(qemu_raw, our_raw), -1);
    unlink(our_raw.c_str());

    // 5. Opened read-write growing ahead, then closed: the hole after the
    //    data and the last refcounted cluster is cut.
    //    Refcounted clusters can lie past the end of the file after a kill
    //    (allocated, never written; no check looks there): then past them.
    const uint64_t before = FileLength(image);
    char value[8];
    const bool marked = getxattr(image.c_str(), posix_file::kGrownAheadMarker,
                                 value, sizeof(value)) >= 0;
    node = env_.OpenQcow2(image, /*read_only=*/true);
    ASSERT_TRUE(node.ok()) << node.status();
    absl::StatusOr<uint64_t> used_end = env_.Run((*node)->RefcountedEnd());
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    ASSERT_TRUE(used_end.ok()) << used_end.status();
    EXPECT_GE(*used_end, after.image_end_offset);
    const uint64_t keep = std::max(*used_end, LastDataEnd(image));
    node = env_.OpenQcow2(image, /*read_only=*/false, Qcow2OpenOptions(),
                          64 * kMiB);
    ASSERT_TRUE(node.ok()) << node.status();
    ASSERT_TRUE(env_.Run((*node)->Close()).ok());
    std::printf("%d: file %llu bytes%s, last refcounted cluster ends at "
                "%llu (image end offset %llu), cut to %llu\n",
                iteration, static_cast<unsigned long long>(before),
                marked ? " (grown ahead)" : "",
                static_cast<unsigned long long>(*used_end),
                static_cast<unsigned long long>(after.image_end_offset),
                static_cast<unsigned long long>(FileLength(image)));
    EXPECT_EQ(FileLength(image), marked ? std::min(before, keep) : before);
    EXPECT_LT(getxattr(image.c_str(), posix_file::kGrownAheadMarker, value,
                       sizeof(value)),
              0);
    QemuCheck cut = RunQemuCheck(image);
    EXPECT_EQ(cut.exit_code, 0) << "after the cut:\n" << cut.err << cut.output;
    conv = RunCommand(
        absl::StrCat("qemu-img convert -O raw ", image, " ", our_raw));
    ASSERT_EQ(conv.exit_code, 0) << conv.err;
    EXPECT_EQ(FirstDifference(qemu_raw, our_raw), -1);
    unlink(qemu_raw.c_str());
    unlink(our_raw.c_str());
    // Only where the hole was all that lay past the clusters: qemu-img 7.2
    // resize asserts (qcow2_refcount_area) on an image whose refcounted
    // clusters reach past the end of the file, as a kill can leave them.
    // The end is taken from the check of the cut image, the one resize
    // sees: qemu-img 7.2 resize --preallocation=falloc places the new
    // refcount structures and clusters after the last refcounted cluster
    // (qcow2_co_truncate), so free clusters at the end of the file make it
    // fail with "Failed to resize underlying file: Cannot use preallocation
    // for shrinking files" on images QEMU itself leaves that way (a
    // discard of the last clusters), which check calls clean.
    // Nor where the resize must grow the L1 table and the L1 table is the
    // last thing in the file: qemu-img 7.2 moves the L1 table first
    // (qcow2_grow_l1_table, into the first free clusters: a hole the
    // workload's own L1 moves left), frees the old one at the end, and so
    // places the new clusters before the end of the file, which it then
    // refuses to fallocate ("Cannot use preallocation for shrinking files";
    // qemu-img does the same to an image its own L1 growth left that way).
    const L1Place l1 = ReadL1Place(image);
    const uint64_t l2_span = c.cluster_size / (c.extended_l2 ? 16 : 8) *
                             c.cluster_size;
    const uint64_t new_entries =
        (l1.size + c.cluster_size + l2_span - 1) / l2_span;
    const uint64_t l1_end =
        l1.offset + (l1.entries * 8 + c.cluster_size - 1) / c.cluster_size *
                        c.cluster_size;
    const bool l1_moves_from_end =
        new_entries > l1.entries && l1_end == FileLength(image);
    if (l1_moves_from_end) {
      std::printf("%d: no resize check: the L1 table (%llu entries at %llu) "
                  "ends the file and must grow\n",
                  iteration, static_cast<unsigned long long>(l1.entries),
                  static_cast<unsigned long long>(l1.offset));
    }
    if (FileLength(image) < before && !l1_moves_from_end &&
        FileLength(image) == cut.image_end_offset) {
      const std::string map = RunCommand(absl::StrCat(
          "qemu-img map --output=json ", image, " | tail -3")).out;
      CommandResult grown = RunCommand(absl::StrCat(
          "qemu-img resize -q --preallocation=falloc ", image, " +",
          c.cluster_size));
      EXPECT_EQ(grown.exit_code, 0)
          << grown.err << "file " << FileLength(image)
          << " bytes before the resize; image end offset " << cut.image_end_offset
          << " (before the cut " << after.image_end_offset << ")\n"
          << cut.output << "\nqemu-img map, last lines:\n" << map;
    }
  }

  void RunIterations(bool alloc, int count, uint64_t seed) {
    // Every combination once, in an order drawn from the seed.
    std::vector<Config> all;
    for (uint64_t cs : {512, 4096, 65536, 2 * 1024 * 1024}) {
      for (uint32_t bits : {16, 1}) {
        for (bool lazy : {false, true}) {
          for (Backing b : {Backing::kNone, Backing::kRaw, Backing::kQcow2}) {
            Config c;
            c.cluster_size = cs;
            c.refcount_bits = bits;
            c.lazy = lazy;
            c.backing = b;
            c.alloc = alloc;
            all.push_back(c);
          }
        }
      }
    }
    // Extended L2 entries (subclusters) at 64k and 2M clusters.
    for (uint64_t cs : {65536, 2 * 1024 * 1024}) {
      for (bool lazy : {false, true}) {
        for (Backing b : {Backing::kNone, Backing::kQcow2}) {
          Config c;
          c.cluster_size = cs;
          c.lazy = lazy;
          c.extended_l2 = true;
          c.backing = b;
          c.alloc = alloc;
          all.push_back(c);
        }
      }
    }
    std::mt19937_64 rng(seed * 2 + (alloc ? 1 : 0));
    std::shuffle(all.begin(), all.end(), rng);
    for (int i = 0; i < count; ++i) {
      Config c = all[i % all.size()];
      c.seed = rng() % 1000000;
      c.kill_ms = 20 + rng() % 781;
      // Drawn for every iteration, used only for a dirty image: the
      // sequence of configurations depends on the seed alone.
      const uint64_t second_kill_ms = 1 + rng() % 60;
      // Reproducing one failure: CRASH_ONLY=i runs iteration i alone (the
      // same configuration), CRASH_WRITER_SEED and CRASH_KILL_MS override
      // its workload seed and kill time.
      if (const uint64_t only = EnvNumber("CRASH_ONLY", UINT64_MAX);
          only != UINT64_MAX && only != static_cast<uint64_t>(i)) {
        continue;
      }
      c.seed = EnvNumber("CRASH_WRITER_SEED", c.seed);
      c.kill_ms = EnvNumber("CRASH_KILL_MS", c.kill_ms);
      SCOPED_TRACE(c.Name());
      const std::string image = CreateImages(c, i);
      if (HasFatalFailure()) return;
      RunAndKill(c, image);
      if (HasFatalFailure()) return;
      if (c.lazy && IsDirty(image)) {
        // Again, killed early: opening the dirty image rebuilds its
        // refcounts (RebuildRefcounts), and the kill may land in that.
        Config again = c;
        again.kill_ms = second_kill_ms;
        WaitUntilUnlocked(image);
        SCOPED_TRACE(absl::StrCat(
            "second run on the dirty image, kill_after_ms=", again.kill_ms));
        RunAndKill(again, image);
        if (HasFatalFailure()) return;
      }
      VerifyAfterCrash(c, image, i);
      if (HasFailure()) {
        ADD_FAILURE() << "image kept at " << image;
        return;
      }
      RunCommand(absl::StrCat("rm -f ", image, " ", image, ".base.*"));
      unlink(TempPath(absl::StrCat("crash", i, ".base.raw")).c_str());
      unlink(TempPath(absl::StrCat("crash", i, ".base.qcow2")).c_str());
    }
  }

  Env env_;
};

TEST_F(CrashTest, KilledDuringMixedWorkloadLeavesNoCorruption) {
  RunIterations(/*alloc=*/false, EnvNumber("CRASH_ITERATIONS", 56),
                EnvNumber("CRASH_SEED", 1));
}

TEST_F(CrashTest, KilledDuringAllocationsAndL1GrowthLeavesNoCorruption) {
  RunIterations(/*alloc=*/true, EnvNumber("CRASH_ITERATIONS", 56) * 2 / 5,
                EnvNumber("CRASH_SEED", 1));
}

}  // namespace
}  // namespace imgtool::qcow2::testing
