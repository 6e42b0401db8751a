// Concurrent writes beside allocations in flight (qcow2_io.cc WriteStep,
// CanWriteBeside) while some of the file's requests fail: batches of up to
// 64 writes and reads started at once on disjoint byte ranges that share
// clusters (sequential sub-cluster runs, unaligned cluster-sized writes,
// writes over several clusters, in guest or reverse order), on images with
// and without a backing file, over the preallocate filter or not, on every
// engine, buffered and O_DIRECT. Zero writes of new clusters and unaligned
// data writes fail at random after reaching the file (an allocation failing
// before or after others wrote beside it). After each batch: every read
// shows what the writes that succeeded left; at the end the image passes
// `qemu-img check` with neither errors nor leaks (a failed allocation's
// clusters are freed, after the writes beside it) and reads, where no write
// failed, as those writes left it.
#include <algorithm>
#include <cstdint>
#include <iostream>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "gtest/gtest.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"
#include "posix_file/file_node.h"
#include "prealloc_filter/prealloc_filter.h"
#include "qcow2/qcow2_node.h"
#include "qcow2/test_util.h"

namespace imgtool::qcow2 {
namespace {

using testing::Env;
using testing::Pattern;
using testing::Shell;
using testing::TempPath;

constexpr uint64_t kSize = 8 << 20;

// Fails (kDataLoss, after passing them on) a random share of the zero
// writes and of the data writes at offsets not aligned to 512 bytes past
// the first cluster: only data, never metadata (tables, header fields and
// L1 sectors start 512-aligned or in the first cluster).
class FailingNode final : public testing::ForwardingNode {
 public:
  FailingNode(std::unique_ptr<io::BlockNode> target, uint64_t cluster_size,
              uint64_t seed, int per_mille)
      : ForwardingNode(std::move(target)),
        cluster_size_(cluster_size),
        rng_(seed),
        per_mille_(per_mille) {}

  int failed() const { return failed_; }

 protected:
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override {
    const bool fail =
        offset >= cluster_size_ && offset % 512 != 0 && Draw();
    absl::Status st = co_await ForwardingNode::DoWrite(offset, data);
    if (st.ok() && fail) {
      ++failed_;
      st = absl::DataLossError("injected write error");
    }
    co_return st;
  }
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override {
    const bool fail = Draw();
    absl::Status st =
        co_await ForwardingNode::DoWriteZeroes(offset, length, flags);
    if (st.ok() && fail) {
      ++failed_;
      st = absl::DataLossError("injected write zeroes error");
    }
    co_return st;
  }

 private:
  bool Draw() { return static_cast<int>(rng_() % 1000) < per_mille_; }

  const uint64_t cluster_size_;
  std::mt19937_64 rng_;
  const int per_mille_;
  int failed_ = 0;
};

struct Config {
  io::EngineKind engine;
  bool direct;
  uint64_t cluster_size;
  bool prealloc;
  bool backing;
  int per_mille;  // share of the requests FailingNode fails
};

void RunStress(const Config& config, uint64_t seed) {
  SCOPED_TRACE(::testing::Message()
               << "seed " << seed << " cluster " << config.cluster_size
               << " direct " << config.direct << " prealloc "
               << config.prealloc << " backing " << config.backing);
  Env env(config.engine);
  const std::string path = TempPath("stress.qcow2");
  const std::string base = TempPath("stress_base.qcow2");
  const std::string create = "qemu-img create -q -f qcow2 -o cluster_size=" +
                             std::to_string(config.cluster_size) + " ";
  ASSERT_EQ(Shell("rm -f " + path + " " + base).exit_code, 0);
  if (config.backing) {
    ASSERT_EQ(Shell("qemu-img create -q -f qcow2 " + base +
                    " 8M && qemu-io -f qcow2 -c 'write -P 0x77 0 8M' " + base +
                    " >/dev/null && " + create + "-F qcow2 -b " + base + " " +
                    path)
                  .exit_code,
              0);
  } else {
    ASSERT_EQ(Shell(create + path + " 8M").exit_code, 0);
  }
  std::mt19937_64 rng(seed);
  // What the image must read; `known` is 0 where a failed write left the
  // bytes undefined.
  std::vector<uint8_t> ref(kSize, config.backing ? 0x77 : 0);
  std::vector<uint8_t> known(kSize, 1);
  int failed = 0;
  {
    posix_file::FileOpenOptions options;
    options.set_filename(path);
    if (config.direct) options.set_cache("none");
    auto file = posix_file::FileNode::Open(env.engine(), options, nullptr);
    ASSERT_TRUE(file.ok()) << file.status();
    std::unique_ptr<io::BlockNode> lower = *std::move(file);
    if (config.prealloc) {
      auto filter = env.Run(prealloc_filter::OpenPreallocFilter(
          std::move(lower), prealloc_filter::PreallocFilterOptions()));
      ASSERT_TRUE(filter.ok()) << filter.status();
      lower = *std::move(filter);
    }
    auto failing = std::make_unique<FailingNode>(
        std::move(lower), config.cluster_size, seed * 7 + 1, config.per_mille);
    const FailingNode* injector = failing.get();
    auto node =
        env.Run(Qcow2Node::Open(std::move(failing), Qcow2OpenOptions(),
                                config.backing ? env.Opener() : nullptr));
    ASSERT_TRUE(node.ok()) << node.status();
    const uint64_t cluster = config.cluster_size;
    for (int batch = 0; batch < 30; ++batch) {
      struct Request {
        uint64_t offset, length;
        bool read;
        std::vector<uint8_t> data;
        absl::Status status;
      };
      std::vector<Request> requests;
      const int kind = static_cast<int>(rng() % 3);
      uint64_t at = rng() % kSize;
      for (int i = 0; i < 64; ++i) {
        uint64_t length;
        if (kind == 0) {
          length = 1 + rng() % (cluster * 5 / 16);  // a sequential stream
        } else if (kind == 1) {
          length = 1 + rng() % (3 * cluster);  // anywhere
          at = rng() % kSize;
        } else {
          length = cluster;  // a stream of unaligned whole clusters
        }
        if (at + length > kSize) at = rng() % (kSize / 2);
        const bool apart = std::none_of(
            requests.begin(), requests.end(), [&](const Request& r) {
              return at < r.offset + r.length && r.offset < at + length;
            });
        if (apart) {
          Request r{at, length, rng() % 8 == 0};
          r.data = r.read ? std::vector<uint8_t>(length, 0xee)
                          : Pattern(length, seed * 10000 + batch * 64 + i);
          requests.push_back(std::move(r));
        }
        at += length + (rng() % 4 == 0 ? rng() % 3000 : 0);
      }
      if (rng() % 2 == 0) std::reverse(requests.begin(), requests.end());
      int done = 0;
      for (Request& r : requests) {
        auto finish = [&done, &r](absl::Status st) {
          r.status = std::move(st);
          ++done;
        };
        if (r.read) {
          io::Spawn((*node)->Read(r.offset, io::IoVec(r.data)), finish);
        } else {
          io::Spawn((*node)->Write(r.offset, io::ConstIoVec(r.data)), finish);
        }
      }
      if (batch % 5 == 2) io::Spawn((*node)->Flush(), [](absl::Status) {});
      while (done < static_cast<int>(requests.size())) {
        ASSERT_TRUE(env.engine().Poll(true).ok());
      }
      for (const Request& r : requests) {
        if (r.read) {
          ASSERT_TRUE(r.status.ok()) << r.status;
          for (uint64_t j = 0; j < r.length; ++j) {
            const uint64_t i = r.offset + j;
            ASSERT_FALSE(known[i] && r.data[j] != ref[i])
                << "batch " << batch << ": byte " << i << " reads "
                << int{r.data[j]} << ", expected " << int{ref[i]};
          }
        } else if (r.status.ok()) {
          std::copy(r.data.begin(), r.data.end(), ref.begin() + r.offset);
          std::fill_n(known.begin() + r.offset, r.length, 1);
        } else {
          EXPECT_TRUE(absl::IsDataLoss(r.status)) << r.status;
          std::fill_n(known.begin() + r.offset, r.length, 0);
        }
      }
    }
    failed = injector->failed();
    absl::Status st = env.Run((*node)->Close());
    ASSERT_TRUE(st.ok()) << st;
  }
  if (config.per_mille > 0) {
    EXPECT_GT(failed, 0);
  }
  const testing::ShellResult check = Shell("qemu-img check " + path);
  EXPECT_EQ(check.exit_code, 0) << check.output;
  const std::string raw = path + ".raw";
  ASSERT_EQ(Shell("qemu-img convert -O raw " + path + " " + raw).exit_code, 0);
  const std::vector<uint8_t> image = testing::ReadFile(raw);
  ASSERT_EQ(image.size(), kSize);
  for (uint64_t i = 0; i < kSize; ++i) {
    ASSERT_FALSE(known[i] && image[i] != ref[i])
        << "byte " << i << " reads " << int{image[i]} << ", expected "
        << int{ref[i]};
  }
}

TEST(WriteFailureStressTest, WritesBesideAllocationsSurviveFailures) {
  uint64_t seed = 0;
  for (uint64_t cluster : {uint64_t{4096}, uint64_t{65536}}) {
    for (io::EngineKind engine :
         {io::EngineKind::kIoUring, io::EngineKind::kNative,
          io::EngineKind::kThreads}) {
      for (bool direct : {false, true}) {
        // Linux AIO needs O_DIRECT (buffered requests would block).
        if (engine == io::EngineKind::kNative && !direct) continue;
        ++seed;
        RunStress(Config{engine, direct, cluster, /*prealloc=*/seed % 2 == 0,
                   /*backing=*/seed % 3 == 0, /*per_mille=*/30},
            seed);
      }
    }
  }
}

TEST(WriteFailureStressTest, WritesBesideAllocationsWithoutFailures) {
  RunStress(Config{io::EngineKind::kIoUring, /*direct=*/false, 65536,
             /*prealloc=*/true, /*backing=*/false, /*per_mille=*/0},
      101);
  RunStress(Config{io::EngineKind::kIoUring, /*direct=*/true, 4096,
             /*prealloc=*/false, /*backing=*/true, /*per_mille=*/0},
      102);
}

}  // namespace
}  // namespace imgtool::qcow2
