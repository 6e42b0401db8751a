// Request order: concurrent allocating writes reach the image file in the
// order they allocated their clusters (ascending host offsets for a
// sequential stream), as with QEMU. The bench's unaligned case
// (bench -d 64 -o 1k -s 64k) used to reach the file in reverse order per
// batch of waiters for the metadata lock, and as 95 host writes (63 KiB +
// 1 KiB splits) instead of one each.
#include <algorithm>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/task.h"
#include "prealloc_filter/prealloc_filter.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::Pattern;
using testing::Shell;
using testing::TempPath;

struct Request {
  bool zeroes;  // write zeroes, else a write (or a flush)
  uint64_t offset;
  uint64_t length;
  bool flush = false;
  int writes_done_before = 0;  // writes finished when this one started
};

// Records every write, write zeroes and flush when it starts. With
// `zeroes_unsupported`, write zeroes fail with kUnimplemented like on a file
// that cannot zero efficiently (e.g. a block device, unaligned ranges).
class RecordingNode final : public testing::ForwardingNode {
 public:
  RecordingNode(std::unique_ptr<io::BlockNode> target,
                std::vector<Request>* log, bool zeroes_unsupported = false)
      : ForwardingNode(std::move(target)),
        log_(log),
        zeroes_unsupported_(zeroes_unsupported) {}

  // The next write at file offset `offset` fails (kDataLoss) once it has
  // been written.
  void FailWriteAt(uint64_t offset) { fail_write_at_ = offset; }

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    log_->push_back({false, offset, data.size(), false, writes_done_});
    absl::Status st = co_await ForwardingNode::DoWrite(offset, data);
    ++writes_done_;
    if (st.ok() && offset == fail_write_at_) {
      fail_write_at_ = ~uint64_t{0};
      st = absl::DataLossError("injected write error");
    }
    co_return st;
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    log_->push_back({true, offset, length});
    if (zeroes_unsupported_) return Unsupported();
    return ForwardingNode::DoWriteZeroes(offset, length, flags);
  }
  io::Task<absl::Status> DoFlush() override {
    log_->push_back({false, 0, 0, /*flush=*/true});
    const bool fail = ++flushes_ == fail_flush_;
    if (hold_flushes_) {
      auto gate = std::make_shared<io::Event>();
      held_.push_back(gate);
      co_await gate->Wait();
    }
    if (fail) co_return absl::DataLossError("injected flush error");
    co_return co_await ForwardingNode::DoFlush();
  }

 public:
  // Flushes wait (before they reach the file) until ReleaseFlushes: a
  // flush that takes as long as everything else in flight.
  void HoldFlushes(bool hold) { hold_flushes_ = hold; }
  // Flush number `n` (counting from 1 at the first) fails (kDataLoss)
  // without reaching the file.
  void FailFlush(int n) { fail_flush_ = n; }
  // Lets the flushes held so far go on; false if there were none.
  bool ReleaseFlushes() {
    std::vector<std::shared_ptr<io::Event>> held;
    held.swap(held_);
    for (const std::shared_ptr<io::Event>& gate : held) gate->Set();
    return !held.empty();
  }

 private:
  static io::Task<absl::Status> Unsupported() {
    co_return absl::UnimplementedError("write zeroes");
  }

  std::vector<Request>* log_;
  const bool zeroes_unsupported_;
  bool hold_flushes_ = false;
  int flushes_ = 0;
  int fail_flush_ = 0;
  std::vector<std::shared_ptr<io::Event>> held_;
  int writes_done_ = 0;
  uint64_t fail_write_at_ = ~uint64_t{0};
};

// Data clusters start after the header, the refcount table and block, the
// L1 table and the new L2 table.
constexpr uint64_t kCluster = 65536;
constexpr uint64_t kDataStart = 5 * kCluster;

// Opens qcow2 image `path` over a RecordingNode logging into `log`.
absl::StatusOr<std::unique_ptr<Qcow2Node>> OpenRecorded(
    Env& env, const std::string& path, std::vector<Request>* log,
    bool zeroes_unsupported = false) {
  absl::StatusOr<std::unique_ptr<io::BlockNode>> file =
      env.OpenFile(path, /*read_only=*/false);
  if (!file.ok()) return file.status();
  return env.Run(Qcow2Node::Open(
      std::make_unique<RecordingNode>(*std::move(file), log,
                                      zeroes_unsupported),
      Qcow2OpenOptions(), nullptr));
}

// The requests of `log` at or past file offset `from` (the data clusters).
std::vector<Request> From(const std::vector<Request>& log, uint64_t from) {
  std::vector<Request> out;
  for (const Request& r : log) {
    if (r.offset >= from) out.push_back(r);
  }
  return out;
}

// Whether qcow2 image `path` passes qemu-img check and reads as `ref`.
void ExpectImage(const std::string& path, const std::vector<uint8_t>& ref) {
  EXPECT_EQ(Shell("qemu-img check -q " + path).exit_code, 0);
  const std::string raw = path + ".raw";
  EXPECT_EQ(Shell("qemu-img convert -O raw " + path + " " + raw).exit_code, 0);
  EXPECT_TRUE(testing::ReadFile(raw) == ref);
}

// Creates qcow2 image `path` (64 MiB, qemu-img create `options`) and fills
// the file from 320 KiB to 1344 KiB with 0xee, where its data clusters go:
// new clusters must not show it.
void CreateOverGarbage(const std::string& path, const std::string& options) {
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + options + " " + path +
                  " 64M && truncate -s 2M " + path +
                  " && qemu-io -f raw -c 'write -P 0xee 320k 1M' " + path +
                  " >/dev/null")
                .exit_code,
            0);
}

// Writes buffers[i] at `start` + i * `stride` on `node`, all started at
// once, and runs `env` until they finished: write `failing` must fail
// (kDataLoss), the others succeed. false if the engine failed.
bool WriteAllAtOnce(Env& env, io::BlockNode& node,
                    const std::vector<std::vector<uint8_t>>& buffers,
                    uint64_t start, uint64_t stride, int failing = -1) {
  size_t done = 0;
  for (size_t i = 0; i < buffers.size(); ++i) {
    io::Spawn(node.Write(start + i * stride, io::ConstIoVec(buffers[i])),
              [&, i](absl::Status st) {
                if (static_cast<int>(i) == failing) {
                  EXPECT_TRUE(absl::IsDataLoss(st)) << st;
                } else {
                  EXPECT_TRUE(st.ok()) << i << ": " << st;
                }
                ++done;
              });
  }
  while (done < buffers.size()) {
    absl::Status st = env.engine().Poll(true);
    EXPECT_TRUE(st.ok()) << st;
    if (!st.ok()) return false;
  }
  return true;
}

// 64 concurrent 64 KiB writes at 1 KiB past each cluster start (the
// preallocate benchmark's unaligned case), started at once. On one I/O
// thread, so that requests complete in the order they were submitted and
// the order qcow2 sends its requests in is its own: with more threads (or
// io_uring's workers) a loaded machine reorders the zeroing of new
// clusters, and the writes that follow each zeroing with it.
std::vector<Request> RunUnalignedBatch(const std::string& name) {
  Env env(io::EngineKind::kThreads, /*depth=*/1);
  const std::string path = TempPath(name);
  constexpr int kWrites = 64;
  EXPECT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 64M").exit_code,
            0);
  std::vector<Request> log;
  auto node = OpenRecorded(env, path, &log);
  EXPECT_TRUE(node.ok()) << node.status();
  if (!node.ok()) return log;
  std::vector<std::vector<uint8_t>> buffers;
  for (int i = 0; i < kWrites; ++i) {
    buffers.push_back(Pattern(kCluster, 7 + i));
  }
  if (!WriteAllAtOnce(env, **node, buffers, 1024, kCluster)) return log;
  EXPECT_TRUE(env.Run((*node)->Close()).ok());
  std::vector<uint8_t> ref(64 << 20, 0);
  for (int i = 0; i < kWrites; ++i) {
    std::copy(buffers[i].begin(), buffers[i].end(),
              ref.begin() + i * kCluster + 1024);
  }
  ExpectImage(path, ref);
  return log;
}

TEST(WriteOrderTest, ConcurrentAllocatingWritesReachTheFileInOrder) {
  const std::vector<Request> log = RunUnalignedBatch("write_order.qcow2");
  // Per kind of request (zeroing of the new clusters, the data written
  // into clusters it zeroed), host offsets strictly ascend. Before: strictly
  // descending in each batch of writes that queued behind the metadata lock.
  // The writes that waited for clusters others allocated go in the order
  // those allocations end.
  enum Kind { kZeroes, kAllocating, kWaited };
  static constexpr const char* kNames[] = {"zeroes", "allocating write"};
  std::map<std::pair<Kind, uint64_t>, std::vector<uint64_t>> by_kind;
  int data_requests = 0;
  std::set<uint64_t> zeroed;  // where write zeroes started
  for (const Request& r : log) {
    if (r.offset < kDataStart) continue;  // metadata
    Kind kind = kWaited;
    if (r.zeroes) {
      kind = kZeroes;
      zeroed.insert(r.offset);
    } else if (zeroed.count(r.offset - 1024) != 0) {
      kind = kAllocating;
    }
    by_kind[{kind, r.length}].push_back(r.offset);
    ++data_requests;
  }
  EXPECT_GE(data_requests, 64);
  // Allocating writes: 64 KiB of data 1 KiB into a new cluster (32 or more).
  const std::pair<Kind, uint64_t> allocating_data(kAllocating, 65536);
  EXPECT_GE(by_kind[allocating_data].size(), 32u);
  for (const auto& [kind, offsets] : by_kind) {
    if (kind.first == kWaited) continue;
    for (size_t i = 1; i < offsets.size(); ++i) {
      EXPECT_LT(offsets[i - 1], offsets[i])
          << kNames[kind.first] << " of " << kind.second << " bytes, request "
          << i;
    }
  }
}

// The same batch: each write reaches the file as one 64 KiB host write at
// 1 KiB into guest cluster i's host cluster, and guest clusters 0..64 sit
// in consecutive host clusters (as qemu-img bench -d 64 -o 1k -s 64k:
// 10,093 host writes for 10,000). A write whose first cluster the write
// before it allocated (with its own) waits for the allocation of its next
// cluster, right after, instead of writing 63 KiB in place and then 1 KiB.
// Before: 95 host writes (31 pairs of 63 KiB + 1 KiB).
TEST(WriteOrderTest, ConcurrentUnalignedWritesAreOneHostWriteEach) {
  const std::vector<Request> log = RunUnalignedBatch("one_each.qcow2");
  std::vector<uint64_t> writes;
  std::vector<std::pair<uint64_t, uint64_t>> zeroes;
  for (const Request& r : From(log, kDataStart)) {
    if (r.zeroes) {
      zeroes.emplace_back(r.offset, r.length);
    } else {
      EXPECT_EQ(r.length, kCluster) << "write at " << r.offset;
      writes.push_back(r.offset);
    }
  }
  std::sort(writes.begin(), writes.end());
  ASSERT_EQ(writes.size(), 64u);
  for (uint64_t i = 0; i < 64; ++i) {
    EXPECT_EQ(writes[i], kDataStart + i * kCluster + 1024) << i;
  }
  // The new clusters are zeroed first: 65 clusters, each once, contiguous.
  std::sort(zeroes.begin(), zeroes.end());
  uint64_t next = kDataStart;
  for (const auto& [offset, length] : zeroes) {
    EXPECT_EQ(offset, next);
    next = offset + length;
  }
  EXPECT_EQ(next, kDataStart + 65 * kCluster);
}

// `writes` sequential 64 KiB writes at 1 KiB past each cluster start into a
// new image over garbage; returns the requests to its data clusters.
std::vector<Request> RunSequential(const std::string& name, int writes,
                                   bool zeroes_unsupported) {
  Env env;
  const std::string path = TempPath(name);
  CreateOverGarbage(path, "");
  std::vector<Request> log;
  auto node = OpenRecorded(env, path, &log, zeroes_unsupported);
  EXPECT_TRUE(node.ok()) << node.status();
  if (!node.ok()) return log;
  std::vector<uint8_t> ref(64 << 20, 0);
  for (int i = 0; i < writes; ++i) {
    const std::vector<uint8_t> buf = Pattern(kCluster, 3 + i);
    absl::Status st =
        env.Run((*node)->Write(i * kCluster + 1024, io::ConstIoVec(buf)));
    EXPECT_TRUE(st.ok()) << st;
    std::copy(buf.begin(), buf.end(), ref.begin() + i * kCluster + 1024);
  }
  EXPECT_TRUE(env.Run((*node)->Close()).ok());
  ExpectImage(path, ref);
  return From(log, kDataStart);
}

// A write at 1 KiB into a cluster written before (in place) that goes on
// into an unallocated cluster allocates that cluster right after the first
// one and writes once over both (QEMU's handle_copied + handle_alloc), as
// the bench's unaligned case at depth 1: one 64 KiB host write per guest
// write. Before: 63 KiB in place, then 1 KiB into the new cluster.
TEST(WriteOrderTest, SequentialUnalignedWritesAreOneHostWriteEach) {
  constexpr int kWrites = 16;
  const std::vector<Request> data =
      RunSequential("sequential.qcow2", kWrites, /*zeroes_unsupported=*/false);
  // Each write zeroes its new cluster(s), then writes its data.
  ASSERT_EQ(data.size(), 2u * kWrites);
  for (int i = 0; i < kWrites; ++i) {
    const Request& zeroes = data[2 * i];
    const Request& write = data[2 * i + 1];
    EXPECT_TRUE(zeroes.zeroes) << i;
    EXPECT_EQ(zeroes.offset, kDataStart + (i == 0 ? 0 : (i + 1) * kCluster))
        << i;
    EXPECT_EQ(zeroes.length, (i == 0 ? 2 : 1) * kCluster) << i;
    EXPECT_FALSE(write.zeroes) << i;
    EXPECT_EQ(write.offset, kDataStart + i * kCluster + 1024) << i;
    EXPECT_EQ(write.length, kCluster) << i;
  }
}

// Without efficient write zeroes the new clusters' zeroes are written as
// data: the first write copies on write (one request over both new
// clusters), each later one writes the tail of its new cluster as zeroes,
// then its data over both clusters (QEMU's handle_alloc_space fallback).
TEST(WriteOrderTest, WithoutWriteZeroesNewClustersGetZeroesAsData) {
  constexpr int kWrites = 4;
  const std::vector<Request> data =
      RunSequential("no_zeroes.qcow2", kWrites, /*zeroes_unsupported=*/true);
  ASSERT_EQ(data.size(), 2u + 3u * (kWrites - 1));
  // Zeroes refused, then head, data and tail as one write.
  EXPECT_TRUE(data[0].zeroes);
  EXPECT_EQ(data[0].offset, kDataStart);
  EXPECT_EQ(data[0].length, 2 * kCluster);
  EXPECT_FALSE(data[1].zeroes);
  EXPECT_EQ(data[1].offset, kDataStart);
  EXPECT_EQ(data[1].length, 2 * kCluster);
  for (int i = 1; i < kWrites; ++i) {
    // Zeroes refused, the new cluster's tail as zeroes, the data.
    const uint64_t new_host = kDataStart + (i + 1) * kCluster;
    const Request* r = &data[2 + 3 * (i - 1)];
    EXPECT_TRUE(r[0].zeroes) << i;
    EXPECT_EQ(r[0].offset, new_host) << i;
    EXPECT_EQ(r[0].length, kCluster) << i;
    EXPECT_FALSE(r[1].zeroes) << i;
    EXPECT_EQ(r[1].offset, new_host + 1024) << i;
    EXPECT_EQ(r[1].length, kCluster - 1024) << i;
    EXPECT_FALSE(r[2].zeroes) << i;
    EXPECT_EQ(r[2].offset, kDataStart + i * kCluster + 1024) << i;
    EXPECT_EQ(r[2].length, kCluster) << i;
  }
}

// The same with extended L2 entries: a write of part of a subcluster pads
// it with zeroes written as data.
TEST(WriteOrderTest, WithoutWriteZeroesSubclustersGetZeroesAsData) {
  Env env;
  const std::string path = TempPath("no_zeroes_extended.qcow2");
  CreateOverGarbage(path, "-o extended_l2=on");
  std::vector<Request> log;
  auto node = OpenRecorded(env, path, &log, /*zeroes_unsupported=*/true);
  ASSERT_TRUE(node.ok()) << node.status();
  const std::vector<uint8_t> buf = Pattern(1024, 5);
  ASSERT_TRUE(env.Run((*node)->Write(4096 + 512, io::ConstIoVec(buf))).ok());
  ASSERT_TRUE(env.Run((*node)->Close()).ok());
  std::vector<uint8_t> ref(64 << 20, 0);
  std::copy(buf.begin(), buf.end(), ref.begin() + 4096 + 512);
  ExpectImage(path, ref);
  const std::vector<Request> data = From(log, kDataStart);
  // Subcluster 2 (2 KiB subclusters) of the new cluster: zeroes refused,
  // then 512 bytes of zeroes, the data and 512 bytes of zeroes as one write.
  ASSERT_EQ(data.size(), 2u);
  EXPECT_TRUE(data[0].zeroes);
  EXPECT_EQ(data[0].offset, kDataStart + 4096);
  EXPECT_EQ(data[0].length, 2048u);
  EXPECT_FALSE(data[1].zeroes);
  EXPECT_EQ(data[1].offset, kDataStart + 4096);
  EXPECT_EQ(data[1].length, 2048u);
}

// `count` writes of `length` bytes each (pattern 20 + i) at offset
// `start` + i * `length`, all started at once on a new 64 MiB image, opened
// as qcow2 over the preallocate filter (the filter's preallocated tail
// reads as zeroes: zeroing new clusters there costs no request); returns
// the requests to its data clusters.
std::vector<Request> RunBatch(const std::string& name, int count,
                              uint64_t start, uint64_t length,
                              uint64_t fail_write_at = ~uint64_t{0},
                              int failing = -1) {
  Env env;
  const std::string path = TempPath(name);
  EXPECT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 64M").exit_code,
            0);
  std::vector<Request> log;
  absl::StatusOr<std::unique_ptr<io::BlockNode>> file =
      env.OpenFile(path, /*read_only=*/false);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return log;
  auto filter = env.Run(prealloc_filter::OpenPreallocFilter(
      *std::move(file), prealloc_filter::PreallocFilterOptions()));
  EXPECT_TRUE(filter.ok()) << filter.status();
  if (!filter.ok()) return log;
  auto recorder = std::make_unique<RecordingNode>(*std::move(filter), &log);
  recorder->FailWriteAt(fail_write_at);
  auto node = env.Run(
      Qcow2Node::Open(std::move(recorder), Qcow2OpenOptions(), nullptr));
  EXPECT_TRUE(node.ok()) << node.status();
  if (!node.ok()) return log;
  std::vector<std::vector<uint8_t>> buffers;
  std::vector<uint8_t> ref(64 << 20, 0);
  for (int i = 0; i < count; ++i) {
    buffers.push_back(Pattern(length, 20 + i));
    if (i == failing) continue;
    std::copy(buffers[i].begin(), buffers[i].end(),
              ref.begin() + start + i * length);
  }
  if (!WriteAllAtOnce(env, **node, buffers, start, length, failing)) {
    return log;
  }
  EXPECT_TRUE(env.Run((*node)->Close()).ok());
  ExpectImage(path, ref);
  return From(log, kDataStart);
}

// Concurrent writes into a cluster another write is allocating write their
// data beside it while it is in flight (its zeroes written, their ranges
// apart) and complete after it linked the cluster: 64 sequential 16 KiB
// writes started together reach the file as 64 adjacent writes in flight
// at once, in guest order, one zeroing per new cluster. Before (and in QEMU
// 7.2), the three later writes into each cluster waited for the first:
// 16 writes in flight, then the rest.
TEST(WriteOrderTest, WritesIntoAClusterBeingAllocatedGoBesideIt) {
  const std::vector<Request> data =
      RunBatch("beside.qcow2", 64, 0, 16384);
  std::vector<Request> writes;
  uint64_t zeroed_end = kDataStart;
  for (const Request& r : data) {
    if (r.zeroes) {
      EXPECT_EQ(r.offset, zeroed_end);
      EXPECT_EQ(r.length, kCluster);
      zeroed_end = r.offset + r.length;
    } else {
      writes.push_back(r);
    }
  }
  EXPECT_EQ(zeroed_end, kDataStart + 16 * kCluster);
  ASSERT_EQ(writes.size(), 64u);
  for (size_t i = 0; i < writes.size(); ++i) {
    EXPECT_EQ(writes[i].offset, kDataStart + i * 16384) << i;
    EXPECT_EQ(writes[i].length, 16384u) << i;
    // None of them had finished when the last one started (the writes
    // done before are the metadata the first allocation needed).
    EXPECT_EQ(writes[i].writes_done_before, writes[0].writes_done_before)
        << i;
  }
}

// The same for 64 KiB writes at 1 KiB past each cluster start: each write
// after the first writes 63 KiB beside the allocation of the write before
// and allocates the next cluster for its last 1 KiB, one host write each,
// all 64 in flight together and adjacent (one run of 4 MiB from 1 KiB into
// the first data cluster).
TEST(WriteOrderTest, UnalignedWritesGoBesideTheAllocationBefore) {
  const std::vector<Request> data =
      RunBatch("beside_unaligned.qcow2", 64, 1024, kCluster);
  std::vector<Request> writes;
  for (const Request& r : data) {
    if (!r.zeroes) writes.push_back(r);
  }
  ASSERT_EQ(writes.size(), 64u);
  for (size_t i = 0; i < writes.size(); ++i) {
    EXPECT_EQ(writes[i].offset, kDataStart + 1024 + i * kCluster) << i;
    EXPECT_EQ(writes[i].length, kCluster) << i;
    // None of them had finished when the last one started (the writes
    // done before are the metadata the first allocation needed).
    EXPECT_EQ(writes[i].writes_done_before, writes[0].writes_done_before)
        << i;
  }
}

// When the write that allocates a cluster fails after others wrote beside
// it, those write their data again into a cluster allocated anew, and the
// failed allocation's cluster is freed only after them: the failing write
// reports its error, the others succeed, and the image passes qemu-img check
// (no leak) and reads as the three later writes (RunBatch checks both).
TEST(WriteOrderTest, WritesBesideAFailedAllocationAreDoneAgain) {
  const std::vector<Request> data = RunBatch(
      "beside_failed.qcow2", 4, 0, 16384, /*fail_write_at=*/kDataStart,
      /*failing=*/0);
  std::vector<Request> writes;
  for (const Request& r : data) {
    if (!r.zeroes) writes.push_back(r);
  }
  // Four writes into the first data cluster, then the three later ones
  // again into the next.
  ASSERT_EQ(writes.size(), 7u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(writes[i].offset, kDataStart + i * 16384) << i;
  }
  std::vector<uint64_t> again;
  for (size_t i = 4; i < 7; ++i) again.push_back(writes[i].offset);
  std::sort(again.begin(), again.end());
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(again[i], kDataStart + kCluster + (i + 1) * 16384) << i;
  }
}

// A discarded cluster is allocated again by the next write (QEMU: the free
// lowers free_cluster_index), but only once the L2 table that no longer
// points to it is written and synced: a crash never leaves an L2 entry on
// disk pointing to the cluster that now holds another guest cluster's data.
TEST(WriteOrderTest, DiscardedClusterIsReusedAfterItsL2TableIsSynced) {
  Env env;
  const std::string path = TempPath("reuse.qcow2");
  ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + path + " 64M").exit_code,
            0);
  std::vector<Request> log;
  auto node = OpenRecorded(env, path, &log);
  ASSERT_TRUE(node.ok()) << node.status();
  const std::vector<uint8_t> first = Pattern(16 * kCluster, 1);
  ASSERT_TRUE(env.Run((*node)->Write(0, io::ConstIoVec(first))).ok());
  ASSERT_TRUE(env.Run((*node)->Discard(0, 16 * kCluster)).ok());
  log.clear();
  const std::vector<uint8_t> second = Pattern(kCluster, 2);
  ASSERT_TRUE(
      env.Run((*node)->Write(2 * kCluster, io::ConstIoVec(second))).ok());
  // The refcount block (at 128 KiB, raised by the first write) and a flush
  // before the L2 table (at 256 KiB) as always, a flush, then the data
  // into the first freed cluster (the file does not grow).
  constexpr uint64_t kRefcountBlock = 2 * kCluster;
  constexpr uint64_t kL2Table = 4 * kCluster;
  ASSERT_EQ(log.size(), 5u);
  for (int i : {0, 2, 4}) {
    EXPECT_FALSE(log[i].zeroes || log[i].flush) << i;
    EXPECT_EQ(log[i].length, kCluster) << i;
  }
  EXPECT_EQ(log[0].offset, kRefcountBlock);
  EXPECT_TRUE(log[1].flush);
  EXPECT_EQ(log[2].offset, kL2Table);
  EXPECT_TRUE(log[3].flush);
  EXPECT_EQ(log[4].offset, kDataStart);
  ASSERT_TRUE(env.Run((*node)->Close()).ok());
  std::vector<uint8_t> ref(64 << 20, 0);
  std::copy(second.begin(), second.end(), ref.begin() + 2 * kCluster);
  ExpectImage(path, ref);
  EXPECT_EQ(testing::ReadFile(path).size(), kDataStart + 16 * kCluster);
}

// 32 writes of 4 KiB, each into its own 2 MiB L2 table of 4 KiB clusters,
// started at once (`at_once`) or one after another. Returns the flushes
// qcow2 sent to its file (with `fail_flush`, that flush fails: the writes
// that fail must read back as zeroes, `failed` counts them); the image
// must pass qemu-img check and read back right.
int FlushesForNewTables(bool at_once, int fail_flush = 0,
                        int* failed = nullptr) {
  Env env(io::EngineKind::kThreads, /*depth=*/1);
  const std::string path =
      TempPath(at_once ? "tables_at_once.qcow2" : "tables_one_by_one.qcow2");
  EXPECT_EQ(Shell("qemu-img create -q -f qcow2 -o cluster_size=4k " + path +
                  " 64M").exit_code,
            0);
  constexpr int kWrites = 32;
  constexpr uint64_t kStride = 2 << 20;
  std::vector<Request> log;
  absl::StatusOr<std::unique_ptr<io::BlockNode>> file =
      env.OpenFile(path, /*read_only=*/false);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return -1;
  auto recorder = std::make_unique<RecordingNode>(*std::move(file), &log);
  RecordingNode* flushes_of = recorder.get();
  recorder->FailFlush(fail_flush);
  auto node = env.Run(
      Qcow2Node::Open(std::move(recorder), Qcow2OpenOptions(), nullptr));
  EXPECT_TRUE(node.ok()) << node.status();
  if (!node.ok()) return -1;
  std::vector<std::vector<uint8_t>> buffers;
  for (int i = 0; i < kWrites; ++i) buffers.push_back(Pattern(4096, 40 + i));
  if (at_once) {
    // Each flush ends only once nothing else is in flight (the slowest a
    // flush can be): the writes that wait for one all share the next.
    flushes_of->HoldFlushes(true);
    int done = 0;
    for (int i = 0; i < kWrites; ++i) {
      io::Spawn((*node)->Write(4096 + i * kStride, io::ConstIoVec(buffers[i])),
                [&, i](absl::Status st) {
                  if (fail_flush != 0 && absl::IsDataLoss(st)) {
                    ++*failed;
                    std::fill(buffers[i].begin(), buffers[i].end(), 0);
                  } else {
                    EXPECT_TRUE(st.ok()) << i << ": " << st;
                  }
                  ++done;
                });
    }
    while (done < kWrites) {
      if (env.engine().in_flight() == 0) {
        if (!flushes_of->ReleaseFlushes()) {
          ADD_FAILURE() << "stuck with " << done << " writes done";
          return -1;
        }
        continue;
      }
      EXPECT_TRUE(env.engine().Poll(true).ok());
    }
    flushes_of->HoldFlushes(false);
  } else {
    for (int i = 0; i < kWrites; ++i) {
      EXPECT_TRUE(env.Run((*node)->Write(4096 + i * kStride,
                                         io::ConstIoVec(buffers[i])))
                      .ok());
    }
  }
  const int flushes = static_cast<int>(
      std::count_if(log.begin(), log.end(), [](const Request& r) { return r.flush; }));
  EXPECT_TRUE(env.Run((*node)->Close()).ok());
  std::vector<uint8_t> ref(64 << 20, 0);
  for (int i = 0; i < kWrites; ++i) {
    std::copy(buffers[i].begin(), buffers[i].end(),
              ref.begin() + 4096 + i * kStride);
  }
  ExpectImage(path, ref);
  return flushes;
}

// One write at a time: QEMU 7.2's l2_allocate order, 3 flushes per new
// table (refcount block, the table, the L1 entry), as qemu-img.
TEST(WriteOrderTest, OneWriteAtATimeFlushesThreeTimesPerNewTable) {
  EXPECT_EQ(FlushesForNewTables(/*at_once=*/false), 3 * 32);
}

// Started together, the new tables share their flushes
// (Qcow2Node::AllocateL2Grouped); before, 96 as one at a time. The first
// write starts alone (QEMU's order, 3 flushes); the second writes its table
// and starts a flush; the other 30 write theirs meanwhile and share the
// next; the second, then the first of the 30 for all of them, link theirs
// with one L1 write and flush each: 3 + 1 + 1 + 1 + 1.
TEST(WriteOrderTest, WritesStartedTogetherShareTheFlushesOfTheirNewTables) {
  EXPECT_EQ(FlushesForNewTables(/*at_once=*/true), 7);
}

// The same with the shared flush of the 30 failing (the 5th, see above):
// those 30 writes fail, their tables are given back (no leak, no table
// linked), the other two stand.
TEST(WriteOrderTest, AFailedSharedFlushFailsTheWritesThatShareIt) {
  int failed = 0;
  EXPECT_EQ(FlushesForNewTables(/*at_once=*/true, /*fail_flush=*/5, &failed), 6);
  EXPECT_EQ(failed, 30);
}

}  // namespace
}  // namespace imgtool::qcow2
