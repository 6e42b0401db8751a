#include "imgtool/image.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstring>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "base/align.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "io/task.h"
#include "qcow2/check.h"
#include "qcow2/qcow2_options.pb.h"

namespace imgtool::cli {
namespace {

// Formats QEMU knows that imgtool does not implement yet.
constexpr std::array<const char*, 13> kUnsupportedFormats = {
    "qcow", "qed",       "vmdk",  "vdi",   "vpc",   "vhdx",       "luks",
    "dmg",  "parallels", "bochs", "cloop", "vvfat", "host_device"};

constexpr char kQcowMagic[] = {'Q', 'F', 'I', '\xfb'};

// What every node of one image's chain is opened with.
struct ChainSettings {
  io::Engine* engine = nullptr;
  std::string cache;
  bool force_share = false;
  std::ostream* err = nullptr;
};

// A file of the chain, to refuse backing files that loop.
struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

struct OpenedNode {
  std::unique_ptr<io::BlockNode> node;
  std::string format;
  posix_file::FileNode* file = nullptr;
  qcow2::Qcow2Node* qcow2 = nullptr;
};

// posix_file says "<file>: Could not open: <strerror>" when open(2) fails;
// QEMU's file driver says "Could not open '<file>': <strerror>".
absl::Status FileError(const std::string& filename, const absl::Status& st) {
  const int error_number = StatusErrno(st);
  if (error_number != 0 &&
      st.message() == absl::StrCat(filename, ": Could not open: ",
                                   std::strerror(error_number))) {
    return absl::Status(st.code(),
                        absl::StrCat("Could not open '", filename,
                                     "': ", std::strerror(error_number)));
  }
  return st;
}

absl::Status CouldNotOpen(const std::string& filename,
                          const absl::Status& cause) {
  absl::Status st(cause.code(), absl::StrCat("Could not open '", filename,
                                             "': ", cause.message()));
  cause.ForEachPayload([&](absl::string_view url, const absl::Cord& payload) {
    st.SetPayload(url, payload);
  });
  return st;
}

absl::StatusOr<std::unique_ptr<posix_file::FileNode>> OpenFile(
    const ChainSettings& s, const std::string& filename, bool read_only,
    bool share_all) {
  struct stat st;
  if (stat(filename.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'file' driver requires '", filename, "' to be a regular file"));
  }
  posix_file::FileOpenOptions options;
  options.set_filename(filename);
  options.set_cache(s.cache);
  options.set_read_only(read_only);
  options.set_force_share(s.force_share);
  options.set_share_all_with_others(share_all);
  std::ostringstream warnings;
  absl::StatusOr<std::unique_ptr<posix_file::FileNode>> file =
      posix_file::FileNode::Open(*s.engine, options, &warnings);
  PrintWarnings(warnings.str(), *s.err);
  if (!file.ok()) return FileError(filename, file.status());
  return file;
}

io::Task<absl::StatusOr<OpenedNode>> OpenChain(
    ChainSettings s, std::string filename, std::string format, bool read_only,
    bool raw_shares_write, bool no_backing, bool is_backing,
    std::vector<FileId> ancestors);

io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>> OpenBacking(
    ChainSettings s, std::string filename, std::string format,
    std::vector<FileId> ancestors) {
  CO_ASSIGN_OR_RETURN(
      OpenedNode opened,
      co_await OpenChain(s, filename, format, /*read_only=*/true,
                         /*raw_shares_write=*/false, /*no_backing=*/false,
                         /*is_backing=*/true, std::move(ancestors)));
  co_return std::move(opened.node);
}

// The BackingOpener of a qcow2 node: opens its backing file read-only, with
// the same cache mode and sharing, refusing a file already in the chain.
qcow2::BackingOpener MakeOpener(const ChainSettings& s,
                                std::vector<FileId> ancestors) {
  return [s, ancestors](std::string filename, std::string format) {
    return OpenBacking(s, std::move(filename), std::move(format), ancestors);
  };
}

io::Task<absl::StatusOr<OpenedNode>> OpenChain(
    ChainSettings s, std::string filename, std::string format, bool read_only,
    bool raw_shares_write, bool no_backing, bool is_backing,
    std::vector<FileId> ancestors) {
  bool probed = false;
  if (format.empty()) {
    absl::StatusOr<std::string> guess = ProbeFormat(filename);
    // Files that cannot be read are opened as raw, which reports why.
    format = guess.ok() ? *guess : "raw";
    probed = true;
  } else {
    CO_RETURN_IF_ERROR(CheckFormat(format, /*for_create=*/false));
  }
  if (format != "raw" && format != "file" && format != "qcow2") {
    co_return absl::UnimplementedError(
        absl::StrCat("Format '", format, "' is not supported yet"));
  }
  struct stat st;
  if (stat(filename.c_str(), &st) == 0) {
    const FileId id{st.st_dev, st.st_ino};
    if (std::find(ancestors.begin(), ancestors.end(), id) != ancestors.end()) {
      co_return absl::InvalidArgumentError(absl::StrCat(
          "Backing file '", filename, "' creates an infinite loop."));
    }
    ancestors.push_back(id);
  }

  OpenedNode out;
  out.format = format;
  if (format != "qcow2") {
    // The raw format shares every permission (QEMU's default for an image
    // opened by qemu-img), so a read-only open takes only the
    // consistent-read lock: `info` and `map` work on a raw image a VM is
    // writing, as with qemu-img 7.2. As a backing file, or as convert's
    // source, it keeps writers out.
    CO_ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                        OpenFile(s, filename, read_only, raw_shares_write));
    if (probed && !read_only && !is_backing) {
      // qemu-img warns only when a probed raw image is opened for writing.
      *s.err << "WARNING: Image format was not specified for '" << filename
             << "' and probing guessed raw.\n"
                "         Automatically detecting the format is dangerous for "
                "raw images, write operations on block 0 will be restricted.\n"
                "         Specify the 'raw' format explicitly to remove the "
                "restrictions.\n";
    }
    out.file = file.get();
    out.node = std::move(file);
    co_return out;
  }

  // qcow2 metadata must not change under us: its file keeps writers out
  // unless -U.
  CO_ASSIGN_OR_RETURN(std::unique_ptr<posix_file::FileNode> file,
                      OpenFile(s, filename, read_only, /*share_all=*/false));
  posix_file::FileNode* file_node = file.get();
  std::ostream* err = s.err;
  qcow2::RefcountRepairer repair = [err](io::BlockNode& f) {
    return qcow2::RebuildRefcounts(f, err);
  };
  // Named locals, not temporaries in the co_await expression: GCC 12
  // destroys some of those twice.
  qcow2::BackingOpener opener;
  if (!no_backing) opener = MakeOpener(s, std::move(ancestors));
  qcow2::Qcow2OpenOptions open_options;
  CO_ASSIGN_OR_RETURN(
      std::unique_ptr<qcow2::Qcow2Node> node,
      co_await qcow2::Qcow2Node::Open(std::move(file), std::move(open_options),
                                      std::move(opener), std::move(repair)));
  out.file = file_node;
  out.qcow2 = node.get();
  out.node = std::move(node);
  co_return out;
}

}  // namespace

absl::StatusOr<std::string> ProbeFormat(const std::string& filename) {
  const int fd = open(filename.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(filename, "Could not open", errno);
  std::array<uint8_t, 512> head{};
  size_t got = 0;
  while (got < head.size()) {
    const ssize_t n = pread(fd, head.data() + got, head.size() - got, got);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      close(fd);
      return ErrnoStatus(filename,
                         "Could not read image for determining its "
                         "format",
                         error_number);
    }
    if (n == 0) break;
    got += static_cast<size_t>(n);
  }
  close(fd);
  if (got >= 8 &&
      std::memcmp(head.data(), kQcowMagic, sizeof(kQcowMagic)) == 0) {
    // Big-endian version: QEMU's qcow probe takes version 1 in a file of at
    // least a qcow header (48 bytes), its qcow2 probe any version >= 2 in a
    // file of at least a qcow2 header (112 bytes).
    const uint32_t version = (uint32_t{head[4]} << 24) |
                             (uint32_t{head[5]} << 16) |
                             (uint32_t{head[6]} << 8) | head[7];
    if (version == 1 && got >= 48) return std::string("qcow");
    if (version >= 2 && got >= 112) return std::string("qcow2");
  }
  return std::string("raw");
}

std::string ResolveBackingFilename(const std::string& image,
                                   const std::string& backing) {
  if (backing.empty() || backing[0] == '/') return backing;
  const size_t colon = backing.find(':');
  const size_t slash = backing.find('/');
  if (colon != std::string::npos &&
      (slash == std::string::npos || colon < slash)) {
    return backing;
  }
  const size_t dir_end = image.rfind('/');
  if (dir_end == std::string::npos) return backing;
  return image.substr(0, dir_end + 1) + backing;
}

absl::Status CheckFormat(const std::string& format, bool for_create) {
  if (format == "raw" || format == "file" || format == "qcow2") {
    return absl::OkStatus();
  }
  for (const char* name : kUnsupportedFormats) {
    if (format == name) {
      return absl::UnimplementedError(
          absl::StrCat("Format '", format, "' is not supported yet"));
    }
  }
  return absl::InvalidArgumentError(
      for_create ? absl::StrCat("Unknown file format '", format, "'")
                 : absl::StrCat("Unknown driver '", format, "'"));
}

absl::StatusOr<OpenedImage> OpenImage(const ImageSpec& spec, std::ostream& err,
                                      std::shared_ptr<io::Engine> engine) {
  const std::string& filename = spec.filename;
  if (spec.image_opts) {
    return absl::UnimplementedError("--image-opts is not supported yet");
  }
  if (!spec.format.empty()) {
    absl::Status st = CheckFormat(spec.format, /*for_create=*/false);
    if (!st.ok()) return CouldNotOpen(filename, st);
  }

  OpenedImage image;
  if (engine == nullptr) {
    ASSIGN_OR_RETURN(std::unique_ptr<io::Engine> created,
                     io::CreateEngine(spec.aio, spec.queue_depth, &err));
    engine = std::move(created);
  }
  image.engine = std::move(engine);
  ChainSettings s;
  s.engine = image.engine.get();
  s.cache = spec.cache;
  s.force_share = spec.force_share;
  s.err = &err;
  absl::StatusOr<OpenedNode> opened = io::RunSync(
      *image.engine,
      OpenChain(s, filename, spec.format, spec.read_only,
                /*raw_shares_write=*/!spec.unshare_write, spec.no_backing,
                /*is_backing=*/false, {}));
  if (!opened.ok()) return CouldNotOpen(filename, opened.status());
  image.node = std::move(opened->node);
  image.format = opened->format;
  image.file = opened->file;
  image.qcow2 = opened->qcow2;
  return image;
}

absl::Status CloseImage(OpenedImage& image) {
  if (image.node == nullptr) return absl::OkStatus();
  absl::Status st = io::RunSync(*image.engine, image.node->Close());
  image.file = nullptr;
  image.qcow2 = nullptr;
  image.node.reset();
  return st;
}

uint64_t VirtualSize(const OpenedImage& image) {
  if (image.qcow2 != nullptr) return image.node->size() / 512 * 512;
  return AlignUp(image.node->size(), 512);
}

}  // namespace imgtool::cli
