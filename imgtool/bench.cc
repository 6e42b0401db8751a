// imgtool bench: qemu-img bench's request generator. `count` requests of
// `size` bytes go to the image, `depth` of them in flight, the first at
// `offset` and each next one `step` bytes further, wrapping modulo the image
// size as qemu-img does (offset = (offset + step) % image_size). A request
// that does not fit in the image fails the run with "Failed request:
// Input/output error", like qemu-img's range check.
//
// Shape: `depth` worker coroutines each loop over co_await node->Read/Write
// on its own slice of one aligned buffer; the engine is polled here until all
// workers have returned. Flushes follow qemu-img's bench_cb exactly: after a
// completion that leaves a multiple of --flush-interval requests still to be
// sent, a flush is issued, either once the queue has drained (default) or
// at once alongside the other requests (--no-drain).
//
// Decisions where qemu-img 7.2 has quirks (qemu-img-cli.md, "bench"):
// -d 0 is rejected ("Invalid queue depth specified") instead of hanging;
// -q does not silence the two lines (as in qemu-img); an empty image is an
// I/O error instead of a division by zero; the final flush of a
// --flush-interval run is inside the timed region. -n / -i native run on
// Linux AIO (io::AioEngine) and, as in qemu-img, need -t none or
// directsync; the default engine is native for a file opened with O_DIRECT
// (-t none / directsync, cache.direct=on) and io_uring otherwise
// (qemu-img's is threads; imgtool/image.h ImageSpec::aio).
// Beyond qemu-img: --output=json prints a BenchResult (bench_result.proto)
// with IOPS, bandwidth and latency percentiles, and nothing else; and
// --random[=SEED] (an imgtool extension, issue 20; qemu-img bench has none)
// sends each request at a pseudo-random offset instead of offset + step:
// slot * SIZE with slot = SplitMix64(seed) % (image_size / SIZE), one
// generator draw per request in the order requests are sent, so a seed
// gives the same offsets on every run. -S and -o are refused with it.
#include <getopt.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <coroutine>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/json_printer.h"
#include "base/size.h"
#include "base/status_macros.h"
#include "imgtool/bench.h"
#include "imgtool/bench_result.pb.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/task.h"

namespace imgtool::cli {
namespace {

constexpr uint64_t kIntMax = 2147483647;            // qemu-img's INT_MAX limits
constexpr uint64_t kInt64Max = 9223372036854775807;  // offsets
constexpr int kMaxEngineDepth = 4096;               // io/engine.h

// Latency histogram, log-linear: values below 128 ns are exact, above that
// each power of two is split into 128 buckets, so a percentile is within 1%.
class LatencyHistogram {
 public:
  void Record(uint64_t ns) {
    ++counts_[Index(ns)];
    ++total_;
    max_ = std::max(max_, ns);
  }

  // The value (ns) at or below which `percent` % of the samples lie: the
  // middle of the bucket holding that rank, never above the maximum.
  double Percentile(double percent) const {
    if (total_ == 0) return 0;
    uint64_t rank = static_cast<uint64_t>(std::ceil(percent / 100.0 * total_));
    rank = std::clamp<uint64_t>(rank, 1, total_);
    uint64_t seen = 0;
    for (size_t i = 0; i < counts_.size(); ++i) {
      seen += counts_[i];
      if (seen >= rank) {
        return std::min(Middle(i), static_cast<double>(max_));
      }
    }
    return static_cast<double>(max_);
  }

  uint64_t max() const { return max_; }

 private:
  static constexpr int kSubBits = 7;
  static constexpr uint64_t kSub = uint64_t{1} << kSubBits;

  static size_t Index(uint64_t v) {
    if (v < kSub) return v;
    const int msb = 63 - __builtin_clzll(v);
    const int shift = msb - kSubBits;
    return (shift + 1) * kSub + ((v >> shift) - kSub);
  }
  static double Middle(size_t index) {
    if (index < kSub) return static_cast<double>(index);
    const int shift = static_cast<int>(index / kSub) - 1;
    const uint64_t lower = (kSub + index % kSub) << shift;
    return static_cast<double>(lower) + static_cast<double>(uint64_t{1} << shift) / 2;
  }

  std::vector<uint64_t> counts_ = std::vector<uint64_t>((64 - kSubBits + 1) * kSub);
  uint64_t total_ = 0;
  uint64_t max_ = 0;
};

uint64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// SplitMix64 (Steele, Lea, Flood, "Fast splittable pseudorandom number
// generators", OOPSLA 2014): the next value of the sequence for `state`.
uint64_t SplitMix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Shared by the workers; owned by RunRequests until every worker returned.
struct BenchState {
  io::BlockNode* node = nullptr;
  bool write = false;
  uint64_t image_size = 0;
  uint64_t request_size = 0;
  uint64_t step = 0;
  bool random = false;       // --random: offsets from `rng`, not + step
  uint64_t rng = 0;          // SplitMix64 state, starts at the seed
  uint64_t flush_interval = 0;
  bool drain = true;
  LatencyHistogram* latency = nullptr;  // only for --output=json
  io::AlignedBuffer buffer;  // `depth` slices of request_size bytes

  uint64_t n = 0;          // requests not completed yet (qemu-img's b->n)
  uint64_t in_flight = 0;  // sent, not completed
  uint64_t next_offset = 0;
  bool drain_pending = false;  // a drained flush is due: send nothing
  absl::Status error;          // the first failure ends the run
  int running = 0;             // workers and undrained flushes alive
  std::vector<std::coroutine_handle<>> parked;  // workers waiting for a flush

  void WakeAll() {
    std::vector<std::coroutine_handle<>> waiting;
    waiting.swap(parked);
    for (std::coroutine_handle<> h : waiting) io::Resume(h);
  }

  void Fail(absl::string_view what, const absl::Status& st) {
    if (error.ok()) {
      error = absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
    }
    WakeAll();
  }
};

struct Park {
  BenchState& state;
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> h) { state.parked.push_back(h); }
  void await_resume() const noexcept {}
};

void SpawnUndrainedFlush(BenchState* s) {
  ++s->running;
  io::Spawn(s->node->Flush(), [s](absl::Status st) {
    if (!st.ok()) s->Fail("Failed flush request", st);
    --s->running;
  });
}

// One of `depth` request loops. `buf` is this worker's slice of the buffer.
io::Task<void> Worker(BenchState* s, io::IoVec buf) {
  for (;;) {
    if (!s->error.ok() || s->n == s->in_flight) co_return;  // nothing to send
    if (s->drain_pending) {
      co_await Park{*s};
      continue;
    }
    uint64_t offset = s->next_offset;
    if (s->random) {
      // An image smaller than one request keeps offset 0: the range check
      // below fails it as it fails a sequential run.
      const uint64_t slots = s->image_size / s->request_size;
      offset = slots == 0 ? 0 : (SplitMix64(s->rng) % slots) * s->request_size;
    }
    ++s->in_flight;
    s->next_offset =
        s->image_size == 0 ? 0 : (offset + s->step) % s->image_size;

    const uint64_t start = s->latency != nullptr ? NowNs() : 0;
    absl::Status st;
    if (offset > s->image_size || s->image_size - offset < s->request_size) {
      st = absl::OutOfRangeError("Input/output error");  // qemu-img: EIO
    } else if (s->write) {
      st = co_await s->node->Write(offset, buf);
    } else {
      st = co_await s->node->Read(offset, buf);
    }
    if (s->latency != nullptr) s->latency->Record(NowNs() - start);

    const uint64_t remaining = s->n - s->in_flight;  // not sent yet
    --s->n;
    --s->in_flight;
    if (!st.ok()) {
      s->Fail("Failed request", st);
      continue;
    }
    if (s->flush_interval != 0 && remaining % s->flush_interval == 0) {
      if (!s->drain) {
        SpawnUndrainedFlush(s);
      } else {
        s->drain_pending = true;
        if (s->in_flight == 0) {
          absl::Status flushed = co_await s->node->Flush();
          s->drain_pending = false;
          if (!flushed.ok()) {
            s->Fail("Failed request", flushed);
          } else {
            s->WakeAll();
          }
        }
      }
    }
  }
}

struct BenchArgs {
  ImageSpec spec;
  uint64_t count = 75000;
  uint64_t depth = 64;
  uint64_t size = 4096;
  uint64_t step = 0;  // 0 = size
  uint64_t offset = 0;
  bool write = false;
  uint64_t pattern = 0;
  uint64_t flush_interval = 0;
  bool drain = true;
  bool json = false;
  bool help = false;
  bool random = false;  // --random
  uint64_t seed = 1;    // --random=SEED
  bool step_given = false;
  bool offset_given = false;
};

// qemu_strtoul(text, NULL, 0) followed by a `<= max` check: strtoul's
// grammar (leading spaces, sign, 0x hex, 0 octal), nothing after the number.
absl::StatusOr<uint64_t> ParseUnsigned(const char* text, uint64_t max,
                                       absl::string_view error) {
  errno = 0;
  char* end = nullptr;
  unsigned long long v = std::strtoull(text, &end, 0);
  if (end == text || *end != '\0' || errno != 0 || v > max) {
    return absl::InvalidArgumentError(error);
  }
  return v;
}

// cvtnum_full(): a size with suffixes, between 0 and `max` bytes.
absl::StatusOr<uint64_t> ParseSizeArg(absl::string_view name,
                                      const char* text, uint64_t max) {
  absl::StatusOr<uint64_t> v = ParseSize(text);
  if (v.ok() && *v <= max) return *v;
  if (!v.ok() && !absl::StrContains(v.status().message(), "Must be between")) {
    // qemu-img reports these as two errors: both lines get the prefix.
    return PrefixEachLine(absl::InvalidArgumentError(absl::StrFormat(
        "Invalid %s specified. You may use k, M, G, T, P or E suffixes for\n"
        "kilobytes, megabytes, gigabytes, terabytes, petabytes and exabytes.",
        name)));
  }
  return absl::InvalidArgumentError(absl::StrFormat(
      "Invalid %s specified. Must be between 0 and %d.", name, max));
}

absl::StatusOr<std::string> ParseCacheMode(const std::string& mode) {
  if (mode == "none" || mode == "off") return std::string("none");
  if (mode == "writeback" || mode == "writethrough" ||
      mode == "directsync" || mode == "unsafe") {
    return mode;
  }
  return absl::InvalidArgumentError("Invalid cache mode");
}

enum LongOption {
  kPattern = 256,
  kFlushInterval,
  kNoDrain,
  kImageOpts,
  kOutput,
  kRandom,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"pattern", required_argument, nullptr, kPattern},
    {"no-drain", no_argument, nullptr, kNoDrain},
    {"flush-interval", required_argument, nullptr, kFlushInterval},
    {"force-share", no_argument, nullptr, 'U'},
    {"output", required_argument, nullptr, kOutput},
    {"random", optional_argument, nullptr, kRandom},
    {nullptr, 0, nullptr, 0},
};

constexpr char kHelp[] =
    "Usage: imgtool bench [-c COUNT] [-d DEPTH] [-f FMT] "
    "[--flush-interval=N] [-i AIO] [-n]\n"
    "        [--no-drain] [-o OFFSET] [--pattern=BYTE] [-q] [-s SIZE] "
    "[-S STEP] [-t CACHE] [-w]\n"
    "        [-U] [--output=human|json] [--random[=SEED]] FILE\n"
    "Sends COUNT requests of SIZE bytes to an image, DEPTH at a time, and "
    "times them.\n"
    "  -c COUNT              requests in all (default 75000)\n"
    "  -d DEPTH              requests in flight (default 64)\n"
    "  -f FMT                image format (raw, file, qcow2); probed if "
    "absent\n"
    "  --image-opts          FILE is an option string such as\n"
    "                        driver=qcow2,file.driver=preallocate,"
    "file.file.filename=x\n"
    "  --flush-interval=N    flush after every N requests (writes only, "
    "N >= DEPTH)\n"
    "  --no-drain            flush without waiting for requests in flight\n"
    "  -i AIO                threads, io_uring or native (native needs -t "
    "none);\n"
    "                        default native with -t none or directsync, "
    "else io_uring\n"
    "  -n                    the same as -i native\n"
    "  -o OFFSET             offset of the first request (default 0)\n"
    "  --pattern=BYTE        byte written by -w (default 0)\n"
    "  -q                    accepted; the two lines are printed anyway, as "
    "by qemu-img\n"
    "  -s SIZE               bytes per request (default 4096)\n"
    "  -S STEP               distance between request offsets (default "
    "SIZE)\n"
    "  -t CACHE              none, writeback (default), writethrough, "
    "directsync, unsafe\n"
    "  -w                    write instead of read\n"
    "  -U, --force-share     open read-only without taking the image locks\n"
    "  --output=human|json   json: IOPS, bandwidth and latency percentiles\n"
    "  --random[=SEED]       imgtool extension: each request at a "
    "pseudo-random\n"
    "                        multiple of SIZE within the image, the same for "
    "a\n"
    "                        SEED (default 1); not with -S or -o\n";

absl::Status HandleOption(BenchArgs& a, int option, const std::string& arg) {
  const char* text = arg.c_str();
  switch (option) {
    case 'h':
      a.help = true;
      return absl::OkStatus();
    case 'c': {
      ASSIGN_OR_RETURN(a.count, ParseUnsigned(text, kIntMax,
                                              "Invalid request count specified"));
      return absl::OkStatus();
    }
    case 'd': {
      ASSIGN_OR_RETURN(a.depth, ParseUnsigned(text, kIntMax,
                                              "Invalid queue depth specified"));
      if (a.depth == 0) {  // qemu-img would hang forever
        return absl::InvalidArgumentError("Invalid queue depth specified");
      }
      return absl::OkStatus();
    }
    case 'f':
      a.spec.format = arg;
      return absl::OkStatus();
    case 'n':
      a.spec.aio = io::EngineKind::kNative;
      return absl::OkStatus();
    case 'i': {
      ASSIGN_OR_RETURN(a.spec.aio, io::ParseEngineKind(arg));
      return absl::OkStatus();
    }
    case 'o': {
      ASSIGN_OR_RETURN(a.offset, ParseSizeArg("offset", text, kInt64Max));
      a.offset_given = true;
      return absl::OkStatus();
    }
    case 'q':
      return absl::OkStatus();  // qemu-img bench prints its lines even with -q
    case 's': {
      ASSIGN_OR_RETURN(a.size, ParseSizeArg("buffer size", text, kIntMax));
      return absl::OkStatus();
    }
    case 'S': {
      ASSIGN_OR_RETURN(a.step, ParseSizeArg("step_size", text, kIntMax));
      a.step_given = true;
      return absl::OkStatus();
    }
    case 't': {
      ASSIGN_OR_RETURN(a.spec.cache, ParseCacheMode(arg));
      return absl::OkStatus();
    }
    case 'w':
      a.write = true;
      return absl::OkStatus();
    case 'U':
      a.spec.force_share = true;
      return absl::OkStatus();
    case kPattern: {
      ASSIGN_OR_RETURN(a.pattern, ParseUnsigned(text, 0xff,
                                                "Invalid pattern byte specified"));
      return absl::OkStatus();
    }
    case kFlushInterval: {
      ASSIGN_OR_RETURN(a.flush_interval,
                       ParseUnsigned(text, kIntMax,
                                     "Invalid flush interval specified"));
      return absl::OkStatus();
    }
    case kNoDrain:
      a.drain = false;
      return absl::OkStatus();
    case kImageOpts:
      a.spec.image_opts = true;
      return absl::OkStatus();
    case kOutput: {
      ASSIGN_OR_RETURN(a.json, ParseOutputFormat(arg));
      return absl::OkStatus();
    }
    case kRandom: {
      a.random = true;
      if (!arg.empty()) {
        ASSIGN_OR_RETURN(a.seed, ParseUnsigned(text, UINT64_MAX,
                                               "Invalid random seed specified"));
      }
      return absl::OkStatus();
    }
  }
  return absl::InternalError(absl::StrCat("bench: unhandled option ", option));
}

absl::StatusOr<BenchArgs> ParseArgs(const std::vector<std::string>& args) {
  BenchArgs a;
  // qemu-img prints no usage line for bench's usage errors, only the hint.
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "hc:d:f:ni:o:qs:S:t:wU", kLongOptions, /*usage=*/"",
                   [&a](int option, const std::string& arg) {
                     return HandleOption(a, option, arg);
                   }));
  if (a.help) return a;
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", /*usage=*/"");
  }
  a.spec.filename = operands[0];
  if (a.flush_interval != 0 && !a.write) {
    return absl::InvalidArgumentError(
        "--flush-interval is only available in write tests");
  }
  if (a.flush_interval != 0 && a.flush_interval < a.depth) {
    return absl::InvalidArgumentError(
        "Flush interval can't be smaller than depth");
  }
  if (a.random && (a.step_given || a.offset_given)) {
    return absl::InvalidArgumentError(
        "--random can't be combined with -S or -o");
  }
  if (a.random && a.size == 0) {
    return absl::InvalidArgumentError("--random needs a buffer size above 0");
  }
  if (a.step == 0) a.step = a.size;
  a.spec.read_only = !a.write;
  a.spec.nbd_connections = kNbdCopyConnections;
  a.spec.queue_depth =
      static_cast<int>(std::min<uint64_t>(a.depth, kMaxEngineDepth));
  return a;
}

// Runs the requests; returns the elapsed time in seconds.
absl::StatusOr<double> RunRequests(const BenchArgs& a, OpenedImage& image,
                                   LatencyHistogram* latency) {
  // On the heap: if the engine fails, requests still in flight may complete
  // later (CloseImage polls again), so the state and buffer are then leaked
  // rather than freed under them.
  auto state = std::make_unique<BenchState>();
  BenchState& s = *state;
  s.node = image.node.get();
  s.write = a.write;
  s.image_size = VirtualSize(image);  // qemu-img: blk_getlength
  s.request_size = a.size;
  s.step = a.step;
  s.random = a.random;
  s.rng = a.seed;
  s.flush_interval = a.flush_interval;
  s.drain = a.drain;
  s.latency = latency;
  s.n = a.count;
  s.next_offset = a.offset;

  const uint64_t workers = std::min(a.depth, a.count);
  // -d and -s come from the user: their product may exceed the memory or
  // even the address space (qemu-img 7.2 overflows an int and crashes).
  ASSIGN_OR_RETURN(s.buffer, io::AlignedBuffer::Create(workers * a.size));
  // fill_n, not memset: with -c 0 the buffer is empty and data() is null,
  // which memset may not be given even for 0 bytes.
  std::fill_n(s.buffer.data(), s.buffer.size(),
              static_cast<uint8_t>(a.pattern));

  const auto start = std::chrono::steady_clock::now();
  for (uint64_t i = 0; i < workers; ++i) {
    ++s.running;
    io::IoVec slice(s.buffer.data() + i * a.size, a.size);
    io::Spawn(Worker(&s, slice), [&s] { --s.running; });
  }
  while (s.running > 0) {
    if (image.engine->in_flight() == 0) {
      // Workers parked with nothing in flight (a bug in the flush logic):
      // nothing can resume them, so their frames are leaked with the state.
      state.release();
      return absl::InternalError("bench: requests stalled");
    }
    absl::Status polled = image.engine->Poll(/*wait=*/true);
    if (!polled.ok()) {
      state.release();
      return polled;
    }
  }
  const std::chrono::duration<double> elapsed =
      std::chrono::steady_clock::now() - start;
  RETURN_IF_ERROR(s.error);
  return elapsed.count();
}

}  // namespace

namespace {

// One bench run of parsed arguments: opens the image, prints qemu-img's
// first line(s) to `first_lines` (human mode; null: nothing), runs the
// requests and closes the image. The result has every field but the
// latency when `latency` is null.
absl::StatusOr<BenchResult> Measure(const BenchArgs& a, std::ostream& err,
                                    std::ostream* first_lines,
                                    LatencyHistogram* latency) {
  ASSIGN_OR_RETURN(OpenedImage image, OpenImage(a.spec, err));
  // qemu-img checks this once the file is open (file-posix's open).
  // -n asked for native and got it: an aio= option of the image
  // (file.aio=threads) overrides -n, as in QEMU, and the registry checks
  // file.aio=native itself. The default engine is native only for O_DIRECT.
  const bool native = a.spec.aio == io::EngineKind::kNative &&
                      std::string(image.engine->name()) == "native";
  if (native && a.spec.cache != "none" && a.spec.cache != "directsync") {
    CloseImage(image).IgnoreError();
    return absl::InvalidArgumentError(absl::StrCat(
        "Could not open '", a.spec.filename,
        "': aio=native was specified, but it requires cache.direct=on, which "
        "was not specified."));
  }
  if (first_lines != nullptr) {
    const std::string where =
        a.random ? absl::StrFormat("random offsets, seed %d", a.seed)
                 : absl::StrFormat("starting at offset %d, step size %d",
                                   a.offset, a.step);
    *first_lines << absl::StrFormat(
        "Sending %d %s requests, %d bytes each, %d in parallel (%s)\n",
        a.count, a.write ? "write" : "read", a.size, a.depth, where);
    if (a.flush_interval != 0) {
      *first_lines << absl::StrFormat("Sending flush every %d requests\n",
                                      a.flush_interval);
    }
    first_lines->flush();
  }

  const uint64_t image_size = VirtualSize(image);
  const std::string aio = image.engine->name();
  absl::StatusOr<double> elapsed = RunRequests(a, image, latency);
  absl::Status closed = CloseImage(image);
  RETURN_IF_ERROR(elapsed.status());
  RETURN_IF_ERROR(closed);

  BenchResult result;
  BenchParameters* p = result.mutable_parameters();
  p->set_filename(a.spec.filename);
  p->set_format(image.format);
  p->set_mode(a.write ? "write" : "read");
  p->set_count(a.count);
  p->set_depth(a.depth);
  p->set_request_size(a.size);
  p->set_offset(a.offset);
  p->set_step(a.step);
  p->set_image_size(image_size);
  p->set_cache(a.spec.cache);
  p->set_aio(aio);
  p->set_flush_interval(a.flush_interval);
  p->set_drain(a.drain);
  p->set_pattern(a.pattern);
  p->set_random(a.random);
  if (a.random) p->set_random_seed(a.seed);
  // Whole requests and bytes per second; times at nanosecond resolution.
  const double seconds = *elapsed;
  result.set_elapsed_seconds(std::round(seconds * 1e9) / 1e9);
  if (seconds > 0) {
    result.set_iops(std::round(a.count / seconds));
    result.set_bytes_per_second(
        std::round(static_cast<double>(a.count * a.size) / seconds));
  }
  if (latency != nullptr) {
    auto us = [](double ns) { return std::round(ns) / 1000; };
    BenchLatency* l = result.mutable_latency();
    l->set_p50_us(us(latency->Percentile(50)));
    l->set_p90_us(us(latency->Percentile(90)));
    l->set_p99_us(us(latency->Percentile(99)));
    l->set_p99_9_us(us(latency->Percentile(99.9)));
    l->set_max_us(us(static_cast<double>(latency->max())));
  }
  return result;
}

}  // namespace

absl::StatusOr<BenchResult> BenchForResult(
    const std::vector<std::string>& args, std::ostream& err) {
  ASSIGN_OR_RETURN(BenchArgs a, ParseArgs(args));
  if (a.help) return absl::InvalidArgumentError("bench: --help has no result");
  return Measure(a, err, /*first_lines=*/nullptr, /*latency=*/nullptr);
}

absl::Status RunBench(const std::vector<std::string>& args, Streams streams) {
  ASSIGN_OR_RETURN(BenchArgs a, ParseArgs(args));
  if (a.help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  LatencyHistogram latency;
  ASSIGN_OR_RETURN(BenchResult result,
                   Measure(a, streams.err, a.json ? nullptr : &streams.out,
                           a.json ? &latency : nullptr));
  if (!a.json) {
    streams.out << absl::StrFormat("Run completed in %.3f seconds.\n",
                                   result.elapsed_seconds());
    return absl::OkStatus();
  }
  streams.out << PrintJson(result) << "\n";
  return absl::OkStatus();
}

}  // namespace imgtool::cli
