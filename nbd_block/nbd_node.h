// The `nbd` protocol driver (client side): a node whose bytes are an export
// of an NBD server, spoken to through libnbd (Debian libnbd-dev 1.14).
//
// Names (QEMU 7.2's block/nbd.c: nbd_parse_uri, nbd_parse_filename,
// nbd_process_options, nbd_refresh_filename; error texts checked against
// qemu-img 7.2 runs):
//   nbd+unix:///EXPORT?socket=PATH, nbd://HOST[:PORT]/EXPORT (nbd+tcp:// the
//   same; port 10809 when none is given), the legacy nbd:unix:PATH[:
//   exportname=E] and nbd:HOST:PORT[:exportname=E], and the options
//   server.type=unix|inet, server.path, server.host, server.port, export
//   (--image-opts, json:). A URI that QEMU's parser refuses is kInvalidArgument
//   "No valid URL specified"; a node without a server "NBD server address
//   missing"; "Parameter 'path' | 'host' | 'port' is missing", "Parameter
//   'type' does not accept value 'X'" as QEMU's QAPI visitor says.
//
// Design. Open is blocking: connect(2) on the calling thread (so that the
// error is "Failed to connect to '<path>' | '<host>:<port>': <strerror>", as
// QEMU's), then libnbd's handshake over that socket (nbd_connect_socket:
// fixed newstyle, structured replies, base:allocation requested). Every
// request after that uses libnbd's asynchronous API: a request calls
// nbd_aio_<cmd> (libnbd sends it at once if the socket takes it), and its
// coroutine suspends on an Event. The node keeps one io::OpKind::kPoll
// request on libnbd's socket in the engine while commands are in flight
// (POLLIN; and POLLOUT while libnbd has bytes it could not send); when it
// completes, the node calls nbd_aio_notify_read/write, which runs libnbd's
// completion callbacks; those only record the result, and the node wakes the
// coroutines afterwards (libnbd callbacks must not call back into the
// handle). So any number of requests are in flight on the one connection, no
// thread per request, and no blocking call on the engine thread after open
// except Close's nbd_shutdown (sends NBD_CMD_DISC and waits for the server
// to close, as QEMU's nbd_close does). With the thread-pool and native
// engines the poll(2) runs in a worker thread.
//
// Semantics (QEMU 7.2's nbd client): size = the export's size; read-only
// when the server says so (opening it for writing is kPermissionDenied
// "Could not open image: Permission denied"); flush is a no-op unless the
// server can flush; discard is a no-op unless it can trim; write zeroes use
// NBD_CMD_WRITE_ZEROES when the server has it (else kUnimplemented: the
// caller's fallback writes zero buffers), NO_HOLE unless the caller allows
// unmapping, FAST_ZERO when the caller wants no fallback (kUnimplemented
// when the server has no fast zero); block status from base:allocation
// (hole = not data, zero = reads as zeroes; offset valid, mapped to this
// node, as QEMU's), all data when the server has no base:allocation;
// truncate to another size is kUnimplemented "Cannot resize NBD nodes"
// (QEMU's text). Requests longer than the server's maximum block size
// (64 MiB at most, 32 MiB when it says none) are split.
//
// x-dirty-bitmap=CONTEXT (QEMU's "hack for reading bitmaps", iotest
// qemu-img-bitmaps): the one meta context asked for is CONTEXT instead of
// base:allocation (qemu-nbd -B NAME exports qemu:dirty-bitmap:NAME, -A
// qemu:allocation-depth), and block status reads its flags as if they were
// base:allocation's: a dirty (set) bit is NBD_STATE_HOLE, so `map` shows it
// as "data": false; depths above 2 count as 2 (QEMU's nbd_parse_blockstatus_
// payload). A server without the context is kInvalidArgument "Could not
// open image: Invalid argument" (qemu-img 7.2 prints that, not QEMU's
// "requested x-dirty-bitmap C not found"); a name over 4096 bytes (NBD's
// NBD_MAX_STRING_SIZE) "x-dirty-bitmap query too long to send to server".
// The option is not part of the node's name (not one of QEMU's strong
// runtime options for nbd).
//
// open-timeout=N (seconds, QEMU's number syntax): Open retries a connection
// that fails to connect (no server yet) until N seconds have passed, after
// 1 s, 2 s, 4 s ... (at most 16 s) as QEMU's connect thread, and then fails
// with the last attempt's error. reconnect-delay=N: when the connection is
// lost (the server closed it or died; libnbd's handle is dead), requests
// wait while the node connects again (the same backoff), are sent again on
// the new connection, and fail with EIO once N seconds have passed since
// the loss without a connection (each later request makes one attempt).
// Without it a lost connection fails requests with EIO, as QEMU's.
// Reconnecting is blocking on the engine thread like Open (connect(2) and
// the handshake); the waits between attempts are not (a timerfd polled
// through the engine). A new connection to an export of another size is
// refused (EIO).
//
// tls-creds=ID (QEMU's option; nbds:// URIs below are not QEMU 7.2's): the id of
// a --object tls-creds-x509 or tls-creds-psk with endpoint=client
// (block/objects.h; "No TLS credentials with id 'x'", "Object with id 'x' is
// not TLS credentials", "Expected TLS credentials for a client endpoint"
// while the options are read). The connection then requires TLS (libnbd's
// nbd_set_tls(LIBNBD_TLS_REQUIRE)): x509 with DIR's ca-cert.pem and the
// optional client-cert.pem / client-key.pem (nbd_set_tls_certificates:
// QEMU's file names) and verify-peer (nbd_set_tls_verify_peer); psk with
// DIR/keys.psk and username (default "qemu"). tls-hostname, or the inet
// host: QEMU checks the server certificate's name against it; libnbd 1.14
// cannot be given a host name for a connected socket, so imgtool verifies
// the certificate chain only, and requires a host name where QEMU does
// (x509 with verify-peer over a unix socket: "No hostname for certificate
// validation"). libnbd's TLS priority is its own (no `priority`). Errors
// qemu-img prints from the server's replies are given in its words where
// libnbd says what happened: a server without TLS ("Denied by server for
// option 5 (starttls)\nserver reported: TLS not configured", the second line
// qemu-nbd's text as libnbd does not pass the server's on), a client without
// tls-creds at a TLS server ("TLS negotiation required before option 7
// (go)\nDid you forget a valid tls-creds?\nserver reported: Option 0x7 not
// permitted before TLS"); handshake failures are libnbd's text.
//
// multi-conn=N (1 to 16; an imgtool extension: QEMU 7.2's nbd client opens
// one connection and has no such option): when the server sets
// NBD_FLAG_CAN_MULTI_CONN (the NBD protocol, "Transmission flags"; qemu-nbd
// 7.2 sets it when -e is not 1, nbd/server.c nbd_export_create), Open makes
// N - 1 more connections to the same export, each negotiated as the first
// (TLS, x-dirty-bitmap's context) and polled through the engine as the
// first, and every request goes to the connection with the fewest of the
// node's requests waiting (in turn among equals). An extra connection that
// fails, or whose server sends no greeting within 5 s (a server that has
// all the clients it takes, e.g. qemu-nbd -e 2 with another client, leaves
// it in its listen backlog), ends the opening: the node keeps the ones it
// has, never less than the first. Without the flag: one connection. Flush
// goes to every connection on which a write, write zeroes or discard
// completed since that connection's last flush (the first one if none):
// the protocol's multi-conn promise ("Transmission flags",
// NBD_FLAG_CAN_MULTI_CONN) is that a flush makes visible the writes
// completed before it on any connection, so one would do, but imgtool does
// not stake data on every server getting that right. Each connection
// reconnects on its own (reconnect-delay). The default when the node has no
// multi-conn option is the command's (block::OpenSettings::nbd_connections):
// 1 (QEMU's), 4 for convert (source and target) and bench, as nbdcopy's
// --connections default.
//
// nbds://[HOST[:PORT]]/EXPORT?tls-certificates=DIR and nbds+unix:///EXPORT?
// socket=PATH&tls-certificates=DIR (the NBD URI spec's TLS schemes,
// NetworkBlockDevice/nbd doc/uri.md; tls-certificates is libnbd's URI
// parameter, nbd_connect_uri; an imgtool extension: qemu-img 7.2 says
// "Unknown protocol 'nbds'"): the options x-tls=on and x-tls-certificates=
// DIR; the connection requires TLS, x509 from DIR with the peer's chain
// verified (no host name: as libnbd's URIs over a connected socket). A
// tls-creds option given with them is used instead. Without either,
// kInvalidArgument "nbds:// needs tls-certificates=DIR in the URI or the
// tls-creds option" (libnbd 1.14's default directories give no client
// certificate, which qemu-nbd's x509 server requires). The exact name keeps
// the scheme and the parameter.
//
// Block status (an imgtool choice: QEMU 7.2's client sends every
// NBD_CMD_BLOCK_STATUS with NBD_CMD_FLAG_REQ_ONE, block/nbd.c
// nbd_client_co_block_status). A query the node cannot answer from the
// extents it holds asks the server, without REQ_ONE, about everything from
// the offset to the export's end (at most 2 GiB - 512, the request length
// QEMU's client uses), as nbdcopy does; the server may answer with many
// extents (qemu-nbd 7.2: up to 131072 per reply, nbd/server.c
// NBD_MAX_BLOCK_STATUS_EXTENTS; the NBD protocol, "NBD_CMD_BLOCK_STATUS").
// The node keeps the extents of the last reply and answers the queries that
// fall inside them without a round trip. A copy walking an image of
// alternating 1 MiB data and 3 MiB holes out of qemu-nbd thus sends one
// BLOCK_STATUS per 2 GiB instead of two per 4 MiB, each waited for in turn
// (the copy's chunk walk is serial): that wait was why `convert` out of
// qemu-nbd was slower than nbdcopy (README, nbd client). The held extents
// are dropped when this node writes, writes zeroes or discards (at the
// start and at the end of each such request; a reply that arrives while one
// ran is used for its own query and not kept) and when a connection is
// made again. Writes to the export by other clients (another process, or
// another connection of a server's export) are not seen until the extents
// are dropped: as with nbdcopy, which asks once per 128 MiB and copies
// from those answers. block_status_requests() counts the requests sent.
//
// Reads (an imgtool choice: QEMU 7.2's client sends one NBD_CMD_READ per
// request, up to the server's maximum block size) longer than 256 KiB
// (kReadPiece: nbdcopy's default --request-size) go out as 256 KiB requests
// sent together, over the connections as any requests. qemu-nbd 7.2 (-r -e
// 4, qcow2, --cache=none --aio=native, on an XFS loop mount here) served
// 1 MiB reads at a third of the rate of 256 KiB ones: nbdcopy copying the
// nbd bench's image took 10.0-14.9 s with --request-size=1048576 against
// 2.4-4.6 s with its default 256 KiB, and imgtool convert's 1 MiB reads
// were what made it slower than nbdcopy out of qemu-nbd (README, nbd
// client). The read's status is the first failing piece's.
//
// Oldstyle servers (the NBD protocol, "Oldstyle negotiation"): libnbd
// speaks it, but refuses transmission flags 0 ("invalid eflags == 0 from
// server"), which QEMU 7.2's client takes as no flush, trim, zeroes or FUA
// on a writable export (nbd/client.c nbd_negotiate_finish_oldstyle; iotest
// 277's nbd-fault-injector.py sends them). Each connection peeks at the
// server's greeting before libnbd reads it; for that one greeting libnbd
// is given a socketpair with NBD_FLAG_HAS_FLAGS set and a relay thread
// copies the bytes to and from the server (nbd_block/oldstyle.h: one
// connection to the server, its close seen by libnbd, so reconnect-delay
// works through it). Every other server is read by libnbd directly.
//
// Not in this slice: FUA (BlockNode has no FUA flag yet).
//
// Units: bytes. Errors: kInvalidArgument for names and options; kUnavailable
// for connect and handshake failures (messages as above), kNotFound for an
// export the server does not have ("Requested export not available" and
// "server reported: export 'E' not present" on a second line: libnbd 1.14
// does not pass the server's text on, so that line is qemu-nbd's wording);
// I/O errors carry the errno the server or libnbd reported
// (base/errno_status.h's ErrnoStatus). Thread model: like every node, used
// from its engine's thread only.
#ifndef IMGTOOL_NBD_BLOCK_NBD_NODE_H_
#define IMGTOOL_NBD_BLOCK_NBD_NODE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "block/objects.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/sync.h"
#include "io/task.h"

struct nbd_handle;

namespace imgtool::nbd_block {

// The longest NBD_CMD_READ a read sends (longer reads are split: see the
// file comment); bytes.
inline constexpr uint64_t kReadPiece = uint64_t{256} << 10;

// The most connections multi-conn=N opens (nbdcopy's --connections has no
// limit; 16 keeps a node's sockets and polls few).
inline constexpr uint32_t kMaxConnections = 16;

// Where the server is and which export (QEMU's BlockdevOptionsNbd, the part
// of it this slice takes).
struct NbdAddress {
  bool is_unix = false;
  std::string path;  // unix
  std::string host;  // inet
  std::string port;  // inet, a decimal number as given
  std::optional<std::string> export_name;
  // Not the address: the x-dirty-bitmap, open-timeout and reconnect-delay
  // options (see the file comment); seconds.
  std::optional<std::string> x_dirty_bitmap;
  uint32_t open_timeout = 0;
  uint32_t reconnect_delay = 0;
  // multi-conn=N (imgtool's; 0 when not given): connections to open when
  // the server offers multi-conn, 1 to kMaxConnections.
  uint32_t multi_conn = 0;
  // tls-creds: the object's id and what it holds; tls-hostname (or the inet
  // host).
  std::optional<std::string> tls_creds;
  block::ObjectRegistry::TlsCreds tls;
  std::optional<std::string> tls_hostname;
  // TLS required (nbds://, x-tls=on) and the URI's tls-certificates (x509
  // directory, libnbd's URI parameter): see the file comment.
  bool tls_required = false;
  std::optional<std::string> tls_certificates;
};

// QEMU's nbd_parse_filename: fills the node's options from an NBD filename
// (URI or legacy syntax): values "server.type", "server.path",
// "server.host", "server.port" (dotted keys become the `server` child),
// "export". Errors: kInvalidArgument "No valid URL specified" for a bad
// URI, "File name string must start with 'nbd:'".
// `set` is called for each (key, value).
absl::Status ParseNbdFilename(
    absl::string_view filename,
    const std::function<void(const std::string&, const std::string&)>& set);

// The address from options (the `server` child's values, `export`,
// `x-dirty-bitmap`, `open-timeout`, `reconnect-delay`), as
// nbd_process_options checks them, and imgtool's `multi-conn`
// (kInvalidArgument "Parameter 'multi-conn' expects a number from 1 to 16"). `get(key)` returns the value of a
// (dotted) key or null.
absl::StatusOr<NbdAddress> AddressFromOptions(
    const std::function<const std::string*(const std::string&)>& get);

// QEMU's nbd_refresh_filename: "nbd+unix:///E?socket=P", "nbd+unix://?socket=P",
// "nbd://H:P/E", "nbd://H:P"; "" (no exact name: json:) for an IPv6 host.
std::string ExactFilename(const NbdAddress& address);

class NbdNode final : public io::BlockNode {
 public:
  // Connects and negotiates (blocking, see the file comment). `filename` is
  // the name used in error messages. kPermissionDenied when !read_only and
  // the export is read-only. kFailedPrecondition "Could not load
  // libnbd.so.0: ..." when libnbd is missing: the first Open loads it
  // (dlopen, nbd_block/libnbd.h), so processes that open no nbd node never
  // do. `engine` (not owned) must outlive the node.
  static absl::StatusOr<std::unique_ptr<NbdNode>> Open(
      std::string filename, const NbdAddress& address, io::Engine* engine,
      bool read_only);

  ~NbdNode() override;

  uint64_t size() const override { return size_; }
  io::Task<absl::Status> Close() override;

  // What the server offered (for tests).
  bool can_flush() const { return can_flush_; }
  bool can_trim() const { return can_trim_; }
  bool can_zero() const { return can_zero_; }
  bool can_fast_zero() const { return can_fast_zero_; }
  bool can_multi_conn() const { return can_multi_conn_; }
  // Whether the server agreed to the meta context block status reads
  // (base:allocation, or the x-dirty-bitmap one).
  bool has_base_allocation() const { return base_allocation_; }
  // Connections open to the export (1, or up to multi-conn when the server
  // offers multi-conn; see the file comment).
  size_t connections() const { return connections_.size(); }
  // libnbd commands issued so far, and the most in flight at once on one
  // connection.
  uint64_t commands_issued() const { return commands_issued_; }
  // Connections made again after a loss (reconnect-delay), all connections.
  uint64_t reconnects() const { return reconnects_; }
  uint64_t max_in_flight() const { return max_in_flight_; }
  // NBD_CMD_BLOCK_STATUS requests sent (the held extents answered the
  // other queries; see the file comment).
  uint64_t block_status_requests() const { return block_status_requests_; }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset,
                                 io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;

 public:
  // One libnbd command in flight (internal; public for the C callbacks).
  struct Command {
    NbdNode* node = nullptr;
    io::Event done;
    int error = 0;
    // Block status: the reply's (length, flags) pairs for the node's
    // context, as libnbd gives them.
    std::vector<uint32_t> extents;
  };
  void Completed(Command* command) { completed_.push_back(command); }
  // The meta context block status asks for.
  const std::string& context() const { return context_; }

 private:
  // One connection (libnbd handle) to the export and its engine polls.
  struct Connection {
    nbd_handle* handle = nullptr;
    // A dup of the connection's socket, polled by the engine: the node can
    // shut it down (waking the polls) and close it when the connection is
    // replaced, whatever libnbd has done with its own descriptor.
    int poll_fd = -1;
    io::Op read_poll;
    io::Op write_poll;
    bool read_armed = false;
    bool write_armed = false;
    // Set when neither poll is armed (Reconnect waits for it).
    io::Event* polls_idle = nullptr;
    // Connections replaced so far; when the current one was found lost.
    uint64_t generation = 0;
    std::optional<int64_t> lost_at_ms;
    io::Mutex reconnect_mu;
    // The node's commands waiting on this connection now.
    uint64_t waiting = 0;
    // A write, write zeroes or discard completed (or failed) here since the
    // last flush sent here.
    bool written = false;
  };
  // What a command does to the export (flush's bookkeeping).
  enum class Effect { kNone, kWrites };
  using Issue = std::function<int64_t(nbd_handle*, Command*)>;

  NbdNode(std::string filename, const NbdAddress& address,
          io::Engine* engine, bool read_only);

  // Takes `handle` (connected) as `c`'s connection: its socket for the
  // polls; the size and what the server offers become the node's.
  void Adopt(Connection& c, nbd_handle* handle);
  // Whether libnbd gave the connection up (dead or closed).
  static bool ConnectionLost(const Connection& c);
  // The connection for the next command: the one with the fewest commands
  // waiting, in turn among equals.
  Connection& Pick();
  // Issues a command with `issue` (returns libnbd's cookie) on `c` (Pick's
  // when null) into `command` (made afresh for each attempt) and waits for
  // it; after a lost connection, with reconnect-delay, connects again and
  // issues it again. The status is Wait's, EIO for a lost connection.
  io::Task<absl::Status> Run(const char* what, Command& command,
                             const Issue& issue,
                             Effect effect = Effect::kNone,
                             Connection* c = nullptr);
  // One NBD_CMD_READ of `buf.size()` bytes at `offset` (Run's status).
  io::Task<absl::Status> ReadPiece(uint64_t offset, io::IoVec buf);
  // Connects `c` again (one coroutine at a time; `generation` is the
  // connection the caller lost). True when connected.
  io::Task<bool> Reconnect(Connection& c, uint64_t generation);
  // Waits `ms` milliseconds without blocking the engine (timerfd + kPoll).
  io::Task<void> Sleep(uint64_t ms);

  // Arms the engine polls libnbd needs now on `c` (see the file comment).
  void Pump(Connection& c);
  // A poll request on `c` finished: tell libnbd, wake finished commands,
  // re-arm.
  void OnPollDone(Connection& c, bool write, int64_t result);
  // Wakes the commands whose completion callbacks ran.
  void WakeCompleted();
  // Waits for `command` (issued on `c`: `cookie` >= 0) and returns its
  // status.
  io::Task<absl::Status> Wait(Connection& c, Command& command, int64_t cookie,
                              const char* what);
  // Covers [offset, offset + length) in pieces of at most `max_piece`
  // bytes, one command at a time: `issue(handle, done, n, command)` starts
  // the command for the `n` bytes at offset + done on `handle`, completing
  // `command`, and returns libnbd's cookie. The first failing piece's
  // status (Wait's).
  io::Task<absl::Status> InPieces(
      uint64_t length, uint64_t max_piece, const char* what, Effect effect,
      std::function<int64_t(nbd_handle* handle, uint64_t done, uint64_t n,
                            Command* command)>
          issue);

  std::vector<std::unique_ptr<Connection>> connections_;
  size_t next_connection_ = 0;
  const NbdAddress address_;
  io::Engine* const engine_;
  uint64_t size_ = 0;
  uint64_t max_request_ = 32 << 20;
  bool can_flush_ = false;
  bool can_trim_ = false;
  bool can_zero_ = false;
  bool can_fast_zero_ = false;
  bool can_multi_conn_ = false;
  bool base_allocation_ = false;
  // The meta context block status asks for (base:allocation or the
  // x-dirty-bitmap one) and whether it is qemu:allocation-depth.
  std::string context_;
  bool allocation_depth_ = false;
  io::Op timer_poll_;
  io::Event* timer_fired_ = nullptr;
  // The extents of the last BLOCK_STATUS reply (see the file comment):
  // contiguous from status_start_, each (end offset, flags); empty when
  // dropped. status_epoch_ counts the drops.
  struct HeldExtent {
    uint64_t end = 0;
    uint32_t flags = 0;
  };
  // Drops the held extents.
  void ForgetStatus() {
    held_.clear();
    ++status_epoch_;
  }
  uint64_t status_start_ = 0;
  std::vector<HeldExtent> held_;
  uint64_t status_epoch_ = 0;
  uint64_t block_status_requests_ = 0;
  std::vector<Command*> completed_;
  uint64_t commands_issued_ = 0;
  uint64_t max_in_flight_ = 0;
  uint64_t reconnects_ = 0;
};

}  // namespace imgtool::nbd_block

#endif  // IMGTOOL_NBD_BLOCK_NBD_NODE_H_
