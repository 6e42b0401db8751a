#include "nbd_block/nbd_node.h"

#include <libnbd.h>
#include <netdb.h>
#include <poll.h>
#include <fcntl.h>
#include <sys/socket.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "base/errno_status.h"
#include "base/options.h"
#include "nbd_block/libnbd.h"
#include "nbd_block/oldstyle.h"

namespace imgtool::nbd_block {
namespace {

// libnbd's functions. Called only where an nbd handle exists, i.e. after
// NbdNode::Open loaded the library.
const LibNbd& Nbd() { return **LoadLibNbd(); }

constexpr char kDefaultPort[] = "10809";

absl::Status BadUrl() {
  return absl::InvalidArgumentError("No valid URL specified");
}

// %XX decoding as QEMU's uri_string_unescape; false on a bad escape.
bool Unescape(absl::string_view in, std::string* out) {
  out->clear();
  for (size_t i = 0; i < in.size(); ++i) {
    if (in[i] != '%') {
      out->push_back(in[i]);
      continue;
    }
    if (i + 2 >= in.size()) return false;
    const char hi = in[i + 1];
    const char lo = in[i + 2];
    if (!absl::ascii_isxdigit(hi) || !absl::ascii_isxdigit(lo)) return false;
    auto v = [](char c) {
      return absl::ascii_isdigit(c) ? c - '0' : absl::ascii_tolower(c) - 'a' + 10;
    };
    out->push_back(static_cast<char>(v(hi) * 16 + v(lo)));
    i += 2;
  }
  return true;
}

using Setter = std::function<void(const std::string&, const std::string&)>;

// nbd_parse_uri.
absl::Status ParseUri(absl::string_view filename, const Setter& set) {
  const size_t colon = filename.find("://");
  const absl::string_view scheme = filename.substr(0, colon);
  bool is_unix;
  // nbds, nbds+unix: the NBD URI spec's (doc/uri.md) TLS schemes.
  const bool tls = scheme == "nbds" || scheme == "nbds+unix";
  if (scheme == "nbd" || scheme == "nbd+tcp" || scheme == "nbds") {
    is_unix = false;
  } else if (scheme == "nbd+unix" || scheme == "nbds+unix") {
    is_unix = true;
  } else {
    return BadUrl();
  }
  absl::string_view rest = filename.substr(colon + 3);
  if (size_t hash = rest.find('#'); hash != absl::string_view::npos) {
    rest = rest.substr(0, hash);
  }
  absl::string_view query;
  bool has_query = false;
  if (size_t q = rest.find('?'); q != absl::string_view::npos) {
    query = rest.substr(q + 1);
    has_query = true;
    rest = rest.substr(0, q);
  }
  const size_t slash = rest.find('/');
  const absl::string_view authority = rest.substr(0, slash);
  const absl::string_view path =
      slash == absl::string_view::npos ? absl::string_view() : rest.substr(slash);

  // Query parameters ('&' or ';' separated, as QEMU's query_params_parse).
  std::vector<std::pair<std::string, std::string>> params;
  if (has_query && !query.empty()) {
    for (absl::string_view part : absl::StrSplit(query, absl::ByAnyChar("&;"))) {
      if (part.empty()) continue;
      const size_t eq = part.find('=');
      std::string name, value;
      if (!Unescape(part.substr(0, eq), &name)) return BadUrl();
      if (eq != absl::string_view::npos &&
          !Unescape(part.substr(eq + 1), &value)) {
        return BadUrl();
      }
      params.emplace_back(std::move(name), std::move(value));
    }
  }
  // nbds: libnbd's tls-certificates=DIR (its nbd_connect_uri) as well.
  std::optional<std::string> certificates;
  if (tls) {
    for (auto it = params.begin(); it != params.end(); ++it) {
      if (it->first == "tls-certificates" && !certificates.has_value()) {
        certificates = it->second;
        params.erase(it);
        break;
      }
    }
  }
  if (params.size() > 1 || (is_unix && params.empty()) ||
      (!is_unix && !params.empty())) {
    return BadUrl();
  }

  // Authority: [userinfo@]host[:port].
  absl::string_view host = authority;
  if (size_t at = host.rfind('@'); at != absl::string_view::npos) {
    host = host.substr(at + 1);
  }
  absl::string_view port;
  bool has_port = false;
  if (absl::StartsWith(host, "[")) {
    const size_t close = host.find(']');
    if (close == absl::string_view::npos) return BadUrl();
    absl::string_view after = host.substr(close + 1);
    host = host.substr(0, close + 1);
    if (!after.empty()) {
      if (after[0] != ':') return BadUrl();
      port = after.substr(1);
      has_port = true;
    }
  } else if (size_t c = host.rfind(':'); c != absl::string_view::npos) {
    port = host.substr(c + 1);
    has_port = true;
    host = host.substr(0, c);
  }
  int port_number = 0;
  if (has_port && !port.empty()) {
    if (port.size() > 5 || !absl::SimpleAtoi(port, &port_number) ||
        !std::all_of(port.begin(), port.end(),
                     [](char c) { return absl::ascii_isdigit(c); }) ||
        port_number > 65535) {
      return BadUrl();
    }
  }

  std::string export_name;
  absl::string_view p = path;
  if (absl::StartsWith(p, "/")) p.remove_prefix(1);
  if (!Unescape(p, &export_name)) return BadUrl();

  if (is_unix) {
    if (!host.empty() || port_number != 0 || params[0].first != "socket") {
      return BadUrl();
    }
    set("server.type", "unix");
    set("server.path", params[0].second);
  } else {
    if (host.empty()) return BadUrl();
    std::string h(host);
    if (absl::StartsWith(h, "[") && absl::EndsWith(h, "]")) {
      h = h.substr(1, h.size() - 2);
    }
    set("server.type", "inet");
    set("server.host", h);
    set("server.port",
        port_number != 0 ? absl::StrCat(port_number) : kDefaultPort);
  }
  if (!export_name.empty()) set("export", export_name);
  if (tls) set("x-tls", "on");
  if (certificates.has_value()) set("x-tls-certificates", *certificates);
  return absl::OkStatus();
}

// nbd_aio_* completion callback: records the result; the node wakes the
// coroutine after libnbd returns (no libnbd calls from here).
int OnComplete(void* user_data, int* error) {
  auto* command = static_cast<NbdNode::Command*>(user_data);
  command->error = *error;
  command->node->Completed(command);
  return 1;  // retire the command
}

int OnExtent(void* user_data, const char* context, uint64_t /*offset*/,
             uint32_t* entries, size_t nr_entries, int* /*error*/) {
  auto* command = static_cast<NbdNode::Command*>(user_data);
  if (context != command->node->context() || !command->extents.empty()) {
    return 0;
  }
  command->extents.assign(entries, entries + (nr_entries & ~size_t{1}));
  return 0;
}

nbd_completion_callback Completion(NbdNode::Command* command) {
  return nbd_completion_callback{
      .callback = OnComplete, .user_data = command, .free = nullptr};
}

// Connects a stream socket to the server (blocking). -errno on failure.
int ConnectSocket(const NbdAddress& address) {
  if (address.is_unix) {
    sockaddr_un sun = {};
    sun.sun_family = AF_UNIX;
    if (address.path.size() >= sizeof(sun.sun_path)) return -ENAMETOOLONG;
    std::memcpy(sun.sun_path, address.path.data(), address.path.size());
    const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -errno;
    if (connect(fd, reinterpret_cast<sockaddr*>(&sun), sizeof(sun)) != 0) {
      const int e = errno;
      close(fd);
      return -e;
    }
    return fd;
  }
  addrinfo hints = {};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(address.host.c_str(), address.port.c_str(), &hints,
                  &result) != 0) {
    return -EHOSTUNREACH;
  }
  int error = ECONNREFUSED;
  int fd = -1;
  for (addrinfo* ai = result; ai != nullptr; ai = ai->ai_next) {
    fd = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
    if (fd < 0) {
      error = errno;
      continue;
    }
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) == 0) break;
    error = errno;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(result);
  return fd >= 0 ? fd : -error;
}

std::string AddressText(const NbdAddress& address) {
  if (address.is_unix) return address.path;
  return absl::StrCat(address.host, ":", address.port);
}

}  // namespace

absl::Status ParseNbdFilename(absl::string_view filename, const Setter& set) {
  if (absl::StrContains(filename, "://")) return ParseUri(filename, set);
  // The legacy syntax (nbd_parse_filename).
  std::string file(filename);
  constexpr absl::string_view kExportOpt = ":exportname=";
  if (size_t at = file.find(kExportOpt.data(), 0, kExportOpt.size());
      at != std::string::npos) {
    const std::string name = file.substr(at + kExportOpt.size());
    if (name.empty()) return absl::OkStatus();  // "address missing" later
    set("export", name);
    file.resize(at);
  }
  absl::string_view spec = file;
  if (!absl::ConsumePrefix(&spec, "nbd:")) {
    return absl::InvalidArgumentError(
        "File name string must start with 'nbd:'");
  }
  if (spec.empty()) return absl::OkStatus();
  if (absl::ConsumePrefix(&spec, "unix:")) {
    set("server.type", "unix");
    set("server.path", std::string(spec));
    return absl::OkStatus();
  }
  // inet_parse: host:port ([v6]:port).
  std::string host;
  absl::string_view port;
  if (absl::StartsWith(spec, "[")) {
    const size_t close = spec.find("]:");
    if (close == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("error parsing IPv6 address '", spec, "'"));
    }
    host = std::string(spec.substr(1, close - 1));
    port = spec.substr(close + 2);
  } else {
    const size_t c = spec.find(':');
    if (c == absl::string_view::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("error parsing address '", spec, "'"));
    }
    host = std::string(spec.substr(0, c));
    port = spec.substr(c + 1);
  }
  set("server.type", "inet");
  set("server.host", host);
  set("server.port", std::string(port));
  return absl::OkStatus();
}

absl::StatusOr<NbdAddress> AddressFromOptions(
    const std::function<const std::string*(const std::string&)>& get) {
  NbdAddress address;
  const std::string* type = get("server.type");
  if (type == nullptr) {
    return absl::InvalidArgumentError("NBD server address missing");
  }
  if (*type == "unix") {
    address.is_unix = true;
    const std::string* path = get("server.path");
    if (path == nullptr) {
      return absl::InvalidArgumentError("Parameter 'path' is missing");
    }
    address.path = *path;
  } else if (*type == "inet") {
    const std::string* host = get("server.host");
    if (host == nullptr) {
      return absl::InvalidArgumentError("Parameter 'host' is missing");
    }
    const std::string* port = get("server.port");
    if (port == nullptr) {
      return absl::InvalidArgumentError("Parameter 'port' is missing");
    }
    address.host = *host;
    address.port = *port;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "Parameter 'type' does not accept value '", *type, "'"));
  }
  if (const std::string* e = get("export"); e != nullptr) {
    address.export_name = *e;
  }
  // nbd_process_options: nbd_get_tls_creds, then the host name.
  if (const std::string* id = get("tls-creds"); id != nullptr) {
    absl::StatusOr<block::ObjectRegistry::TlsCreds> creds =
        block::ObjectRegistry::Default().LookupTlsCreds(*id);
    if (creds.ok() && creds->server) {
      creds = absl::InvalidArgumentError(
          "Expected TLS credentials for a client endpoint");
    }
    if (!creds.ok()) return creds.status();
    address.tls_creds = *id;
    address.tls = *creds;
    if (const std::string* h = get("tls-hostname"); h != nullptr) {
      address.tls_hostname = *h;
    } else if (!address.is_unix) {
      address.tls_hostname = address.host;
    }
  }
  // x-tls=on (nbds://, nbds+unix://): TLS required, with tls-creds' or
  // libnbd's default certificates.
  if (const std::string* t = get("x-tls"); t != nullptr) {
    if (*t != "on" && *t != "off") {
      return absl::InvalidArgumentError(absl::StrCat(
          "Parameter 'x-tls' expects 'on' or 'off'"));
    }
    address.tls_required = *t == "on";
  }
  if (const std::string* d = get("x-tls-certificates"); d != nullptr) {
    address.tls_certificates = *d;
  }
  if (address.tls_required && !address.tls_creds.has_value() &&
      !address.tls_certificates.has_value()) {
    return absl::InvalidArgumentError(
        "nbds:// needs tls-certificates=DIR in the URI or the tls-creds "
        "option");
  }
  if (const std::string* b = get("x-dirty-bitmap"); b != nullptr) {
    // NBD_MAX_STRING_SIZE (the NBD protocol document, "Metadata querying").
    if (b->size() > 4096) {
      return absl::InvalidArgumentError(
          "x-dirty-bitmap query too long to send to server");
    }
    address.x_dirty_bitmap = *b;
  }
  // QemuOpts numbers kept in 32 bits, as QEMU's uint32_t fields.
  if (const std::string* t = get("open-timeout"); t != nullptr) {
    absl::StatusOr<uint64_t> n = ParseNumberOption("open-timeout", *t);
    if (!n.ok()) return n.status();
    address.open_timeout = static_cast<uint32_t>(*n);
  }
  if (const std::string* d = get("reconnect-delay"); d != nullptr) {
    absl::StatusOr<uint64_t> n = ParseNumberOption("reconnect-delay", *d);
    if (!n.ok()) return n.status();
    address.reconnect_delay = static_cast<uint32_t>(*n);
  }
  // multi-conn (imgtool's): how many connections, when the server offers
  // multi-conn.
  if (const std::string* m = get("multi-conn"); m != nullptr) {
    absl::StatusOr<uint64_t> n = ParseNumberOption("multi-conn", *m);
    if (!n.ok()) return n.status();
    if (*n < 1 || *n > kMaxConnections) {
      return absl::InvalidArgumentError(absl::StrCat(
          "Parameter 'multi-conn' expects a number from 1 to ",
          kMaxConnections));
    }
    address.multi_conn = static_cast<uint32_t>(*n);
  }
  return address;
}

std::string ExactFilename(const NbdAddress& a) {
  const absl::string_view scheme = a.tls_required ? "nbds" : "nbd";
  std::string certificates;
  if (a.tls_required && a.tls_certificates.has_value()) {
    certificates = absl::StrCat("tls-certificates=", *a.tls_certificates);
  }
  if (a.is_unix) {
    if (!certificates.empty()) certificates.insert(0, "&");
    if (a.export_name.has_value()) {
      return absl::StrCat(scheme, "+unix:///", *a.export_name,
                          "?socket=", a.path, certificates);
    }
    return absl::StrCat(scheme, "+unix://?socket=", a.path, certificates);
  }
  if (absl::StrContains(a.host, ':')) return "";
  if (!certificates.empty()) certificates.insert(0, "?");
  if (a.export_name.has_value()) {
    return absl::StrCat(scheme, "://", a.host, ":", a.port, "/",
                        *a.export_name, certificates);
  }
  return absl::StrCat(scheme, "://", a.host, ":", a.port, certificates);
}

NbdNode::NbdNode(std::string filename, const NbdAddress& address,
                 io::Engine* engine, bool read_only)
    : BlockNode(std::move(filename), read_only),
      address_(address),
      engine_(engine) {}

NbdNode::~NbdNode() {
  for (const std::unique_ptr<Connection>& c : connections_) {
    if (c->handle != nullptr) Nbd().nbd_close(c->handle);
    if (c->poll_fd >= 0) close(c->poll_fd);
  }
}

namespace {

// A new libnbd handle connected to `address` and negotiated (blocking),
// asking for the meta context `context`; the caller owns it. Errors as
// NbdNode::Open's (kUnavailable: no connection).
// `greeting_ms` >= 0: the server must send its greeting within that many
// milliseconds (a server that has all the clients it takes leaves a new
// connection in its listen backlog: qemu-nbd -e N); else kUnavailable.
absl::StatusOr<nbd_handle*> ConnectHandle(const NbdAddress& address,
                                          const std::string& context,
                                          int greeting_ms = -1) {
  int fd = ConnectSocket(address);
  if (fd < 0) {
    return absl::UnavailableError(absl::StrCat("Failed to connect to '",
                                               AddressText(address), "': ",
                                               std::strerror(-fd)));
  }
  // An oldstyle server with transmission flags 0 (libnbd refuses it, QEMU
  // takes it) is relayed with NBD_FLAG_HAS_FLAGS set (oldstyle.h); any
  // other gets `fd` unread.
  absl::StatusOr<int> adapted = AdaptOldstyle(fd, greeting_ms);
  if (!adapted.ok()) return adapted.status();
  fd = *adapted;
  nbd_handle* h = Nbd().nbd_create();
  if (h == nullptr) {
    close(fd);
    return absl::ResourceExhaustedError(Nbd().nbd_get_error());
  }
  const std::string export_name = address.export_name.value_or("");
  bool tls_ok = true;
  if (address.tls_creds.has_value()) {
    const block::ObjectRegistry::TlsCreds& t = address.tls;
    if (!t.psk && t.verify_peer && !address.tls_hostname.has_value()) {
      // QEMU finds this after the handshake (qcrypto_tls_session_check_
      // certificate on the client's side).
      close(fd);
      Nbd().nbd_close(h);
      return absl::UnavailableError("No hostname for certificate validation");
    }
    tls_ok = SetTlsCreds(Nbd(), h, t);
  } else if (address.tls_required) {
    // nbds://...tls-certificates=DIR without tls-creds: as libnbd's
    // nbd_connect_uri (x509 from DIR, the peer's chain verified).
    tls_ok = Nbd().nbd_set_tls(h, LIBNBD_TLS_REQUIRE) == 0 &&
             Nbd().nbd_set_tls_certificates(
                 h, address.tls_certificates.value_or("").c_str()) == 0;
  }
  if (!tls_ok || Nbd().nbd_set_export_name(h, export_name.c_str()) != 0 ||
      Nbd().nbd_add_meta_context(h, context.c_str()) != 0) {
    absl::Status st = absl::InternalError(Nbd().nbd_get_error());
    close(fd);
    Nbd().nbd_close(h);
    return st;
  }
  // The server's text of an option's error reply (NBD_REP_ERR_*): libnbd
  // 1.14 gives it only to its debug output ("handshake: server error
  // message: TEXT"), so the handshake runs with debug on. Each option
  // starts afresh ("transition: ... -> NEWSTYLE.OPT_GO.START"): the text
  // kept is the last option's, the one that failed.
  std::string server_message;
  auto on_debug = [](void* user_data, const char* /*context*/,
                     const char* msg) {
    auto* text = static_cast<std::string*>(user_data);
    absl::string_view m(msg);
    if (absl::ConsumePrefix(&m, "handshake: server error message: ")) {
      *text = std::string(m);
    } else if (absl::StartsWith(m, "transition: ") &&
               absl::EndsWith(m, ".START")) {
      text->clear();
    }
    return 0;
  };
  Nbd().nbd_set_debug_callback(
      h, nbd_debug_callback{
             .callback = on_debug, .user_data = &server_message, .free = nullptr});
  Nbd().nbd_set_debug(h, true);
  // libnbd owns fd from here (closed by nbd_close).
  const int connected = Nbd().nbd_connect_socket(h, fd);
  Nbd().nbd_set_debug(h, false);
  if (connected != 0) {
    const int e = Nbd().nbd_get_errno();
    absl::Status st = absl::UnavailableError(Nbd().nbd_get_error());
    const std::string text = Nbd().nbd_get_error();
    if (absl::StrContains(text, "server refused TLS")) {
      // NBD_REP_ERR_POLICY to STARTTLS: QEMU's words, qemu-nbd's text.
      st = absl::UnavailableError(
          "Denied by server for option 5 (starttls)\n"
          "server reported: TLS not configured");
    } else if (absl::StrContains(text, "server requires TLS")) {
      // NBD_REP_ERR_TLS_REQD to GO: QEMU's words, qemu-nbd's text.
      st = absl::UnavailableError(
          "TLS negotiation required before option 7 (go)\n"
          "Did you forget a valid tls-creds?\n"
          "server reported: Option 0x7 not permitted before TLS");
    } else if (e == ENOENT) {
      // NBD_REP_ERR_UNKNOWN: QEMU's "Requested export not available", and
      // the server's text as a hint (nbd_handle_reply_err), e.g.
      // qemu-nbd's "export 'NAME' not present", nbd-server's "Export
      // unknown".
      st = absl::NotFoundError(
          server_message.empty()
              ? std::string("Requested export not available")
              : absl::StrCat("Requested export not available\nserver reported: ",
                             server_message));
    }
    Nbd().nbd_close(h);
    return st;
  }
  return h;
}

// QEMU's connect thread waits 1 s after a failed attempt, doubling up to
// 16 s (nbd/client-connection.c).
constexpr uint64_t kFirstRetryMs = 1000;
constexpr uint64_t kMaxRetryMs = 16000;

int64_t NowMs() { return absl::ToUnixMillis(absl::Now()); }

}  // namespace

absl::StatusOr<std::unique_ptr<NbdNode>> NbdNode::Open(
    std::string filename, const NbdAddress& address, io::Engine* engine,
    bool read_only) {
  if (absl::StatusOr<const LibNbd*> lib = LoadLibNbd(); !lib.ok()) {
    return lib.status();
  }
  std::unique_ptr<NbdNode> node(
      new NbdNode(std::move(filename), address, engine, read_only));
  node->context_ =
      address.x_dirty_bitmap.value_or(LIBNBD_CONTEXT_BASE_ALLOCATION);
  node->allocation_depth_ = node->context_ == "qemu:allocation-depth";
  absl::StatusOr<nbd_handle*> h = ConnectHandle(address, node->context_);
  // open-timeout: more attempts while there is no server (blocking, as the
  // first).
  const int64_t deadline =
      NowMs() + int64_t{1000} * static_cast<int64_t>(address.open_timeout);
  uint64_t wait_ms = kFirstRetryMs;
  while (!h.ok() && absl::IsUnavailable(h.status()) && NowMs() < deadline) {
    const int64_t left = deadline - NowMs();
    usleep(static_cast<useconds_t>(
        std::min<int64_t>(static_cast<int64_t>(wait_ms), left) * 1000));
    wait_ms = std::min(wait_ms * 2, kMaxRetryMs);
    h = ConnectHandle(address, node->context_);
  }
  if (!h.ok()) return h.status();
  node->connections_.push_back(std::make_unique<Connection>());
  node->Adopt(*node->connections_[0], *h);
  if (node->size_ == UINT64_MAX) {
    return absl::InternalError(Nbd().nbd_get_error());
  }
  if (address.x_dirty_bitmap.has_value() && !node->base_allocation_) {
    // QEMU 7.2 sets "requested x-dirty-bitmap C not found" but qemu-img
    // prints the errno alone.
    return absl::InvalidArgumentError("Could not open image: Invalid argument");
  }
  if (Nbd().nbd_is_read_only(*h) == 1 && !read_only) {
    return absl::PermissionDeniedError("Could not open image: Permission denied");
  }
  // multi-conn: more connections to the same export, each negotiated as the
  // first. One that fails (or whose server does not greet it in time) ends
  // the opening: the node works with those it has.
  constexpr int kGreetingMs = 5000;
  const uint32_t wanted = std::clamp<uint32_t>(address.multi_conn, 1,
                                               kMaxConnections);
  while (node->can_multi_conn_ && node->connections_.size() < wanted) {
    absl::StatusOr<nbd_handle*> more =
        ConnectHandle(address, node->context_, kGreetingMs);
    if (!more.ok()) break;
    if (static_cast<uint64_t>(Nbd().nbd_get_size(*more)) != node->size_) {
      Nbd().nbd_close(*more);
      break;
    }
    node->connections_.push_back(std::make_unique<Connection>());
    node->Adopt(*node->connections_.back(), *more);
  }
  return node;
}

void NbdNode::Adopt(Connection& c, nbd_handle* h) {
  if (c.handle != nullptr) Nbd().nbd_close(c.handle);
  c.handle = h;
  if (c.poll_fd >= 0) close(c.poll_fd);
  const int fd = Nbd().nbd_aio_get_fd(h);
  c.poll_fd = fd >= 0 ? fcntl(fd, F_DUPFD_CLOEXEC, 0) : -1;
  const int64_t size = Nbd().nbd_get_size(h);
  size_ = size < 0 ? UINT64_MAX : static_cast<uint64_t>(size);
  can_flush_ = Nbd().nbd_can_flush(h) == 1;
  can_trim_ = Nbd().nbd_can_trim(h) == 1;
  can_zero_ = Nbd().nbd_can_zero(h) == 1;
  can_fast_zero_ = Nbd().nbd_can_fast_zero(h) == 1;
  can_multi_conn_ = Nbd().nbd_can_multi_conn(h) == 1;
  base_allocation_ = Nbd().nbd_can_meta_context(h, context_.c_str()) == 1;
  const int64_t maximum = Nbd().nbd_get_block_size(h, LIBNBD_SIZE_MAXIMUM);
  max_request_ = maximum > 0 ? std::min<uint64_t>(static_cast<uint64_t>(maximum),
                                                  uint64_t{64} << 20)
                             : uint64_t{32} << 20;
}

bool NbdNode::ConnectionLost(const Connection& c) {
  return Nbd().nbd_aio_is_dead(c.handle) == 1 ||
         Nbd().nbd_aio_is_closed(c.handle) == 1;
}

NbdNode::Connection& NbdNode::Pick() {
  const size_t n = connections_.size();
  Connection* best = nullptr;
  for (size_t k = 0; k < n; ++k) {
    Connection* c = connections_[(next_connection_ + k) % n].get();
    if (best == nullptr || c->waiting < best->waiting) best = c;
  }
  next_connection_ = (next_connection_ + 1) % n;
  return *best;
}

void NbdNode::Pump(Connection& c) {
  const unsigned direction = Nbd().nbd_aio_get_direction(c.handle);
  const int in_flight = Nbd().nbd_aio_in_flight(c.handle);
  if (in_flight > 0) {
    max_in_flight_ = std::max<uint64_t>(max_in_flight_,
                                        static_cast<uint64_t>(in_flight));
  }
  const int fd = c.poll_fd;
  if (fd < 0 || ConnectionLost(c)) return;
  if (!c.read_armed && in_flight > 0 &&
      (direction & LIBNBD_AIO_DIRECTION_READ) != 0) {
    c.read_armed = true;
    c.read_poll = io::Op{.kind = io::OpKind::kPoll, .fd = fd, .mode = POLLIN};
    c.read_poll.done = [this, &c](io::Op& op) {
      OnPollDone(c, false, op.result);
    };
    engine_->Submit(&c.read_poll);
  }
  if (!c.write_armed && (direction & LIBNBD_AIO_DIRECTION_WRITE) != 0) {
    c.write_armed = true;
    c.write_poll = io::Op{.kind = io::OpKind::kPoll, .fd = fd, .mode = POLLOUT};
    c.write_poll.done = [this, &c](io::Op& op) {
      OnPollDone(c, true, op.result);
    };
    engine_->Submit(&c.write_poll);
  }
}

void NbdNode::WakeCompleted() {
  std::vector<Command*> done;
  done.swap(completed_);
  for (Command* command : done) command->done.Set();
}

void NbdNode::OnPollDone(Connection& c, bool write, int64_t result) {
  (write ? c.write_armed : c.read_armed) = false;
  // Readable, writable, or hung up / in error: libnbd finds out which.
  if (write && result >= 0) {
    Nbd().nbd_aio_notify_write(c.handle);
  } else {
    Nbd().nbd_aio_notify_read(c.handle);
  }
  Pump(c);
  if (c.polls_idle != nullptr && !c.read_armed && !c.write_armed) {
    std::exchange(c.polls_idle, nullptr)->Set();
  }
  WakeCompleted();
}

io::Task<absl::Status> NbdNode::Wait(Connection& c, Command& command,
                                     int64_t cookie, const char* what) {
  if (cookie < 0) {
    const int e = Nbd().nbd_get_errno();
    co_return ErrnoStatus(filename(), what, e != 0 ? e : EIO);
  }
  ++commands_issued_;
  // The command may have completed inside the nbd_aio_* call (a reply
  // already read); completed_ then holds it.
  WakeCompleted();
  Pump(c);
  co_await command.done.Wait();
  if (command.error != 0) {
    co_return ErrnoStatus(filename(), what, command.error);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> NbdNode::InPieces(
    uint64_t length, uint64_t max_piece, const char* what, Effect effect,
    std::function<int64_t(nbd_handle* handle, uint64_t done, uint64_t n,
                          Command* command)>
        issue) {
  uint64_t done = 0;
  while (done < length) {
    const uint64_t n = std::min(length - done, max_piece);
    Command command;
    absl::Status st = co_await Run(
        what, command,
        [&](nbd_handle* h, Command* c) { return issue(h, done, n, c); },
        effect);
    if (!st.ok()) co_return st;
    done += n;
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> NbdNode::Run(const char* what, Command& command,
                                    const Issue& issue, Effect effect,
                                    Connection* on) {
  Connection& c = on != nullptr ? *on : Pick();
  for (;;) {
    const uint64_t generation = c.generation;
    command = Command{.node = this};
    ++c.waiting;
    absl::Status st = co_await Wait(c, command, issue(c.handle, &command), what);
    --c.waiting;
    if (effect == Effect::kWrites) c.written = true;
    if (st.ok() || !ConnectionLost(c)) co_return st;
    // QEMU's nbd client fails requests on a lost connection with EIO.
    if (address_.reconnect_delay == 0 || !co_await Reconnect(c, generation)) {
      co_return ErrnoStatus(filename(), what, EIO);
    }
  }
}

io::Task<bool> NbdNode::Reconnect(Connection& c, uint64_t generation) {
  io::ScopedLock lock = co_await io::ScopedLock::Take(c.reconnect_mu);
  if (c.generation != generation) co_return !ConnectionLost(c);
  if (!c.lost_at_ms.has_value()) c.lost_at_ms = NowMs();
  const int64_t deadline =
      *c.lost_at_ms +
      int64_t{1000} * static_cast<int64_t>(address_.reconnect_delay);
  // The engine's polls on the old socket end before it is replaced.
  if (c.poll_fd >= 0) shutdown(c.poll_fd, SHUT_RDWR);
  while (c.read_armed || c.write_armed) {
    io::Event idle;
    c.polls_idle = &idle;
    co_await idle.Wait();
  }
  uint64_t wait_ms = kFirstRetryMs;
  for (;;) {
    absl::StatusOr<nbd_handle*> h = ConnectHandle(address_, context_);
    if (h.ok() && static_cast<uint64_t>(Nbd().nbd_get_size(*h)) != size_) {
      Nbd().nbd_close(*h);  // another export now: not this node's data
      h = absl::DataLossError("export size changed");
    }
    if (h.ok()) {
      Adopt(c, *h);
      ForgetStatus();  // the server may have started again on other data
      ++c.generation;
      ++reconnects_;
      c.lost_at_ms.reset();
      co_return true;
    }
    const int64_t left = deadline - NowMs();
    if (left <= 0) co_return false;
    co_await Sleep(std::min<uint64_t>(wait_ms, static_cast<uint64_t>(left)));
    wait_ms = std::min(wait_ms * 2, kMaxRetryMs);
  }
}

io::Task<void> NbdNode::Sleep(uint64_t ms) {
  const int tfd = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
  if (tfd < 0) {
    usleep(static_cast<useconds_t>(ms * 1000));
    co_return;
  }
  itimerspec spec = {};
  spec.it_value.tv_sec = static_cast<time_t>(ms / 1000);
  spec.it_value.tv_nsec = static_cast<long>(ms % 1000) * 1000000 + 1;
  timerfd_settime(tfd, 0, &spec, nullptr);
  io::Event fired;
  timer_fired_ = &fired;
  timer_poll_ = io::Op{.kind = io::OpKind::kPoll, .fd = tfd, .mode = POLLIN};
  timer_poll_.done = [this](io::Op&) {
    std::exchange(timer_fired_, nullptr)->Set();
  };
  engine_->Submit(&timer_poll_);
  co_await fired.Wait();
  close(tfd);
}

io::Task<absl::Status> NbdNode::DoRead(uint64_t offset, io::IoVec buf) {
  // Past the end: zeroes.
  const uint64_t readable =
      offset >= size_ ? 0 : std::min<uint64_t>(buf.size(), size_ - offset);
  if (readable < buf.size()) {
    std::memset(buf.data() + readable, 0, buf.size() - readable);
  }
  // Pieces of at most kReadPiece, all sent at once (see the header).
  const uint64_t piece = std::min(kReadPiece, max_request_);
  if (readable <= piece) {
    co_return co_await ReadPiece(offset, io::IoVec(buf.data(), readable));
  }
  uint64_t running = (readable + piece - 1) / piece;
  absl::Status first;
  io::Event all_done;
  for (uint64_t done = 0; done < readable; done += piece) {
    const uint64_t n = std::min(piece, readable - done);
    io::Spawn(ReadPiece(offset + done, io::IoVec(buf.data() + done, n)),
              [&](absl::Status st) {
                if (first.ok()) first = std::move(st);
                if (--running == 0) all_done.Set();
              });
  }
  co_await all_done.Wait();
  co_return first;
}

io::Task<absl::Status> NbdNode::ReadPiece(uint64_t offset, io::IoVec buf) {
  Command command;
  co_return co_await Run("read", command, [&](nbd_handle* h, Command* c) {
    return Nbd().nbd_aio_pread(h, buf.data(), buf.size(), offset,
                               Completion(c), 0);
  });
}

io::Task<absl::Status> NbdNode::DoWrite(uint64_t offset, io::ConstIoVec data) {
  // Past the export's end (a qcow2 image growing in an export): QEMU's nbd
  // node fails with EINVAL, the request never sent.
  if (offset > size_ || data.size() > size_ - offset) {
    co_return ErrnoStatus(filename(), "write", EINVAL);
  }
  ForgetStatus();
  absl::Status st = co_await InPieces(
      data.size(), max_request_, "write", Effect::kWrites,
      [&](nbd_handle* h, uint64_t done, uint64_t n, Command* command) {
        return Nbd().nbd_aio_pwrite(h, data.data() + done, n, offset + done,
                                    Completion(command), 0);
      });
  ForgetStatus();
  co_return st;
}

io::Task<absl::Status> NbdNode::DoWriteZeroes(uint64_t offset, uint64_t length,
                                              io::WriteZeroesFlags flags) {
  if (!can_zero_ || (flags.no_fallback && !can_fast_zero_)) {
    co_return absl::UnimplementedError("Operation not supported");
  }
  uint32_t cmd_flags = 0;
  if (!flags.may_unmap) cmd_flags |= LIBNBD_CMD_FLAG_NO_HOLE;
  if (flags.no_fallback) cmd_flags |= LIBNBD_CMD_FLAG_FAST_ZERO;
  constexpr uint64_t kMaxZero = uint64_t{1} << 30;
  ForgetStatus();
  absl::Status st = co_await InPieces(
      length, kMaxZero, "write zeroes", Effect::kWrites,
      [&](nbd_handle* h, uint64_t done, uint64_t n, Command* command) {
        return Nbd().nbd_aio_zero(h, n, offset + done, Completion(command),
                                  cmd_flags);
      });
  ForgetStatus();
  if (!st.ok() && flags.no_fallback && StatusErrno(st) == ENOTSUP) {
    co_return absl::UnimplementedError("Operation not supported");
  }
  co_return st;
}

io::Task<absl::Status> NbdNode::DoDiscard(uint64_t offset, uint64_t length) {
  if (!can_trim_) co_return absl::OkStatus();  // QEMU: nothing to do
  constexpr uint64_t kMaxTrim = uint64_t{1} << 30;
  ForgetStatus();
  absl::Status st = co_await InPieces(
      length, kMaxTrim, "discard", Effect::kWrites,
      [&](nbd_handle* h, uint64_t done, uint64_t n, Command* command) {
        return Nbd().nbd_aio_trim(h, n, offset + done, Completion(command), 0);
      });
  ForgetStatus();
  co_return st;
}

io::Task<absl::Status> NbdNode::DoFlush() {
  if (!can_flush_) co_return absl::OkStatus();
  // A flush on every connection that has written since its last flush
  // (the first one when none has, as with one connection): the NBD
  // protocol promises multi-conn consistency only for writes completed
  // before a flush, and imgtool does not rely on the server spreading one
  // flush over all connections. The first error is the flush's.
  bool any_written = false;
  for (const std::unique_ptr<Connection>& c : connections_) {
    any_written = any_written || c->written;
  }
  absl::Status first;
  for (size_t i = 0; i < connections_.size(); ++i) {
    Connection& c = *connections_[i];
    if (!(c.written || (!any_written && i == 0))) continue;
    c.written = false;
    Command command;
    absl::Status st = co_await Run(
        "flush", command,
        [](nbd_handle* h, Command* cmd) {
          return Nbd().nbd_aio_flush(h, Completion(cmd), 0);
        },
        Effect::kNone, &c);
    if (first.ok()) first = st;
  }
  co_return first;
}

io::Task<absl::Status> NbdNode::DoTruncate(uint64_t size,
                                           io::PreallocMode /*prealloc*/) {
  if (size == size_) co_return absl::OkStatus();
  co_return absl::UnimplementedError("Cannot resize NBD nodes");
}

io::Task<absl::StatusOr<io::BlockStatus>> NbdNode::DoGetBlockStatus(
    uint64_t offset, uint64_t max_length) {
  io::BlockStatus status;
  status.length = std::min(max_length, size_ - offset);
  status.offset_valid = true;
  status.host_offset = offset;
  status.file = this;
  if (!base_allocation_) {
    status.data = true;
    co_return status;
  }
  // The extent holding `offset` as the status (flags as base:allocation's).
  auto answer = [&](uint64_t extent_end, uint32_t flags) {
    status.length = std::min(status.length, extent_end - offset);
    // qemu:allocation-depth through x-dirty-bitmap: depths above 2 as 2.
    if (allocation_depth_ && flags > 2) flags = 2;
    status.data = (flags & LIBNBD_STATE_HOLE) == 0;
    status.zero = (flags & LIBNBD_STATE_ZERO) != 0;
    return status;
  };
  if (!held_.empty() && offset >= status_start_ &&
      offset < held_.back().end) {
    auto it = std::upper_bound(
        held_.begin(), held_.end(), offset,
        [](uint64_t o, const HeldExtent& e) { return o < e.end; });
    co_return answer(it->end, it->flags);
  }
  // Everything to the end (see the header), within one request's length.
  constexpr uint64_t kMaxStatus = (uint64_t{INT_MAX} / 512) * 512;
  const uint64_t asked = std::min(size_ - offset, kMaxStatus);
  const uint64_t epoch = status_epoch_;
  Command command;
  ++block_status_requests_;
  absl::Status st = co_await Run(
      "block status", command, [&](nbd_handle* h, Command* c) {
        return Nbd().nbd_aio_block_status(
            h, asked, offset,
            nbd_extent_callback{
                .callback = OnExtent, .user_data = c, .free = nullptr},
            Completion(c), 0);
      });
  if (!st.ok()) {
    // QEMU's block status fails with the errno alone ("Could not read file
    // metadata: Input/output error", not the node's name and the step).
    if (const int e = StatusErrno(st); e != 0) {
      co_return WithMessage(st, std::strerror(e));
    }
    co_return st;
  }
  // The extents up to the first empty one, cut at the export's end.
  std::vector<HeldExtent> extents;
  uint64_t end = offset;
  for (size_t i = 0; i + 1 < command.extents.size() && end < size_; i += 2) {
    if (command.extents[i] == 0) break;
    end = std::min(end + command.extents[i], size_);
    extents.push_back(HeldExtent{end, command.extents[i + 1]});
  }
  if (extents.empty()) {
    status.length = std::min(status.length, asked);
    status.data = true;
    co_return status;
  }
  if (epoch == status_epoch_) {  // no write of this node's since it asked
    status_start_ = offset;
    held_ = extents;
  }
  co_return answer(extents.front().end, extents.front().flags);
}

io::Task<absl::Status> NbdNode::Close() {
  // NBD_CMD_DISC on each connection, then wait for the server to close it
  // (blocking, once).
  for (const std::unique_ptr<Connection>& c : connections_) {
    if (Nbd().nbd_aio_is_ready(c->handle) == 1 ||
        Nbd().nbd_aio_is_processing(c->handle) == 1) {
      Nbd().nbd_shutdown(c->handle, 0);
    }
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::nbd_block
