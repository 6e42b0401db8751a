#include "prealloc_filter/testing/chain.h"

#include <functional>
#include <utility>
#include <vector>

#include "base/status_macros.h"
#include "io/task.h"
#include "posix_file/file_options.pb.h"

namespace imgtool::prealloc_filter::testing {

absl::StatusOr<Chain> OpenChain(qcow2::testing::Env& env,
                                const std::string& path,
                                const std::string& cache, bool with_filter,
                                const PreallocFilterOptions& options) {
  posix_file::FileOpenOptions o;
  o.set_filename(path);
  o.set_cache(cache);
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   posix_file::FileNode::Open(env.engine(), o, nullptr));
  Chain chain;
  chain.file = file.get();
  std::unique_ptr<io::BlockNode> below = std::move(file);
  if (with_filter) {
    ASSIGN_OR_RETURN(std::unique_ptr<PreallocFilterNode> filter,
                     env.Run(OpenPreallocFilter(std::move(below), options)));
    chain.filter = filter.get();
    below = std::move(filter);
  }
  ASSIGN_OR_RETURN(chain.qcow2, env.Run(qcow2::Qcow2Node::Open(
                                    std::move(below), qcow2::Qcow2OpenOptions(),
                                    env.Opener())));
  return chain;
}

absl::Status WriteSequential(qcow2::testing::Env& env, io::BlockNode& node,
                             uint64_t start, uint64_t length, int count,
                             int depth, uint64_t seed) {
  std::vector<std::vector<uint8_t>> buffers(count);
  int running = 0, next = 0;
  absl::Status first;
  std::function<void()> issue = [&] {
    while (running < depth && next < count && first.ok()) {
      const int i = next++;
      std::vector<uint8_t>& buf = buffers[i];
      buf = qcow2::testing::Pattern(length, seed + i);
      ++running;
      io::Spawn(node.Write(start + i * length, buf), [&, i](absl::Status st) {
        if (!st.ok() && first.ok()) first = st;
        buffers[i] = {};
        --running;
        issue();
      });
    }
  };
  issue();
  while (running > 0) RETURN_IF_ERROR(env.engine().Poll(/*wait=*/true));
  return first;
}

absl::StatusOr<uint64_t> ExtentCount(qcow2::testing::Env& env,
                                     const std::string& path) {
  posix_file::FileOpenOptions o;
  o.set_filename(path);
  o.set_read_only(true);
  o.set_force_share(true);
  ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                   posix_file::FileNode::Open(env.engine(), o, nullptr));
  absl::StatusOr<uint64_t> n = file->ExtentCount();
  RETURN_IF_ERROR(env.Run(file->Close()));
  return n;
}

}  // namespace imgtool::prealloc_filter::testing
