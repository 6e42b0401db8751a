#include "blkdebug/blkdebug.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <optional>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/strip.h"
#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "base/status_macros.h"

namespace imgtool::blkdebug {
namespace {

using io::BlkdebugEvent;

constexpr uint64_t kSectorSize = 512;
constexpr uint64_t kIntMax = 0x7fffffff;

// QAPI's BlkdebugIOType names, in IoType's order.
constexpr absl::string_view kIoTypeNames[] = {
    "read", "write", "write-zeroes", "discard", "flush", "block-status"};

uint64_t Bit(IoType type) { return uint64_t{1} << static_cast<int>(type); }

constexpr uint64_t kDefaultIoTypes = (uint64_t{1} << 0) | (uint64_t{1} << 1) |
                                     (uint64_t{1} << 2) | (uint64_t{1} << 3) |
                                     (uint64_t{1} << 4);

// The keys of one section (QEMU's inject_error_opts / set_state_opts).
const std::vector<std::string>& SectionKeys(bool inject) {
  static const std::vector<std::string> kInject = {
      "event", "state", "iotype", "errno", "sector", "once", "immediately"};
  static const std::vector<std::string> kSetState = {"event", "state",
                                                      "new_state"};
  return inject ? kInject : kSetState;
}

absl::Status Invalid(absl::string_view message) {
  return absl::InvalidArgumentError(message);
}

// QemuOpts' number parsing (base/options.h; "-N" is -N).
absl::StatusOr<int64_t> ParseNumber(const std::string& key,
                                    const std::string& value) {
  ASSIGN_OR_RETURN(const uint64_t n, ParseNumberOption(key, value));
  return static_cast<int64_t>(n);
}

// QemuOpts' bool parsing (qapi_bool_parse).
absl::StatusOr<bool> ParseBool(const std::string& key,
                               const std::string& value) {
  if (value == "on" || value == "yes" || value == "true" || value == "y") {
    return true;
  }
  if (value == "off" || value == "no" || value == "false" || value == "n") {
    return false;
  }
  return Invalid(absl::StrCat("Parameter '", key, "' expects 'on' or 'off'"));
}

// One section's values, checked against its keys and turned into a rule.
absl::StatusOr<Rule> MakeRule(bool inject,
                              const std::map<std::string, std::string>& kv) {
  for (const auto& [key, value] : kv) {
    const auto& keys = SectionKeys(inject);
    if (std::find(keys.begin(), keys.end(), key) == keys.end()) {
      return Invalid(absl::StrCat("Invalid parameter '", key, "'"));
    }
  }
  Rule rule;
  rule.action = inject ? Rule::Action::kInjectError : Rule::Action::kSetState;
  auto get = [&](const char* key) -> const std::string* {
    auto it = kv.find(key);
    return it == kv.end() ? nullptr : &it->second;
  };
  auto number = [&](const char* key,
                    int64_t fallback) -> absl::StatusOr<int64_t> {
    const std::string* v = get(key);
    if (v == nullptr) return fallback;
    return ParseNumber(key, *v);
  };
  auto boolean = [&](const char* key) -> absl::StatusOr<bool> {
    const std::string* v = get(key);
    if (v == nullptr) return false;
    return ParseBool(key, *v);
  };
  // Values first (QemuOpts checks them when the section is read), then the
  // event (add_rule).
  ASSIGN_OR_RETURN(int64_t state, number("state", 0));
  rule.state = static_cast<int>(state);
  if (inject) {
    ASSIGN_OR_RETURN(int64_t error, number("errno", EIO));
    ASSIGN_OR_RETURN(int64_t sector, number("sector", -1));
    ASSIGN_OR_RETURN(rule.once, boolean("once"));
    ASSIGN_OR_RETURN(rule.immediately, boolean("immediately"));
    rule.error = static_cast<int>(error);
    rule.offset = sector == -1 ? -1 : sector * static_cast<int64_t>(kSectorSize);
  } else {
    ASSIGN_OR_RETURN(int64_t new_state, number("new_state", 0));
    rule.new_state = static_cast<int>(new_state);
  }
  const std::string* event = get("event");
  if (event == nullptr) return Invalid("Missing event name for rule");
  std::optional<BlkdebugEvent> parsed = io::ParseBlkdebugEvent(*event);
  if (!parsed.has_value()) {
    return Invalid(absl::StrCat("invalid parameter value: ", *event));
  }
  rule.event = *parsed;
  if (inject) {
    const std::string* iotype = get("iotype");
    if (iotype == nullptr) {
      rule.iotype_mask = kDefaultIoTypes;
    } else {
      const auto* it =
          std::find(std::begin(kIoTypeNames), std::end(kIoTypeNames), *iotype);
      if (it == std::end(kIoTypeNames)) {
        return Invalid(absl::StrCat("invalid parameter value: ", *iotype));
      }
      rule.iotype_mask = uint64_t{1} << (it - std::begin(kIoTypeNames));
    }
  }
  return rule;
}

// Sections of one kind, in order.
struct Sections {
  std::vector<std::map<std::string, std::string>> inject;
  std::vector<std::map<std::string, std::string>> set_state;
};

absl::StatusOr<std::vector<Rule>> RulesOf(const Sections& sections) {
  std::vector<Rule> rules;
  for (const auto& kv : sections.inject) {
    ASSIGN_OR_RETURN(Rule rule, MakeRule(true, kv));
    rules.push_back(std::move(rule));
  }
  for (const auto& kv : sections.set_state) {
    ASSIGN_OR_RETURN(Rule rule, MakeRule(false, kv));
    rules.push_back(std::move(rule));
  }
  return rules;
}

// sscanf-like matching of QEMU's config lines. "[NAME]" with NAME up to
// the first ']' (63 characters at most).
std::optional<std::string> GroupLine(const std::string& line) {
  if (line.empty() || line[0] != '[') return std::nullopt;
  const size_t close = line.find(']', 1);
  if (close == std::string::npos || close == 1) return std::nullopt;
  return line.substr(1, std::min<size_t>(close - 1, 63));
}

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// " KEY = \"VALUE\"": KEY (no spaces) and VALUE (up to the next quote); a
// line whose key is followed by anything else has an empty value, as
// QEMU's fallback " %63s = \"\"" gives. nullopt for a line of blanks.
std::optional<std::pair<std::string, std::string>> ValueLine(
    const std::string& line) {
  size_t i = 0;
  while (i < line.size() && IsSpace(line[i])) ++i;
  if (i == line.size()) return std::nullopt;
  size_t key_end = i;
  while (key_end < line.size() && !IsSpace(line[key_end])) ++key_end;
  std::string key = line.substr(i, std::min<size_t>(key_end - i, 63));
  size_t j = key_end;
  while (j < line.size() && IsSpace(line[j])) ++j;
  std::string value;
  if (j < line.size() && line[j] == '=') {
    ++j;
    while (j < line.size() && IsSpace(line[j])) ++j;
    if (j < line.size() && line[j] == '"') {
      const size_t end = line.find('"', j + 1);
      if (end != std::string::npos && end > j + 1) {
        value = line.substr(j + 1, std::min<size_t>(end - j - 1, 1023));
      }
    }
  }
  return std::make_pair(std::move(key), std::move(value));
}

bool IsIndex(absl::string_view s) {
  return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
    return c >= '0' && c <= '9';
  });
}

// The sections of one kind given as options (see RulesFromOptions).
absl::StatusOr<std::vector<std::map<std::string, std::string>>> OptionSections(
    const NodeOptions& node, const char* name) {
  std::vector<std::map<std::string, std::string>> out;
  auto it = node.children.find(name);
  if (it == node.children.end()) return out;
  const NodeOptions& group = it->second;
  bool list = !group.children.empty();
  for (const auto& [key, child] : group.children) {
    if (!IsIndex(key)) list = false;
  }
  if (!list) {
    if (!group.children.empty()) {
      return Invalid(absl::StrCat("Invalid parameter '",
                                  group.children.begin()->first, "'"));
    }
    out.push_back(group.values);
    return out;
  }
  if (!group.values.empty()) {
    return Invalid(
        absl::StrCat("Invalid parameter '", group.values.begin()->first, "'"));
  }
  std::map<uint64_t, const NodeOptions*> by_index;
  for (const auto& [key, child] : group.children) {
    uint64_t index = 0;
    if (!absl::SimpleAtoi(key, &index)) {
      return Invalid(absl::StrCat("Invalid parameter '", key, "'"));
    }
    by_index[index] = &child;
  }
  for (const auto& [index, child] : by_index) {
    if (!child->children.empty()) {
      return Invalid(absl::StrCat("Invalid parameter '",
                                  child->children.begin()->first, "'"));
    }
    out.push_back(child->values);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<Rule>> ParseConfigFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    const int error_number = errno;
    return WithMessage(
        ErrnoStatus(path, "open", error_number),
        absl::StrCat("Could not read blkdebug config file: ",
                     std::strerror(error_number)));
  }
  Sections sections;
  std::map<std::string, std::string>* current = nullptr;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (std::optional<std::string> group = GroupLine(line)) {
      // "[group \"id\"]" names an id: blkdebug's groups take none, and
      // the group name is the first word.
      std::string name = group->substr(0, group->find(' '));
      if (name == "inject-error") {
        current = &sections.inject.emplace_back();
      } else if (name == "set-state") {
        current = &sections.set_state.emplace_back();
      } else {
        return Invalid(
            absl::StrCat("There is no option group '", name, "'"));
      }
      continue;
    }
    std::optional<std::pair<std::string, std::string>> kv = ValueLine(line);
    if (!kv.has_value()) return Invalid("parse error");
    if (current == nullptr) return Invalid("no group defined");
    (*current)[kv->first] = kv->second;
  }
  return RulesOf(sections);
}

absl::StatusOr<std::vector<Rule>> RulesFromOptions(const NodeOptions& node) {
  Sections sections;
  ASSIGN_OR_RETURN(sections.inject, OptionSections(node, "inject-error"));
  ASSIGN_OR_RETURN(sections.set_state, OptionSections(node, "set-state"));
  return RulesOf(sections);
}

absl::Status ParseBlkdebugFilename(absl::string_view filename,
                                   NodeOptions* node) {
  absl::string_view rest = filename;
  if (!absl::ConsumePrefix(&rest, "blkdebug:")) {
    node->values["x-image"] = std::string(filename);
    return absl::OkStatus();
  }
  const size_t colon = rest.find(':');
  if (colon == absl::string_view::npos) {
    return Invalid("blkdebug requires both config file and image path");
  }
  if (colon > 0) node->values["config"] = std::string(rest.substr(0, colon));
  node->values["x-image"] = std::string(rest.substr(colon + 1));
  return absl::OkStatus();
}

absl::Status ValidateOptions(const BlkdebugOptions& options,
                             uint64_t image_request_alignment) {
  auto fail = [](const char* name, uint64_t v) {
    return Invalid(absl::StrCat("Cannot meet constraints with ", name, " ", v));
  };
  const uint64_t a = options.align();
  if (a != 0 && (a >= kIntMax || (a & (a - 1)) != 0)) return fail("align", a);
  const uint64_t align = std::max<uint64_t>(a, image_request_alignment);
  auto check = [](const char*, uint64_t v, uint64_t unit) {
    return v != 0 && (v >= kIntMax || v % unit != 0);
  };
  if (check("max-transfer", options.max_transfer(), align)) {
    return fail("max-transfer", options.max_transfer());
  }
  if (check("opt-write-zero", options.opt_write_zero(), align)) {
    return fail("opt-write-zero", options.opt_write_zero());
  }
  if (check("max-write-zero", options.max_write_zero(),
            std::max<uint64_t>(options.opt_write_zero(), align))) {
    return fail("max-write-zero", options.max_write_zero());
  }
  if (check("opt-discard", options.opt_discard(), align)) {
    return fail("opt-discard", options.opt_discard());
  }
  if (check("max-discard", options.max_discard(),
            std::max<uint64_t>(options.opt_discard(), align))) {
    return fail("max-discard", options.max_discard());
  }
  return absl::OkStatus();
}

BlkdebugNode::BlkdebugNode(std::unique_ptr<io::BlockNode> image,
                           const BlkdebugOptions& options)
    : io::BlockNode(image->filename(), image->read_only()),
      image_(std::move(image)),
      align_(std::max<uint64_t>(options.align(), 1)),
      max_transfer_(options.max_transfer()),
      opt_write_zero_(options.opt_write_zero()),
      max_write_zero_(options.max_write_zero()),
      opt_discard_(options.opt_discard()),
      max_discard_(options.max_discard()),
      messages_(&std::cout) {}

BlkdebugNode::~BlkdebugNode() = default;

uint64_t BlkdebugNode::size() const {
  return AlignUp(image_->size(), kSectorSize);
}

io::Task<absl::Status> BlkdebugNode::Close() { co_return co_await image_->Close(); }

void BlkdebugNode::AddRule(Rule rule) {
  const int e = static_cast<int>(rule.event);
  rules_[e].push_front(std::move(rule));
}

void BlkdebugNode::RemoveRule(Rule* rule) {
  armed_.remove(rule);
  auto& list = rules_[static_cast<int>(rule->event)];
  for (auto it = list.begin(); it != list.end(); ++it) {
    if (&*it == rule) {
      list.erase(it);
      return;
    }
  }
}

absl::Status BlkdebugNode::CheckRules(uint64_t offset, uint64_t length,
                                      IoType type) {
  Rule* match = nullptr;
  for (Rule* rule : armed_) {
    const bool at = rule->offset == -1 ||
                    (length != 0 && static_cast<uint64_t>(rule->offset) >= offset &&
                     static_cast<uint64_t>(rule->offset) < offset + length);
    if (at && (rule->iotype_mask & Bit(type)) != 0) {
      match = rule;
      break;
    }
  }
  if (match == nullptr || match->error == 0) return absl::OkStatus();
  const int error = match->error;
  if (match->once) RemoveRule(match);
  return ErrnoStatus(filename(), kIoTypeNames[static_cast<int>(type)],
                     error > 0 ? error : -error);
}

io::Task<void> BlkdebugNode::DoDebugEvent(BlkdebugEvent event) {
  std::list<Rule>& list = rules_[static_cast<int>(event)];
  int new_state = state_;
  bool armed_any = false;
  std::vector<std::shared_ptr<io::Event>> waits;
  for (auto it = list.begin(); it != list.end();) {
    auto next = std::next(it);
    Rule& rule = *it;
    if (rule.state == 0 || rule.state == state_) {
      switch (rule.action) {
        case Rule::Action::kInjectError:
          if (!armed_any) {
            armed_.clear();
            armed_any = true;
          }
          armed_.push_front(&rule);
          break;
        case Rule::Action::kSetState:
          new_state = rule.new_state;
          break;
        case Rule::Action::kSuspend: {
          auto resumed = std::make_shared<io::Event>();
          suspended_.push_front(Suspended{rule.tag, resumed});
          *messages_ << "blkdebug: Suspended request '" << rule.tag << "'\n";
          waits.push_back(std::move(resumed));
          armed_.remove(&rule);
          list.erase(it);
          break;
        }
      }
    }
    it = next;
  }
  state_ = new_state;
  for (const std::shared_ptr<io::Event>& resumed : waits) {
    co_await resumed->Wait();
  }
}

absl::Status BlkdebugNode::DoDebugBreakpoint(BlkdebugEvent event,
                                             absl::string_view tag) {
  Rule rule;
  rule.action = Rule::Action::kSuspend;
  rule.event = event;
  rule.tag = std::string(tag);
  AddRule(std::move(rule));
  return absl::OkStatus();
}

bool BlkdebugNode::ResumeOne(absl::string_view tag) {
  for (auto it = suspended_.begin(); it != suspended_.end(); ++it) {
    if (it->tag != tag) continue;
    std::shared_ptr<io::Event> resumed = it->resumed;
    *messages_ << "blkdebug: Resuming request '" << it->tag << "'\n";
    suspended_.erase(it);
    resumed->Set();
    return true;
  }
  return false;
}

absl::Status BlkdebugNode::DoDebugRemoveBreakpoint(absl::string_view tag) {
  bool found = false;
  for (auto& list : rules_) {
    for (auto it = list.begin(); it != list.end();) {
      auto next = std::next(it);
      if (it->action == Rule::Action::kSuspend && it->tag == tag) {
        list.erase(it);
        found = true;
      }
      it = next;
    }
  }
  // Resumed requests do not count: QEMU 7.2's resume_req_by_tag(all)
  // returns ENOENT after resuming them.
  while (ResumeOne(tag)) {
  }
  if (!found) {
    return WithMessage(ErrnoStatus("", "remove_break", ENOENT),
                       std::strerror(ENOENT));
  }
  return absl::OkStatus();
}

absl::Status BlkdebugNode::DoDebugResume(absl::string_view tag) {
  if (!ResumeOne(tag)) {
    return WithMessage(ErrnoStatus("", "resume", ENOENT),
                       std::strerror(ENOENT));
  }
  return absl::OkStatus();
}

bool BlkdebugNode::DoDebugIsSuspended(absl::string_view tag) {
  for (const Suspended& s : suspended_) {
    if (s.tag == tag) return true;
  }
  return false;
}

io::Task<absl::Status> BlkdebugNode::ReadAligned(uint64_t offset,
                                                 io::IoVec buf) {
  const uint64_t piece = max_transfer_ != 0 ? max_transfer_ : buf.size();
  for (uint64_t done = 0; done < buf.size();) {
    const uint64_t n = std::min<uint64_t>(piece, buf.size() - done);
    CO_RETURN_IF_ERROR(CheckRules(offset + done, n, IoType::kRead));
    CO_RETURN_IF_ERROR(
        co_await image_->Read(offset + done, buf.subspan(done, n)));
    done += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> BlkdebugNode::WriteAligned(uint64_t offset,
                                                  io::ConstIoVec data) {
  const uint64_t piece = max_transfer_ != 0 ? max_transfer_ : data.size();
  for (uint64_t done = 0; done < data.size();) {
    const uint64_t n = std::min<uint64_t>(piece, data.size() - done);
    CO_RETURN_IF_ERROR(CheckRules(offset + done, n, IoType::kWrite));
    CO_RETURN_IF_ERROR(
        co_await image_->Write(offset + done, data.subspan(done, n)));
    done += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> BlkdebugNode::DoRead(uint64_t offset, io::IoVec buf) {
  Tracked t{.start = offset, .end = offset + buf.size()};
  tracked_.Begin(t);
  co_await tracked_.WaitForConflicts(t);
  absl::Status st;
  if (offset % align_ == 0 && buf.size() % align_ == 0) {
    st = co_await ReadAligned(offset, buf);
  } else {
    const uint64_t start = AlignDown(offset, align_);
    const uint64_t end = AlignUp(offset + buf.size(), align_);
    std::vector<uint8_t> bounce(end - start);
    st = co_await ReadAligned(start, io::IoVec(bounce.data(), bounce.size()));
    if (st.ok()) {
      std::memcpy(buf.data(), bounce.data() + (offset - start), buf.size());
    }
  }
  tracked_.End(t);
  co_return st;
}

io::Task<absl::Status> BlkdebugNode::DoWrite(uint64_t offset,
                                             io::ConstIoVec data) {
  Tracked t{.start = offset, .end = offset + data.size()};
  if (offset % align_ != 0 || data.size() % align_ != 0) {
    // QEMU's bdrv_make_request_serialising(req, align).
    t.start = AlignDown(offset, align_);
    t.end = AlignUp(offset + data.size(), align_);
    t.serialising = true;
  }
  tracked_.Begin(t);
  co_await tracked_.WaitForConflicts(t);
  absl::Status st = co_await WriteRmw(offset, data, &t);
  tracked_.End(t);
  co_return st;
}

io::Task<absl::Status> BlkdebugNode::WriteRmw(uint64_t offset,
                                              io::ConstIoVec data,
                                              Tracked* tracked) {
  const auto write = [&](uint64_t at,
                         io::ConstIoVec bytes) -> io::Task<absl::Status> {
    if (tracked != nullptr) {
      // QEMU's bdrv_aligned_pwritev: the wait, then the events around the
      // write.
      co_await tracked_.WaitForConflicts(*tracked);
      co_await DebugEvent(BlkdebugEvent::kPwritev);
    }
    absl::Status st = co_await WriteAligned(at, bytes);
    if (tracked != nullptr) co_await DebugEvent(BlkdebugEvent::kPwritevDone);
    co_return st;
  };
  if (offset % align_ == 0 && data.size() % align_ == 0) {
    co_return co_await write(offset, data);
  }
  // Read-modify-write of the partial blocks at both ends (QEMU's
  // bdrv_init_padding and bdrv_padding_rmw_read: one read of both where the
  // padded request is one block, or two with a head and a tail).
  const uint64_t start = AlignDown(offset, align_);
  const uint64_t end = AlignUp(offset + data.size(), align_);
  std::vector<uint8_t> bounce(end - start);
  const bool head = offset != start;
  const bool tail = offset + data.size() != end;
  const uint64_t merged_length =
      end - start > align_ && head && tail ? 2 * align_ : align_;
  const bool merge = end - start == merged_length;
  if (head || merge) {
    if (head) co_await DebugEvent(BlkdebugEvent::kPwritevRmwHead);
    if (merge && tail) co_await DebugEvent(BlkdebugEvent::kPwritevRmwTail);
    CO_RETURN_IF_ERROR(co_await ReadAligned(
        start, io::IoVec(bounce.data(), merge ? merged_length : align_)));
    if (head) co_await DebugEvent(BlkdebugEvent::kPwritevRmwAfterHead);
    if (merge && tail) {
      co_await DebugEvent(BlkdebugEvent::kPwritevRmwAfterTail);
    }
  }
  if (tail && !merge) {
    co_await DebugEvent(BlkdebugEvent::kPwritevRmwTail);
    CO_RETURN_IF_ERROR(co_await ReadAligned(
        end - align_, io::IoVec(bounce.data() + bounce.size() - align_,
                                align_)));
    co_await DebugEvent(BlkdebugEvent::kPwritevRmwAfterTail);
  }
  std::memcpy(bounce.data() + (offset - start), data.data(), data.size());
  co_return co_await write(start,
                           io::ConstIoVec(bounce.data(), bounce.size()));
}

io::Task<absl::Status> BlkdebugNode::DoWriteZeroes(uint64_t offset,
                                                   uint64_t length,
                                                   io::WriteZeroesFlags flags) {
  const uint64_t align = std::max(align_, opt_write_zero_);
  const uint64_t end = offset + length;
  while (offset < end) {
    // The piece up to the next alignment boundary (or the end).
    uint64_t piece_end = std::min(end, RoundUpTo(offset + 1, align));
    if (offset % align == 0 && end - offset >= align) {
      piece_end = RoundDownTo(end, align);
      if (max_write_zero_ != 0) {
        piece_end = std::min(piece_end, offset + max_write_zero_);
      }
    }
    const uint64_t n = piece_end - offset;
    if (n < align) {
      // blkdebug refuses zero writes below its alignment: the block layer
      // writes zeroes instead.
      if (flags.no_fallback) co_return absl::UnimplementedError("write zeroes");
      std::vector<uint8_t> zeroes(n, 0);
      CO_RETURN_IF_ERROR(co_await WriteRmw(
          offset, io::ConstIoVec(zeroes.data(), n), nullptr));
    } else {
      CO_RETURN_IF_ERROR(CheckRules(offset, n, IoType::kWriteZeroes));
      CO_RETURN_IF_ERROR(co_await image_->WriteZeroes(offset, n, flags));
    }
    offset = piece_end;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> BlkdebugNode::DoDiscard(uint64_t offset,
                                               uint64_t length) {
  const uint64_t align = std::max(align_, opt_discard_);
  const uint64_t end = offset + length;
  while (offset < end) {
    uint64_t piece_end = std::min(end, RoundUpTo(offset + 1, align));
    if (offset % align == 0 && end - offset >= align) {
      piece_end = RoundDownTo(end, align);
      if (max_discard_ != 0) piece_end = std::min(piece_end, offset + max_discard_);
    }
    // Unaligned ends are cut at the request alignment (QEMU's
    // bdrv_co_pdiscard: num %= request_alignment), so only the bytes
    // outside whole align-sized blocks are dropped.
    if (offset % align_ != 0) {
      piece_end = std::min(piece_end, RoundUpTo(offset + 1, align_));
    } else if (piece_end % align_ != 0 && piece_end - offset > align_) {
      piece_end = RoundDownTo(piece_end, align_);
    }
    const uint64_t n = piece_end - offset;
    // Pieces below the request alignment are dropped (discard is a hint).
    if (n >= align_ && offset % align_ == 0 && n % align_ == 0) {
      CO_RETURN_IF_ERROR(CheckRules(offset, n, IoType::kDiscard));
      absl::Status st = co_await image_->Discard(offset, n);
      if (!st.ok() && !absl::IsUnimplemented(st)) co_return st;
    }
    offset = piece_end;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> BlkdebugNode::DoFlush() {
  // QEMU calls blkdebug_co_flush (the rule check) only when the node was
  // written since its last flush; the image below is flushed either way.
  if (WrittenSinceFlush()) {
    CO_RETURN_IF_ERROR(CheckRules(0, 0, IoType::kFlush));
  }
  co_return co_await image_->Flush();
}

io::Task<absl::Status> BlkdebugNode::DoTruncate(uint64_t size,
                                                io::PreallocMode prealloc) {
  co_return co_await image_->Truncate(size, prealloc);
}

io::Task<absl::StatusOr<io::BlockStatus>> BlkdebugNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  CO_RETURN_IF_ERROR(CheckRules(offset, max_length, IoType::kBlockStatus));
  if (offset >= image_->size()) {
    io::BlockStatus status;
    status.length = max_length;
    status.zero = true;
    co_return status;
  }
  co_return co_await image_->GetBlockStatus(
      offset, std::min(max_length, image_->size() - offset));
}

io::Task<absl::StatusOr<std::unique_ptr<BlkdebugNode>>> OpenBlkdebug(
    std::unique_ptr<io::BlockNode> image, const BlkdebugOptions& options,
    std::vector<Rule> rules) {
  CO_RETURN_IF_ERROR(ValidateOptions(options, 1));
  std::unique_ptr<BlkdebugNode> node(
      new BlkdebugNode(std::move(image), options));
  for (Rule& rule : rules) node->AddRule(std::move(rule));
  co_await node->DebugEvent(BlkdebugEvent::kNone);
  co_return node;
}

}  // namespace imgtool::blkdebug
