#include "quorum_block/quorum_node.h"

#include <cerrno>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "base/errno_status.h"
#include "io/chain_status.h"

namespace imgtool::quorum_block {
namespace {

uint64_t SectorsOf(uint64_t bytes) { return bytes / 512 + (bytes % 512 != 0); }

}  // namespace

absl::StatusOr<QuorumSettings> CheckQuorumOptions(const QuorumOptions& options,
                                                  int num_children) {
  if (num_children < 1) {
    return absl::InvalidArgumentError(
        "Number of provided children must be 1 or more");
  }
  QuorumSettings s;
  // QEMU keeps the number in a C int.
  s.threshold = static_cast<int>(options.vote_threshold());
  if (s.threshold < 1) {
    return absl::InvalidArgumentError(
        "Parameter 'vote-threshold' expects a value >= 1");
  }
  if (s.threshold > num_children) {
    return absl::InvalidArgumentError(
        "threshold may not exceed children count");
  }
  if (!options.has_read_pattern() || options.read_pattern() == "quorum") {
    s.read_pattern = ReadPattern::kQuorum;
  } else if (options.read_pattern() == "fifo") {
    s.read_pattern = ReadPattern::kFifo;
  } else {
    return absl::InvalidArgumentError(
        "Please set read-pattern as fifo or quorum");
  }
  if (s.read_pattern == ReadPattern::kQuorum) {
    s.blkverify = options.blkverify();
    if (s.blkverify && (num_children != 2 || s.threshold != 2)) {
      return absl::InvalidArgumentError(
          "blkverify=on can only be set if there are exactly two files and "
          "vote-threshold is 2");
    }
    s.rewrite_corrupted = options.rewrite_corrupted();
    if (s.rewrite_corrupted && s.blkverify) {
      return absl::InvalidArgumentError(
          "rewrite-corrupted=on cannot be used with blkverify=on");
    }
  }
  return s;
}

absl::Status VoteOnErrors(absl::Span<const absl::Status> statuses) {
  // Groups in order of their first child; a later group wins a tie.
  struct Group {
    int error_number;
    int first;
    int count;
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < statuses.size(); ++i) {
    if (statuses[i].ok()) continue;
    const int e = StatusErrno(statuses[i]);
    bool found = false;
    for (Group& g : groups) {
      if (g.error_number == e) {
        ++g.count;
        found = true;
        break;
      }
    }
    if (!found) groups.push_back({e, static_cast<int>(i), 1});
  }
  if (groups.empty()) return absl::OkStatus();
  const Group* winner = &groups[0];
  for (const Group& g : groups) {
    if (g.count >= winner->count) winner = &g;
  }
  return statuses[winner->first];
}

VoteResult Vote(absl::Span<const ChildRead> reads,
                const QuorumSettings& settings, const std::string& filename) {
  VoteResult result;
  std::vector<absl::Status> statuses;
  int successes = 0;
  for (const ChildRead& r : reads) {
    statuses.push_back(r.status);
    if (r.status.ok()) ++successes;
  }
  if (successes < settings.threshold) {
    result.status = VoteOnErrors(statuses);
    return result;
  }
  int first = 0;
  while (!reads[first].status.ok()) ++first;
  const absl::Span<const uint8_t> a = reads[first].data;
  bool all_equal = true;
  for (size_t j = first + 1; j < reads.size() && all_equal; ++j) {
    if (!reads[j].status.ok()) continue;
    const absl::Span<const uint8_t> b = reads[j].data;
    if (settings.blkverify) {
      for (size_t k = 0; k < a.size(); ++k) {
        if (a[k] != b[k]) {
          result.mismatch = static_cast<int64_t>(k);
          break;
        }
      }
      if (result.mismatch >= 0) return result;  // the caller ends the process
      continue;
    }
    all_equal = std::memcmp(a.data(), b.data(), a.size()) == 0;
  }
  result.winner = first;
  if (all_equal) return result;

  // Groups of equal contents, in order of their first child; the largest
  // wins, ties to the group created last (QEMU inserts new versions at the
  // head of its list and takes the first with the most votes from there).
  struct Group {
    int first;
    std::vector<int> members;
  };
  std::vector<Group> groups;
  for (size_t i = 0; i < reads.size(); ++i) {
    if (!reads[i].status.ok()) continue;
    bool found = false;
    for (Group& g : groups) {
      const absl::Span<const uint8_t> d = reads[g.first].data;
      if (std::memcmp(d.data(), reads[i].data.data(), d.size()) == 0) {
        g.members.push_back(static_cast<int>(i));
        found = true;
        break;
      }
    }
    if (!found) groups.push_back({static_cast<int>(i), {static_cast<int>(i)}});
  }
  const Group* winner = &groups[0];
  for (const Group& g : groups) {
    if (g.members.size() >= winner->members.size()) winner = &g;
  }
  if (static_cast<int>(winner->members.size()) < settings.threshold) {
    result.winner = -1;
    result.status = ErrnoStatus(filename, "quorum vote", EIO);
    return result;
  }
  result.winner = winner->first;
  for (const Group& g : groups) {
    if (&g == winner) continue;
    result.losers.insert(result.losers.end(), g.members.begin(),
                         g.members.end());
  }
  return result;
}

absl::StatusOr<std::unique_ptr<QuorumNode>> QuorumNode::Open(
    std::vector<std::unique_ptr<io::BlockNode>>&& children,
    const QuorumSettings& settings, std::string name, bool read_only) {
  if (children.empty()) {
    return absl::InvalidArgumentError(
        "Number of provided children must be 1 or more");
  }
  const uint64_t sectors = SectorsOf(children[0]->size());
  for (const auto& child : children) {
    if (SectorsOf(child->size()) != sectors) {
      return ErrnoStatus("", "Could not refresh total sector count", EIO);
    }
  }
  const uint64_t size = children[0]->size();
  return std::unique_ptr<QuorumNode>(new QuorumNode(
      std::move(children), settings, std::move(name), size, read_only));
}

QuorumNode::QuorumNode(std::vector<std::unique_ptr<io::BlockNode>> children,
                       const QuorumSettings& settings, std::string name,
                       uint64_t size, bool read_only)
    : io::BlockNode(std::move(name), read_only),
      children_(std::move(children)),
      settings_(settings),
      size_(size) {}

absl::StatusOr<uint64_t> QuorumNode::AllocatedSize() const {
  uint64_t sum = 0;
  for (const auto& child : children_) {
    absl::StatusOr<uint64_t> n = child->AllocatedSize();
    if (!n.ok()) return n.status();
    sum += *n;
  }
  return sum;
}

absl::StatusOr<std::string> QuorumNode::Dirname() const {
  return absl::InvalidArgumentError(
      "Cannot generate a base directory for quorum nodes");
}

absl::Status QuorumNode::Tally(absl::Span<const absl::Status> statuses) const {
  int successes = 0;
  for (const absl::Status& st : statuses) successes += st.ok();
  if (successes >= settings_.threshold) return absl::OkStatus();
  return VoteOnErrors(statuses);
}

io::Task<absl::Status> QuorumNode::DoRead(uint64_t offset, io::IoVec buf) {
  if (settings_.read_pattern == ReadPattern::kFifo) {
    co_return co_await ReadFifo(offset, buf);
  }
  co_return co_await ReadQuorum(offset, buf);
}

io::Task<absl::Status> QuorumNode::ReadFifo(uint64_t offset, io::IoVec buf) {
  absl::Status st;
  for (const auto& child : children_) {
    st = co_await child->Read(offset, buf);
    if (st.ok()) break;
  }
  co_return st;
}

io::Task<absl::Status> QuorumNode::ReadQuorum(uint64_t offset,
                                              io::IoVec buf) {
  std::vector<std::vector<uint8_t>> copies(children_.size());
  std::vector<ChildRead> reads(children_.size());
  for (size_t i = 0; i < children_.size(); ++i) {
    copies[i].resize(buf.size());
    reads[i].status = co_await children_[i]->Read(
        offset, io::IoVec(copies[i].data(), copies[i].size()));
    reads[i].data = copies[i];
  }
  VoteResult vote = Vote(reads, settings_, filename());
  if (vote.mismatch >= 0) {
    // QEMU's blkverify mode ends the process here.
    std::cout.flush();
    std::fprintf(stderr,
                 "quorum: offset=%" PRIu64 " bytes=%" PRIu64
                 " contents mismatch at offset %" PRIu64 "\n",
                 offset, static_cast<uint64_t>(buf.size()),
                 offset + static_cast<uint64_t>(vote.mismatch));
    std::exit(1);
  }
  if (!vote.status.ok()) co_return vote.status;
  std::memcpy(buf.data(), copies[vote.winner].data(), buf.size());
  if (settings_.rewrite_corrupted) {
    for (int loser : vote.losers) {
      // A correction attempt only: its errors are not the read's.
      absl::Status st = co_await children_[loser]->Write(
          offset, io::ConstIoVec(buf.data(), buf.size()));
      st.IgnoreError();
    }
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> QuorumNode::DoWrite(uint64_t offset,
                                           io::ConstIoVec data) {
  std::vector<absl::Status> statuses;
  for (const auto& child : children_) {
    statuses.push_back(co_await child->Write(offset, data));
  }
  co_return Tally(statuses);
}

io::Task<absl::Status> QuorumNode::DoWriteZeroes(uint64_t offset,
                                                 uint64_t length,
                                                 io::WriteZeroesFlags flags) {
  std::vector<absl::Status> statuses;
  for (const auto& child : children_) {
    statuses.push_back(co_await child->WriteZeroes(offset, length, flags));
  }
  co_return Tally(statuses);
}

io::Task<absl::Status> QuorumNode::DoDiscard(uint64_t, uint64_t) {
  co_return absl::OkStatus();
}

io::Task<absl::Status> QuorumNode::DoFlush() {
  std::vector<absl::Status> statuses;
  for (const auto& child : children_) {
    statuses.push_back(co_await child->Flush());
  }
  co_return Tally(statuses);
}

io::Task<absl::Status> QuorumNode::DoTruncate(uint64_t, io::PreallocMode) {
  co_return absl::UnimplementedError(
      "Image format driver does not support resize");
}

io::Task<absl::StatusOr<io::BlockStatus>> QuorumNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  uint64_t zero_length = max_length;
  uint64_t data_length = 0;
  for (const auto& child : children_) {
    absl::StatusOr<io::ChainStatus> cs;
    if (offset < child->size()) {
      cs = co_await io::GetChainStatus(*child, offset, max_length);
    } else {
      // Past a child's end (within its last sector): reads as zeroes.
      cs = io::ChainStatus{};
      cs->status.length = max_length;
      cs->status.zero = true;
    }
    if (!cs.ok()) {
      data_length = max_length;
      break;
    }
    const bool zero = cs->status.zero || !cs->present;
    if (zero) {
      zero_length = std::min(zero_length, cs->status.length);
    } else {
      data_length = std::max(data_length, cs->status.length);
    }
  }
  io::BlockStatus status;
  if (data_length != 0) {
    status.data = true;
    status.length = data_length;
  } else {
    status.zero = true;
    status.length = zero_length;
  }
  co_return status;
}

io::Task<absl::Status> QuorumNode::Close() {
  absl::Status first;
  for (auto& child : children_) {
    absl::Status st = co_await child->Close();
    if (first.ok()) first = st;
  }
  co_return first;
}

}  // namespace imgtool::quorum_block
