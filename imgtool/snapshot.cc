// imgtool snapshot [--object OBJ] [--image-opts] [-U] [-q]
// -l | -a NAME | -c NAME | -d NAME FILE (no -f: qemu-img 7.2 has none): lists, applies, creates or deletes
// internal snapshots of a qcow2 image like qemu-img 7.2's img_snapshot
// (qcow2/qcow2_node.h, "Internal snapshots"). -l prints the table as `info`
// does (and -q does not silence it); -a finds the snapshot by id, then by
// name (qcow2_snapshot_goto), -d by name only (QEMU's bdrv_snapshot_find);
// -c takes any name, existing ones too. No action opens the image
// read-write and does nothing, as qemu-img. Other formats: QEMU's answers.
#include <getopt.h>
#include <time.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/snapshot_list.h"
#include "io/engine.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::cli {
namespace {

constexpr char kUsage[] =
    "Usage: imgtool snapshot [--object OBJ] [--image-opts] [-U] [-q] "
    "[-l | -a SNAPSHOT | -c SNAPSHOT | -d SNAPSHOT] FILE";

constexpr char kHelp[] =
    "Usage: imgtool snapshot [--object OBJ] [--image-opts] [-U] [-q] "
    "[-l | -a SNAPSHOT | -c SNAPSHOT | -d SNAPSHOT] FILE\n"
    "Lists, applies, creates or deletes internal snapshots of a qcow2 "
    "image.\n"
    "  -l            list the snapshots\n"
    "  -a SNAPSHOT   apply (revert the disk to) SNAPSHOT, an id or a name\n"
    "  -c SNAPSHOT   create a snapshot named SNAPSHOT\n"
    "  -d SNAPSHOT   delete the snapshot named SNAPSHOT\n"
    "  --image-opts  FILE is an option string\n"
    "  -U            open read-only images without locking them (-l only)\n"
    "  -q            quiet\n";

enum LongOption { kObject = 256, kImageOpts };

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"object", required_argument, nullptr, kObject},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"force-share", no_argument, nullptr, 'U'},
    {nullptr, 0, nullptr, 0},
};

enum class Action { kNone, kList, kApply, kCreate, kDelete };

std::string ErrnoText(int e) { return std::strerror(e); }

int ErrnoOf(const absl::Status& st) {
  const int e = StatusErrno(st);
  if (e != 0) return e;
  switch (st.code()) {
    case absl::StatusCode::kResourceExhausted: return EFBIG;
    case absl::StatusCode::kInvalidArgument: return EINVAL;
    case absl::StatusCode::kNotFound: return ENOENT;
    case absl::StatusCode::kUnimplemented: return ENOTSUP;
    default: return EIO;
  }
}

}  // namespace

absl::Status RunSnapshot(const std::vector<std::string>& args,
                         Streams streams) {
  ImageSpec spec;
  spec.read_only = false;
  Action action = Action::kNone;
  std::string name;
  bool help = false;
  ASSIGN_OR_RETURN(
      std::vector<std::string> operands,
      ParseOptions(args, "la:c:d:hqU", kLongOptions, kUsage,
                   [&](int c, const std::string& arg) -> absl::Status {
                     auto set = [&](Action a) -> absl::Status {
                       if (action != Action::kNone) {
                         return UsageError("Cannot mix '-l', '-a', '-c', '-d'",
                                           kUsage);
                       }
                       action = a;
                       name = arg;
                       return absl::OkStatus();
                     };
                     switch (c) {
                       case 'l':
                         RETURN_IF_ERROR(set(Action::kList));
                         spec.read_only = true;
                         break;
                       case 'a': return set(Action::kApply);
                       case 'c': return set(Action::kCreate);
                       case 'd': return set(Action::kDelete);
                       case 'h': help = true; break;
                       case 'q': break;
                       case 'U': spec.force_share = true; break;
                       case kImageOpts: spec.image_opts = true; break;
                     }
                     return absl::OkStatus();
                   }));
  if (help) {
    streams.out << kHelp;
    return absl::OkStatus();
  }
  if (operands.size() != 1) {
    return UsageError("Expecting one image file name", kUsage);
  }
  spec.filename = operands[0];
  if (spec.force_share && !spec.read_only) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Could not open '", spec.filename,
        "': force-share=on can only be used with read-only images"));
  }
  // What the open printed (the raw probing warning): apply prints it again,
  // as qemu-img, whose snapshot fallback to the file child reopens it.
  std::ostringstream open_err;
  // A few metadata clusters at most: no growing the file ahead of them.
  spec.qcow2_grow_ahead = false;
  absl::StatusOr<OpenedImage> opened = OpenImage(spec, open_err);
  streams.err << open_err.str();
  if (!opened.ok()) return opened.status();
  OpenedImage image = *std::move(opened);
  qcow2::Qcow2Node* q = image.qcow2;
  io::Engine& engine = *image.engine;
  absl::Status result;
  switch (action) {
    case Action::kNone:
      break;
    case Action::kList: {
      if (q == nullptr) break;  // no snapshots: nothing is printed
      absl::StatusOr<std::vector<qcow2::Qcow2Node::SnapshotRecord>> list =
          io::RunSync(engine, q->Snapshots());
      if (!list.ok()) {
        result = list.status();
      } else if (!list->empty()) {
        google::protobuf::RepeatedPtrField<SnapshotInfo> rows;
        for (const auto& sn : *list) *rows.Add() = SnapshotInfoOf(sn);
        streams.out << FormatSnapshotList(rows);
      }
      break;
    }
    case Action::kCreate: {
      absl::Status st;
      if (q == nullptr) {
        st = ErrnoStatus("", "snapshot", ENOTSUP);
      } else {
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        st = io::RunSync(
            engine, q->CreateSnapshot(name, static_cast<uint32_t>(now.tv_sec),
                                      static_cast<uint32_t>(now.tv_nsec / 1000 *
                                                            1000)));
      }
      if (!st.ok()) {
        // A corruption event is printed as it happens in QEMU, before the
        // command's error (qcow2_signal_corruption's error_report).
        if (absl::StartsWith(st.message(), "qcow2: Marking image as corrupt: ")) {
          streams.err << st.message() << "\n";
        }
        const int e = ErrnoOf(st);
        result = WithMessage(st, absl::StrFormat(
                                     "Could not create snapshot '%s': %d (%s)",
                                     name, -e, ErrnoText(e)));
      }
      break;
    }
    case Action::kApply: {
      if (q == nullptr) {
        streams.err << open_err.str();
        result = absl::UnimplementedError(absl::StrCat(
            "Could not apply snapshot '", name,
            "': Block driver does not support snapshots"));
        break;
      }
      std::string report;
      absl::Status st = io::RunSync(engine, q->GotoSnapshot(name, &report));
      if (!report.empty()) {
        streams.err << ProgramName() << ": " << report << "\n";
      }
      if (!st.ok()) {
        result = WithMessage(
            st, absl::StrCat("Could not apply snapshot '", name,
                             "': Failed to load snapshot: ",
                             ErrnoText(ErrnoOf(st))));
      }
      break;
    }
    case Action::kDelete: {
      int index = -1;
      if (q != nullptr) {
        absl::StatusOr<std::vector<qcow2::Qcow2Node::SnapshotRecord>> list =
            io::RunSync(engine, q->Snapshots());
        if (list.ok()) {
          index = qcow2::Qcow2Node::FindSnapshot(*list, name, /*by_id=*/false);
        }
      }
      if (index < 0) {
        result = absl::NotFoundError(absl::StrCat(
            "Could not delete snapshot '", name, "': snapshot not found"));
        break;
      }
      absl::Status st = io::RunSync(engine, q->DeleteSnapshot(index));
      if (!st.ok()) {
        result = WithMessage(st, absl::StrCat("Could not delete snapshot '",
                                              name, "': ", st.message()));
      }
      break;
    }
  }
  if (q != nullptr) {
    for (const auto& d : q->TakeDiagnostics()) {
      if (d.with_program) streams.err << ProgramName() << ": ";
      streams.err << d.text << "\n";
    }
  }
  absl::Status close = CloseImage(image);
  RETURN_IF_ERROR(result);
  return close;
}

}  // namespace imgtool::cli
