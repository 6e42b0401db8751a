// imgtool nbd [OPTIONS] FILE (and the binary under the name qemu-nbd):
// serves FILE over NBD with qemu-nbd 7.2's options and messages, on the
// server of nbd_server/nbd_server.h. Implemented: -k/--socket, -p/--port,
// -b/--bind, -x/--export-name, -D/--description, -e/--shared, -t/--persistent,
// -r/--read-only, -f/--format, --image-opts (and json: names), -n/--nocache,
// --cache, --aio, --discard, --pid-file, --fork, -h/--help, -V/--version,
// -v/--verbose (no effect on a server, as in qemu-nbd), -o/--offset (a raw
// window of the opened image from OFFSET to its end, as qemu-nbd's raw node
// over it),
// -A/--allocation-depth, -B/--bitmap (repeatable; a persistent bitmap of the
// image or of a node below it, found as qemu-nbd's nbd_export_create),
// --detect-zeroes, -l/--load-snapshot (read-only), -s/--snapshot (writes go
// to a temporary overlay, gone at exit; imgtool/temp_overlay.h),
// -L/--list (a client: the exports of a server, printed as qemu-nbd's
// qemu_nbd_client_list, through libnbd's option mode; with --tls-creds of
// a client endpoint over TLS),
// --object (block/objects.h) and --tls-creds=ID (a tls-creds-x509 or
// tls-creds-psk object with endpoint=server: TLS required of every client,
// nbd_server/tls.h; a client's failed negotiation is printed as qemu-nbd's
// "option negotiation failed: ..."), --tls-authz=ID (an authz-simple
// object checked against each x509 client's distinguished name after the
// handshake, nbd_server/tls.h). Not implemented (qemu-nbd's
// "unrecognized option" for them): -c, -d, -T.
//
// Lifetime as qemu-nbd's: the server listens (a unix socket replaces a stale
// file at its path and is removed at exit), serves up to -e clients at once
// (0: any number), and exits after the last client left unless -t. SIGTERM,
// SIGINT and SIGHUP stop it cleanly: connections are shut down, the image is
// flushed and closed, exit code 0. With --fork the parent exits (0) once the
// child listens, or 1 if the child failed before that (the child's error is
// on the shared stderr); the child then detaches from the terminal's streams.
#include <fcntl.h>
#include <getopt.h>
#include <netdb.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "base/errno_status.h"
#include "base/status_macros.h"
#include "block/objects.h"
#include "imgtool/command.h"
#include "imgtool/image.h"
#include "imgtool/snapshot_load.h"
#include "imgtool/temp_overlay.h"
#include "io/engine.h"
#include "nbd_block/libnbd.h"
#include "nbd_server/nbd_server.h"
#include "raw_format/raw_node.h"
#include "qcow2/qcow2_node.h"
#include "nbd_server/tls.h"

namespace imgtool::cli {
namespace {

std::string HelpText(const std::string& name) {
  return absl::StrCat(
      "Usage: ", name, " [OPTIONS] FILE\n",
      "  or:  ", name, " -L [OPTIONS]\n",
      "QEMU Disk Network Block Device Utility\n"
      "\n"
      "  -h, --help                display this help and exit\n"
      "  -V, --version             output version information and exit\n"
      "\n"
      "Connection properties:\n"
      "  -p, --port=PORT           port to listen on (default `10809')\n"
      "  -b, --bind=IFACE          interface to bind to (default `0.0.0.0')\n"
      "  -k, --socket=PATH         path to the unix socket\n"
      "  -e, --shared=NUM          device can be shared by NUM clients "
      "(default '1')\n"
      "  -t, --persistent          don't exit on the last connection\n"
      "  -v, --verbose             display extra debugging information\n"
      "  -x, --export-name=NAME    expose export by name (default is empty "
      "string)\n"
      "  -D, --description=TEXT    export a human-readable description\n"
      "\n"
      "Exposing part of the image:\n"
      "  -o, --offset=OFFSET       offset into the image\n"
      "  -A, --allocation-depth    expose the allocation depth\n"
      "  -B, --bitmap=NAME         expose a persistent dirty bitmap\n"
      "\n"
      "General purpose options:\n"
      "  -L, --list                list exports available from another NBD "
      "server\n"
      "  --fork                    fork off the server process and exit the "
      "parent\n"
      "                            once the server is running\n"
      "  --pid-file=PATH           store the server's process ID in the given "
      "file\n"
      "\n"
      "Block device options:\n"
      "  -f, --format=FORMAT       set image format (raw, qcow2, ...)\n"
      "  -r, --read-only           export read-only\n"
      "  -s, --snapshot            use FILE as an external snapshot, create a "
      "temporary\n"
      "                            file with backing_file=FILE, redirect the "
      "write to\n"
      "                            the temporary one\n"
      "  -l, --load-snapshot=SNAPSHOT_PARAM\n"
      "                            load an internal snapshot inside FILE and "
      "export it\n"
      "                            as an read-only device, SNAPSHOT_PARAM "
      "format is\n"
      "                            'snapshot.id=[ID],snapshot.name=[NAME]', or\n"
      "                            '[ID_OR_NAME]'\n"
      "  -n, --nocache             disable host cache\n"
      "      --cache=MODE          set cache mode used to access the disk "
      "image, the\n"
      "                            valid options are: 'none', 'writeback' "
      "(default),\n"
      "                            'writethrough', 'directsync' and 'unsafe'\n"
      "      --aio=MODE            set AIO mode (native, io_uring or threads)\n"
      "      --discard=MODE        set discard mode (ignore, unmap)\n"
      "      --detect-zeroes=MODE  set detect-zeroes mode (off, on, unmap)\n"
      "      --image-opts          treat FILE as a full set of image options\n"
      "\n"
      "  --object type,id=ID,...   define an object such as 'secret' for "
      "providing\n"
      "                            passwords and/or encryption keys\n"
      "  --tls-creds=ID            use id of an earlier --object to provide "
      "TLS\n"
      "  --tls-authz=ID            use id of an earlier --object to provide\n"
      "                            authorization\n"
      "\n"
      "Not supported by imgtool: -c, -d.\n");
}

enum LongOption {
  kCache = 256,
  kAio,
  kDiscard,
  kImageOpts,
  kPidFile,
  kFork,
  kDetectZeroes,
  kObject,
  kTlsCreds,
  kTlsHostname,
  kTlsAuthz,
};

const struct option kLongOptions[] = {
    {"help", no_argument, nullptr, 'h'},
    {"version", no_argument, nullptr, 'V'},
    {"port", required_argument, nullptr, 'p'},
    {"bind", required_argument, nullptr, 'b'},
    {"socket", required_argument, nullptr, 'k'},
    {"shared", required_argument, nullptr, 'e'},
    {"persistent", no_argument, nullptr, 't'},
    {"verbose", no_argument, nullptr, 'v'},
    {"offset", required_argument, nullptr, 'o'},
    {"export-name", required_argument, nullptr, 'x'},
    {"description", required_argument, nullptr, 'D'},
    {"format", required_argument, nullptr, 'f'},
    {"read-only", no_argument, nullptr, 'r'},
    {"nocache", no_argument, nullptr, 'n'},
    {"cache", required_argument, nullptr, kCache},
    {"aio", required_argument, nullptr, kAio},
    {"discard", required_argument, nullptr, kDiscard},
    {"image-opts", no_argument, nullptr, kImageOpts},
    {"pid-file", required_argument, nullptr, kPidFile},
    {"fork", no_argument, nullptr, kFork},
    {"allocation-depth", no_argument, nullptr, 'A'},
    {"bitmap", required_argument, nullptr, 'B'},
    {"snapshot", no_argument, nullptr, 's'},
    {"list", no_argument, nullptr, 'L'},
    {"load-snapshot", required_argument, nullptr, 'l'},
    {"detect-zeroes", required_argument, nullptr, kDetectZeroes},
    {"object", required_argument, nullptr, kObject},
    {"tls-creds", required_argument, nullptr, kTlsCreds},
    {"tls-hostname", required_argument, nullptr, kTlsHostname},
    {"tls-authz", required_argument, nullptr, kTlsAuthz},
    {nullptr, 0, nullptr, 0},
};

struct Args {
  std::string port = "10809";
  std::string bind = "0.0.0.0";
  bool tcp = false;  // -p or -b given (or no -k)
  std::string socket_path;
  nbd_server::ExportOptions export_options;
  ImageSpec spec;
  std::string pid_file;
  bool fork = false;
  std::string file;
  std::vector<std::string> bitmaps;  // -B, as given
  uint64_t offset = 0;               // -o, bytes
  bool snapshot = false;             // -s
  std::string load_snapshot;         // -l
  std::string tls_creds;  // --tls-creds
  std::optional<std::string> tls_authz;  // --tls-authz: an authz object's id, looked up
                                         // per client as qemu-nbd does
  std::unique_ptr<nbd_server::TlsServerCreds> tls;
  bool list = false;                 // -L
  std::optional<std::string> tls_hostname;  // --tls-hostname
  // -L with --tls-creds: the client's credentials, and the host name its
  // certificate check uses.
  std::optional<block::ObjectRegistry::TlsCreds> list_tls;
  std::optional<std::string> list_hostname;
  // An option of the export given (-x, -D, -f, -l, -A, -B, --aio,
  // --discard, --cache, -n; also -o but 0): refused with -L.
  bool per_device = false;
};

// A failure already printed (qemu-nbd's getopt lines): exit code 1, nothing
// more from main.
absl::Status Printed() { return WithExitCode(absl::CancelledError(), 1); }

absl::Status CheckAddress(Args& a) {
  if (a.socket_path.empty()) a.tcp = true;
  if (!a.socket_path.empty() && a.tcp) {
    return absl::InvalidArgumentError(
        "--socket and --port/--bind are mutually exclusive");
  }
  return absl::OkStatus();
}

absl::Status ParseArgs(const std::vector<std::string>& args, Streams streams,
                       Args& a) {
  const std::string& name = ProgramName();
  std::vector<std::string> storage;
  storage.reserve(args.size() + 1);
  storage.push_back(name);
  for (const std::string& s : args) storage.push_back(s);
  std::vector<char*> argv;
  for (std::string& s : storage) argv.push_back(s.data());
  argv.push_back(nullptr);
  optind = 0;  // full reinitialisation (glibc)
  opterr = 0;
  auto try_help = [&]() {
    streams.err << name << ": Try `" << name
                << " --help' for more information.\n";
    return Printed();
  };
  int c;
  int long_index = -1;
  while ((c = getopt_long(static_cast<int>(argv.size() - 1), argv.data(),
                          ":hVp:b:k:e:tvx:D:f:rnAB:o:sl:L", kLongOptions,
                          &long_index)) != -1) {
    const std::string arg = optarg != nullptr ? optarg : "";
    switch (c) {
      case 'h':
        return StopWithOutput(HelpText(name));
      case 'V':
        return StopWithOutput(VersionText());
      case 'v':
        // qemu-nbd's -v only changes what its kernel client (-c) prints;
        // a server prints the same with and without it.
        break;
      case 'p':
        a.port = arg;
        a.tcp = true;
        break;
      case 'b':
        a.bind = arg;
        a.tcp = true;
        break;
      case 'k':
        a.socket_path = arg;
        break;
      case 'e': {
        int n = 0;
        if (!absl::SimpleAtoi(arg, &n) || n < 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("Invalid shared device number '", arg, "'"));
        }
        a.export_options.max_connections = n;
        break;
      }
      case 't':
        a.export_options.persistent = true;
        break;
      case 'x':
        a.per_device = true;
        if (arg.size() > 4096) {
          return absl::InvalidArgumentError(
              absl::StrCat("Export name '", arg, "' too long"));
        }
        a.export_options.name = arg;
        break;
      case 'D':
        a.per_device = true;
        if (arg.size() > 4096) {
          return absl::InvalidArgumentError(
              absl::StrCat("Export description '", arg, "' too long"));
        }
        a.export_options.description = arg;
        break;
      case 'f':
        a.per_device = true;
        a.spec.format = arg;
        break;
      case 'r':
        a.export_options.read_only = true;
        break;
      case 'n':
        a.per_device = true;
        a.spec.cache = "none";
        break;
      case kCache: {
        a.per_device = true;
        std::optional<std::string> mode = CacheMode(arg);
        if (!mode.has_value()) {
          return absl::InvalidArgumentError(
              absl::StrCat("Invalid cache mode `", arg, "'"));
        }
        a.spec.cache = *mode;
        break;
      }
      case kAio: {
        a.per_device = true;
        absl::StatusOr<io::EngineKind> kind = io::ParseEngineKind(arg);
        if (!kind.ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("Invalid aio mode '", arg, "'"));
        }
        a.spec.aio = *kind;
        break;
      }
      case kDiscard:
        a.per_device = true;
        if (arg == "ignore" || arg == "off") {
          a.export_options.discard_unmap = false;
        } else if (arg == "unmap" || arg == "on") {
          a.export_options.discard_unmap = true;
        } else {
          return absl::InvalidArgumentError(
              absl::StrCat("Invalid discard mode `", arg, "'"));
        }
        break;
      case kImageOpts:
        a.spec.image_opts = true;
        break;
      case kPidFile:
        a.pid_file = arg;
        break;
      case kFork:
        a.fork = true;
        break;
      case 'A':
        a.per_device = true;
        a.export_options.allocation_depth = true;
        break;
      case 's':
        a.snapshot = true;
        break;
      case 'L':
        a.list = true;
        break;
      case 'l':
        a.per_device = true;
        // qemu-nbd: the option form is parsed here; -l implies -r.
        if (!CheckSnapshotOption(arg, streams.err).ok()) {
          return absl::InvalidArgumentError(
              absl::StrCat("Failed in parsing snapshot param `", arg, "'"));
        }
        a.load_snapshot = arg;
        a.export_options.read_only = true;
        break;
      case kDetectZeroes:
        if (arg == "off") {
          a.export_options.detect_zeroes = false;
          a.export_options.detect_zeroes_unmap = false;
        } else if (arg == "on" || arg == "unmap") {
          // qemu-nbd checks --discard as given so far.
          if (arg == "unmap" && !a.export_options.discard_unmap) {
            return absl::InvalidArgumentError(
                "setting detect-zeroes to unmap is not allowed without "
                "setting discard operation to unmap");
          }
          a.export_options.detect_zeroes = true;
          a.export_options.detect_zeroes_unmap = arg == "unmap";
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              "Failed to parse detect_zeroes mode: invalid parameter value: ",
              arg));
        }
        break;
      case 'B':
        a.per_device = true;
        a.bitmaps.push_back(arg);
        break;
      case 'o': {
        // qemu_strtou64 with base 0: decimal, 0x hex or 0 octal, the whole
        // argument.
        char* end = nullptr;
        errno = 0;
        const unsigned long long v = std::strtoull(arg.c_str(), &end, 0);
        if (arg.empty() || *end != '\0' || errno != 0) {
          streams.err << name << ": Invalid offset '" << arg << "'\n";
          return Printed();
        }
        a.offset = v;
        break;
      }
      case kObject: {
        // qemu-nbd creates each object as its option is parsed.
        absl::StatusOr<std::optional<std::string>> added =
            block::ObjectRegistry::Default().AddFromCommandLine(arg);
        if (!added.ok()) return added.status();
        if (added->has_value()) return StopWithOutput(**std::move(added));
        break;
      }
      case kTlsCreds:
        a.tls_creds = arg;
        break;
      case kTlsHostname:
        a.tls_hostname = arg;  // only for -L
        break;
      case kTlsAuthz:
        a.tls_authz = arg;
        break;
      case ':': {
        const char* word = argv[optind - 1];
        if (optopt != 0) {
          streams.err << name << ": option requires an argument -- '"
                      << static_cast<char>(optopt) << "'\n";
        } else {
          streams.err << name << ": option '" << word
                      << "' requires an argument\n";
        }
        return try_help();
      }
      default: {
        if (optopt != 0) {
          streams.err << name << ": invalid option -- '"
                      << static_cast<char>(optopt) << "'\n";
        } else {
          streams.err << name << ": unrecognized option '"
                      << argv[optind - 1] << "'\n";
        }
        return try_help();
      }
    }
  }
  const int operands = static_cast<int>(argv.size() - 1) - optind;
  if (a.list) {
    if (operands != 0) {
      return absl::InvalidArgumentError(
          "List mode is incompatible with a file name");
    }
    if (a.per_device || a.offset != 0) {
      return absl::InvalidArgumentError(
          "List mode is incompatible with per-device settings");
    }
    if (a.fork) {
      return absl::InvalidArgumentError(
          "List mode is incompatible with forking");
    }
  } else if (operands != 1) {
    streams.err << name << ": Invalid number of arguments\n"
                << "Try `" << name << " --help' for more information.\n";
    return Printed();
  }
  if (!a.list) a.file = argv[optind];
  // qemu-nbd's TLS checks, in its order.
  if (!a.tls_creds.empty()) {
    if (a.tls_authz.has_value() && a.list) {
      return absl::InvalidArgumentError(
          "TLS authorization is incompatible with export list");
    }
    if (a.tls_hostname.has_value() && !a.list) {
      return absl::InvalidArgumentError(
          "TLS hostname is only supported with export list");
    }
    // nbd_get_tls_creds: a client's credentials for -L, else a server's.
    absl::StatusOr<block::ObjectRegistry::TlsCreds> creds =
        block::ObjectRegistry::Default().LookupTlsCreds(a.tls_creds);
    if (creds.ok() && creds->server == a.list) {
      creds = absl::InvalidArgumentError(
          a.list ? "Expected TLS credentials for a client endpoint"
                 : "Expected TLS credentials for a server endpoint");
    }
    if (creds.ok() && a.list) {
      a.list_tls = *creds;
      // qemu-nbd: --tls-hostname, else the -b address (none for -k).
      if (a.tls_hostname.has_value()) {
        a.list_hostname = a.tls_hostname;
      } else if (a.socket_path.empty()) {
        a.list_hostname = a.bind;
      }
      return CheckAddress(a);
    }
    if (creds.ok()) {
      absl::StatusOr<std::unique_ptr<nbd_server::TlsServerCreds>> loaded =
          nbd_server::TlsServerCreds::Load(*creds, a.tls_authz);
      if (!loaded.ok()) return loaded.status();
      a.tls = *std::move(loaded);
    } else {
      return WithMessage(creds.status(),
                         absl::StrCat("Failed to get TLS creds: ",
                                      creds.status().message()));
    }
    a.export_options.tls = a.tls.get();
  } else if (a.tls_authz.has_value()) {
    return absl::InvalidArgumentError(
        "--tls-authz is not permitted without --tls-creds");
  } else if (a.tls_hostname.has_value()) {
    return absl::InvalidArgumentError(
        "--tls-hostname is not permitted without --tls-creds");
  }
  // Negotiation failures as qemu-nbd prints them (with or without TLS).
  a.export_options.report = [name](const std::string& message) {
    std::cerr << name << ": option negotiation failed: " << message
              << std::endl;
  };
  // Clients dropped in the transmission phase, as qemu-nbd prints them.
  a.export_options.report_disconnect = [name](const std::string& message) {
    std::cerr << name << ": Disconnect client, due to: " << message
              << std::endl;
  };
  return CheckAddress(a);
}

// A listening socket (close-on-exec) for the address the options give.
absl::StatusOr<int> Listen(const Args& a) {
  // qemu-nbd 7.2's main: SOMAXCONN with -t or -e 0, else min(-e, SOMAXCONN)
  // (so with -t -e 2 a third client waits in the backlog, not refused).
  const int backlog = a.export_options.persistent ||
                              a.export_options.max_connections <= 0
                          ? SOMAXCONN
                          : std::min(a.export_options.max_connections,
                                     SOMAXCONN);
  if (!a.tcp) {
    struct sockaddr_un addr = {};
    addr.sun_family = AF_UNIX;
    if (a.socket_path.size() >= sizeof addr.sun_path) {
      return absl::InvalidArgumentError(absl::StrCat(
          "UNIX socket path '", a.socket_path, "' is too long"));
    }
    std::memcpy(addr.sun_path, a.socket_path.data(), a.socket_path.size());
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      return absl::InternalError(
          absl::StrCat("Failed to create socket: ", std::strerror(errno)));
    }
    if (unlink(a.socket_path.c_str()) < 0 && errno != ENOENT) {
      const int e = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("Failed to unlink socket ",
                                              a.socket_path, ": ",
                                              std::strerror(e)));
    }
    if (bind(fd, reinterpret_cast<struct sockaddr*>(&addr), sizeof addr) < 0 ||
        listen(fd, backlog) < 0) {
      const int e = errno;
      close(fd);
      return absl::InternalError(absl::StrCat("Failed to bind socket to ",
                                              a.socket_path, ": ",
                                              std::strerror(e)));
    }
    return fd;
  }
  struct addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  struct addrinfo* res = nullptr;
  const int rc = getaddrinfo(a.bind.c_str(), a.port.c_str(), &hints, &res);
  if (rc != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("address resolution failed for ", a.bind, ":", a.port,
                     ": ", gai_strerror(rc)));
  }
  int last_errno = 0;
  int fd = -1;
  for (struct addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC,
                ai->ai_protocol);
    if (fd < 0) {
      last_errno = errno;
      continue;
    }
    const int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        listen(fd, backlog) == 0) {
      break;
    }
    last_errno = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) {
    return absl::InternalError(absl::StrCat("Failed to bind socket: ",
                                            std::strerror(last_errno)));
  }
  return fd;
}

// -B: the bitmaps, found as qemu-nbd 7.2's nbd_export_create finds them (the
// export's node, then down its backing chain, filters included: the first
// node with a bitmap of that name), in its order (it prepends each -B to
// its list, so the last one given gets context id 2). Errors (qemu's
// words): "Bitmap 'NAME' is not found"; an inconsistent bitmap (in use on
// disk at open) "Bitmap 'NAME' is inconsistent and cannot be used".
absl::Status AddBitmaps(Args& a, OpenedImage& image) {
  for (auto it = a.bitmaps.rbegin(); it != a.bitmaps.rend(); ++it) {
    const std::string& name = *it;
    qcow2::Qcow2Node* owner = nullptr;
    const qcow2::Qcow2Node::BitmapInfo* info = nullptr;
    std::vector<qcow2::Qcow2Node::BitmapInfo> infos;
    for (io::BlockNode* node = image.node.get(); node != nullptr && !owner;) {
      if (auto* q = dynamic_cast<qcow2::Qcow2Node*>(node)) {
        infos = q->Bitmaps();
        for (const auto& b : infos) {
          if (b.name == name) {
            owner = q;
            info = &b;
            break;
          }
        }
      }
      node = node->backing() != nullptr ? node->backing()
                                        : node->filtered_child();
    }
    if (owner == nullptr) {
      return absl::NotFoundError(
          absl::StrCat("Bitmap '", name, "' is not found"));
    }
    if (info->inconsistent) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Bitmap '", name,
          "' is inconsistent and cannot be used"));
    }
    nbd_server::ExportOptions::Bitmap bitmap;
    bitmap.name = name;
    bitmap.dirty = [owner, name](uint64_t offset, uint64_t end)
        -> absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> {
      return owner->BitmapExtents(name, offset, end);
    };
    a.export_options.bitmaps.push_back(std::move(bitmap));
  }
  return absl::OkStatus();
}

absl::Status Serve(Args& a, Streams streams, int ready_fd) {
  // The stop signals arrive through a signalfd; blocked before the engine
  // starts any thread, so that every thread has them blocked.
  sigset_t stop_signals;
  sigemptyset(&stop_signals);
  sigaddset(&stop_signals, SIGTERM);
  sigaddset(&stop_signals, SIGINT);
  sigaddset(&stop_signals, SIGHUP);
  sigprocmask(SIG_BLOCK, &stop_signals, nullptr);
  const int signal_fd =
      signalfd(-1, &stop_signals, SFD_NONBLOCK | SFD_CLOEXEC);

  a.spec.filename = a.file;
  a.spec.read_only = a.export_options.read_only;
  a.export_options.write_through =
      a.spec.cache == "writethrough" || a.spec.cache == "directsync";
  absl::StatusOr<OpenedImage> opened;
  if (a.snapshot) {
    absl::StatusOr<TemporaryOverlay> overlay =
        OpenTemporaryOverlay(a.spec, streams.err);
    if (overlay.ok()) {
      opened = std::move(overlay->image);
    } else {
      opened = overlay.status();
    }
  } else {
    opened = OpenImage(a.spec, streams.err);
  }
  if (!opened.ok()) {
    // qemu-img's "Could not open '<file>': " is qemu-img's own prefix;
    // qemu-nbd puts its own in front of the block layer's message.
    absl::string_view message = opened.status().message();
    absl::ConsumePrefix(&message,
                        absl::StrCat("Could not open '", a.file, "': "));
    return WithMessage(opened.status(),
                       absl::StrCat("Failed to blk_new_open '", a.file,
                                    "': ", message));
  }
  OpenedImage image = *std::move(opened);
  // QEMU's raw_refresh_limits: a probed raw node has a request alignment of
  // 512, which qemu-nbd advertises as the minimum block size (iotest 241);
  // not under -o's raw node, whose own alignment is 1.
  if (image.probed && image.format == "raw" && a.offset == 0) {
    a.export_options.min_block = 512;
  }
  if (a.offset != 0) {
    // -o: a raw node over the opened one, as qemu-nbd 7.2 opens
    // {"driver": "raw", "file": <node>, "offset": N}. RawNode::Open's only
    // error without a size is this one, checked first so that the image is
    // closed, not dropped (Open destroys its file on error).
    if (a.offset > image.node->size()) {
      const uint64_t size = image.node->size();
      (void)CloseImage(image);
      return absl::InvalidArgumentError(absl::StrCat(
          "Offset (", a.offset,
          ") cannot be greater than size of the containing file (", size,
          ")"));
    }
    raw_format::RawOptions raw_options;
    raw_options.set_offset(a.offset);
    absl::StatusOr<std::unique_ptr<raw_format::RawNode>> raw =
        raw_format::RawNode::Open(std::move(image.node), raw_options);
    if (!raw.ok()) return raw.status();
    image.node = *std::move(raw);
  }
  a.export_options.size = VirtualSize(image);
  if (!a.load_snapshot.empty()) {
    if (absl::Status st = LoadSnapshot(image, a.load_snapshot, streams.err);
        !st.ok()) {
      (void)CloseImage(image);
      return st;
    }
  }
  if (absl::Status st = AddBitmaps(a, image); !st.ok()) {
    (void)CloseImage(image);
    return st;
  }
  absl::StatusOr<int> listen_fd = Listen(a);
  if (!listen_fd.ok()) {
    (void)CloseImage(image);
    return listen_fd.status();
  }
  if (!a.pid_file.empty()) {
    std::ofstream pid(a.pid_file, std::ios::trunc);
    pid << getpid() << "\n";
    if (!pid.good()) {
      close(*listen_fd);
      (void)CloseImage(image);
      return absl::InternalError(
          absl::StrCat("Failed to write pid file '", a.pid_file, "'"));
    }
  }
  // Serving, the process leaves its working directory as qemu-nbd 7.2 does
  // (chdir("/") "to free any busy filesystems"); the socket file removed at
  // exit is named by its absolute path first (qemu-nbd would leave a relative
  // one behind).
  if (!a.socket_path.empty() && a.socket_path[0] != '/') {
    char cwd[PATH_MAX];
    if (getcwd(cwd, sizeof cwd) != nullptr) {
      a.socket_path = absl::StrCat(cwd, "/", a.socket_path);
    }
  }
  if (chdir("/") < 0) {
    const int error = errno;
    close(*listen_fd);
    (void)CloseImage(image);
    return absl::InternalError(absl::StrCat(
        "Could not chdir to root directory: ", std::strerror(error)));
  }
  if (ready_fd >= 0) {
    // --fork: tell the parent, then leave the caller's streams (Debian's
    // qemu-nbd 7.2 does not give its daemon the parent's stderr back: its
    // "fix regression with qemu-nbd --fork run over ssh").
    const char ok = 0;
    [[maybe_unused]] ssize_t w = write(ready_fd, &ok, 1);
    close(ready_fd);
    const int null_fd = open("/dev/null", O_RDWR);
    if (null_fd >= 0) {
      dup2(null_fd, STDIN_FILENO);
      dup2(null_fd, STDOUT_FILENO);
      dup2(null_fd, STDERR_FILENO);
      if (null_fd > STDERR_FILENO) close(null_fd);
    }
  }
  absl::Status status;
  {
    nbd_server::Server server(*image.engine, *image.node, a.export_options);
    status = server.Run(server.Serve(*listen_fd, signal_fd));
  }
  close(*listen_fd);
  if (!a.socket_path.empty()) unlink(a.socket_path.c_str());
  const absl::Status closed = CloseImage(image);
  if (signal_fd >= 0) close(signal_fd);
  if (!status.ok()) return status;
  return closed;
}

// -L: the server's exports as qemu-nbd 7.2's qemu_nbd_client_list prints
// them (nbd_receive_export_list: LIST, then INFO with block sizes and
// LIST_META_CONTEXT for each export; after a failed INFO the remaining
// exports show their names only). The transmission flags are rebuilt from
// libnbd's can_* / is_* (all but SEND_RESIZE, which neither qemu-nbd 7.2
// nor imgtool offers).
absl::Status ListExports(const Args& a, Streams streams) {
  absl::StatusOr<const nbd_block::LibNbd*> loaded = nbd_block::LoadLibNbd();
  if (!loaded.ok()) return loaded.status();
  const nbd_block::LibNbd& nbd = **loaded;
  struct nbd_handle* h = nbd.nbd_create();
  if (h == nullptr) return absl::InternalError(nbd.nbd_get_error());
  struct Closer {
    const nbd_block::LibNbd& nbd;
    struct nbd_handle* h;
    ~Closer() { nbd.nbd_close(h); }
  } closer{nbd, h};
  nbd.nbd_set_opt_mode(h, true);
  if (a.list_tls.has_value()) {
    if (!a.list_tls->psk && a.list_tls->verify_peer &&
        !a.list_hostname.has_value()) {
      // QEMU's client finds this after the handshake
      // (qcrypto_tls_session_check_certificate).
      return absl::InvalidArgumentError(
          "No hostname for certificate validation");
    }
    if (!nbd_block::SetTlsCreds(nbd, h, *a.list_tls)) {
      return absl::InternalError(nbd.nbd_get_error());
    }
  }
  // The server's text of an option's error reply: libnbd 1.14 gives it only
  // to its debug output (as in nbd_block/nbd_node.cc).
  std::string server_message;
  nbd.nbd_set_debug_callback(
      h, nbd_debug_callback{
             .callback = [](void* data, const char*, const char* msg) {
               absl::string_view m(msg);
               if (absl::ConsumePrefix(&m,
                                       "handshake: server error message: ")) {
                 *static_cast<std::string*>(data) = std::string(m);
               }
               return 0;
             },
             .user_data = &server_message,
             .free = nullptr});
  nbd.nbd_set_debug(h, true);
  const int rc = a.tcp ? nbd.nbd_connect_tcp(h, a.bind.c_str(), a.port.c_str())
                       : nbd.nbd_connect_unix(h, a.socket_path.c_str());
  if (rc < 0 && a.list_tls.has_value() && !server_message.empty()) {
    // NBD_REP_ERR_POLICY to STARTTLS, in QEMU's words.
    return absl::UnavailableError(absl::StrCat(
        "Denied by server for option 5 (starttls)\nserver reported: ",
        server_message));
  }
  if (rc < 0) {
    // A failed TLS handshake as QEMU words it ("TLS handshake failed: E";
    // libnbd: "nbd_connect_unix: gnutls_handshake: E (a/b)").
    absl::string_view text = nbd.nbd_get_error();
    if (const size_t at = text.find("gnutls_handshake: ");
        at != absl::string_view::npos) {
      text.remove_prefix(at + strlen("gnutls_handshake: "));
      if (const size_t paren = text.rfind(" ("); paren != text.npos) {
        text = text.substr(0, paren);
      }
      return absl::UnavailableError(
          absl::StrCat("TLS handshake failed: ", text));
    }
    const int e = nbd.nbd_get_errno();
    const std::string where =
        a.tcp ? absl::StrCat(a.bind, ":", a.port) : a.socket_path;
    return absl::UnavailableError(
        absl::StrCat("Failed to connect to '", where, "': ",
                     e != 0 ? std::strerror(e) : nbd.nbd_get_error()));
  }
  struct Export {
    std::string name;
    std::string description;
    uint32_t flags = 0;
    int64_t block[3] = {0, 0, 0};
    int64_t size = 0;
    std::vector<std::string> contexts;
  };
  std::vector<Export> exports;
  nbd_list_callback list_cb = {
      .callback = [](void* data, const char* name, const char* description) {
        auto* v = static_cast<std::vector<Export>*>(data);
        v->push_back(Export{.name = name, .description = description});
        return 0;
      },
      .user_data = &exports,
      .free = nullptr};
  if (nbd.nbd_opt_list(h, list_cb) < 0) {
    if (!a.list_tls.has_value() &&
        absl::StrContains(server_message, "before TLS")) {
      // NBD_REP_ERR_TLS_REQD (libnbd does not say which error reply it
      // was; qemu-nbd's and imgtool's text for it names TLS): QEMU's
      // nbd_handle_reply_err words.
      return absl::UnavailableError(absl::StrCat(
          "TLS negotiation required before option 3 (list)\n"
          "Did you forget a valid tls-creds?\nserver reported: ",
          server_message));
    }
    return absl::UnavailableError(nbd.nbd_get_error());
  }
  nbd.nbd_set_debug(h, false);
  for (Export& e : exports) {
    if (nbd.nbd_set_export_name(h, e.name.c_str()) < 0 ||
        nbd.nbd_opt_info(h) < 0) {
      break;
    }
    e.size = nbd.nbd_get_size(h);
    e.flags = 1;  // NBD_FLAG_HAS_FLAGS
    const std::pair<int (*)(struct nbd_handle*), uint32_t> bits[] = {
        {nbd.nbd_is_read_only, 1u << 1},  {nbd.nbd_can_flush, 1u << 2},
        {nbd.nbd_can_fua, 1u << 3},       {nbd.nbd_is_rotational, 1u << 4},
        {nbd.nbd_can_trim, 1u << 5},      {nbd.nbd_can_zero, 1u << 6},
        {nbd.nbd_can_df, 1u << 7},        {nbd.nbd_can_multi_conn, 1u << 8},
        {nbd.nbd_can_cache, 1u << 10},    {nbd.nbd_can_fast_zero, 1u << 11}};
    for (const auto& [query, bit] : bits) {
      if (query(h) == 1) e.flags |= bit;
    }
    for (int i = 0; i < 3; ++i) {
      e.block[i] = std::max<int64_t>(0, nbd.nbd_get_block_size(h, i));
    }
    nbd_context_callback context_cb = {
        .callback = [](void* data, const char* name) {
          static_cast<std::vector<std::string>*>(data)->push_back(name);
          return 0;
        },
        .user_data = &e.contexts,
        .free = nullptr};
    nbd.nbd_opt_list_meta_context(h, context_cb);
  }
  nbd.nbd_opt_abort(h);
  static const char* const kFlagNames[] = {
      nullptr, "readonly", "flush",  "fua",   "rotational", "trim",
      "zeroes", "df",      "multi",  "resize", "cache",     "fast-zero"};
  std::string out = absl::StrCat("exports available: ", exports.size(), "\n");
  for (const Export& e : exports) {
    absl::StrAppend(&out, " export: '", e.name, "'\n");
    if (!e.description.empty()) {
      absl::StrAppend(&out, "  description: ", e.description, "\n");
    }
    if ((e.flags & 1) != 0) {
      absl::StrAppend(&out, "  size:  ", e.size, "\n  flags: 0x",
                      absl::Hex(e.flags), " (");
      for (int bit = 0; bit < 12; ++bit) {
        if (kFlagNames[bit] != nullptr && (e.flags & (1u << bit)) != 0) {
          absl::StrAppend(&out, " ", kFlagNames[bit]);
        }
      }
      absl::StrAppend(&out, " )\n");
    }
    if (e.block[0] != 0) {
      absl::StrAppend(&out, "  min block: ", e.block[0], "\n  opt block: ",
                      e.block[1], "\n  max block: ", e.block[2], "\n");
    }
    if (!e.contexts.empty()) {
      absl::StrAppend(&out, "  available meta contexts: ", e.contexts.size(),
                      "\n");
      for (const std::string& c : e.contexts) {
        absl::StrAppend(&out, "   ", c, "\n");
      }
    }
  }
  streams.out << out;
  return absl::OkStatus();
}

}  // namespace

absl::Status RunNbd(const std::vector<std::string>& args, Streams streams) {
  Args a;
  RETURN_IF_ERROR(ParseArgs(args, streams, a));
  if (a.list) return ListExports(a, streams);
  if (!a.fork) return Serve(a, streams, -1);
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) < 0) {
    return absl::InternalError(
        absl::StrCat("Failed to create pipe: ", std::strerror(errno)));
  }
  std::cout.flush();
  std::cerr.flush();
  const pid_t pid = fork();
  if (pid < 0) {
    return absl::InternalError(
        absl::StrCat("Failed to fork: ", std::strerror(errno)));
  }
  if (pid == 0) {
    close(pipe_fds[0]);
    setsid();
    return Serve(a, streams, pipe_fds[1]);
  }
  close(pipe_fds[1]);
  char byte;
  ssize_t r;
  do {
    r = read(pipe_fds[0], &byte, 1);
  } while (r < 0 && errno == EINTR);
  close(pipe_fds[0]);
  if (r == 1) return absl::OkStatus();
  // The child failed before listening and printed why.
  int child_status = 0;
  waitpid(pid, &child_status, 0);
  return Printed();
}

}  // namespace imgtool::cli
