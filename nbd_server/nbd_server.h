// NBD server: one export of a block graph over the NBD protocol
// (NetworkBlockDevice/nbd doc/proto.md), behaving as qemu-nbd 7.2's server
// (nbd/server.c) where the protocol leaves a choice.
//
// Protocol: fixed newstyle handshake, TLS when ExportOptions::tls is set
// (below). Options: EXPORT_NAME, INFO and
// GO (replies INFO_NAME and INFO_DESCRIPTION when asked, INFO_BLOCK_SIZE
// (minimum ExportOptions::min_block, preferred max(4096, minimum), maximum
// 32 MiB) and INFO_EXPORT), LIST, ABORT,
// STRUCTURED_REPLY, LIST_META_CONTEXT / SET_META_CONTEXT with the contexts
// `base:allocation` (id 0), `qemu:allocation-depth` (id 1, with
// ExportOptions::allocation_depth) and `qemu:dirty-bitmap:NAME` (id 2 + i
// for ExportOptions::bitmaps[i]); queries as qemu 7.2's
// nbd_negotiate_meta_queries: exact names, and on LIST the wildcards "base:",
// "qemu:" and "qemu:dirty-bitmap:" (no query: every context); LIST replies
// carry id 0, a SET first drops the previous selection; STARTTLS
// (NBD_REP_ERR_POLICY without TLS credentials, NBD_REP_ERR_INVALID once TLS
// is on), NBD_REP_ERR_UNSUP
// for every other option (its data is read and dropped). Commands: READ
// (structured: OFFSET_DATA chunks and OFFSET_HOLE for ranges that read as
// zeroes through the backing chain, one data chunk with DF), WRITE (FUA is a
// flush after the write), FLUSH, TRIM (a no-op unless discard_unmap, as
// qemu-nbd without --discard=unmap), WRITE_ZEROES (NO_HOLE, FAST_ZERO: a
// write-zeroes without fallback, NBD_ENOTSUP when it would need one), CACHE
// (accepted, nothing to do), BLOCK_STATUS for base:allocation (HOLE when no
// layer of the chain has data, ZERO when it reads as zeroes; REQ_ONE),
// qemu:allocation-depth (the depth as QEMU's bdrv_is_allocated_above: 0
// allocated nowhere, 1 in the export's node, N in the (N-1)th backing node;
// past the end of a shorter backing node the range counts as allocated in
// that node) and qemu:dirty-bitmap:NAME (NBD_STATE_DIRTY = 1 on the set
// ranges), one chunk per selected context in that order, the last with
// DONE; DISC. Simple replies unless the client negotiated structured replies;
// with them, READ and BLOCK_STATUS answer in chunks and errors in an ERROR
// chunk, while the success of any other command is a simple reply (qemu
// 7.2's nbd_send_generic_reply).
// Transmission flags as qemu-nbd 7.2: HAS_FLAGS, SEND_FLUSH, SEND_FUA,
// SEND_CACHE always; READ_ONLY, or SEND_TRIM | SEND_WRITE_ZEROES |
// SEND_FAST_ZERO when writable; SEND_DF with structured replies;
// CAN_MULTI_CONN when more than one client may connect (max_connections
// != 1).
//
// Hostile clients, as qemu-nbd 7.2 answers them: a short read, unknown
// client flags, a bad option magic close the connection; a bad request
// magic gets an NBD_EINVAL reply, then the connection is closed. A READ,
// WRITE or CACHE longer than 32 MiB gets NBD_EINVAL (a WRITE's payload
// cannot be skipped: the connection is closed after the reply); a request
// past the end of the export, an unknown command, unknown flags,
// BLOCK_STATUS without a context, and a write, trim or write-zeroes on a
// read-only export all get NBD_EINVAL (qemu 7.2 turns every request it
// refuses into EINVAL, not the EPERM the protocol suggests). Errors of the
// block graph map to NBD errors as qemu's system_errno_to_nbd_errno. Memory per connection is bounded: a 64 KiB receive buffer, at most kMaxRequests requests
// in flight, each with a buffer of at most 32 MiB, replies queued for
// sending (Run) of at most 1 MiB plus those of the requests in flight (no
// new request is read while more wait for a client that does not read); option data over 64 KiB
// is dropped in 4 KiB pieces, never buffered; a WRITE's buffer grows with
// the payload bytes received, so a client announcing 32 MiB and sending
// them slowly (or never) holds only what it sent (qemu's buffer is
// allocated untouched, to the same effect). A client that has not finished
// negotiating within ExportOptions::handshake_limit_seconds is shut down.
//
// TLS (doc/proto.md "TLS support", as qemu-nbd 7.2's nbd_negotiate_options
// with --tls-creds): before NBD_OPT_STARTTLS every option but STARTTLS gets
// NBD_REP_ERR_TLS_REQD with qemu's message "Option 0xN not permitted before
// TLS" (ABORT then closes), EXPORT_NAME closes the connection, STARTTLS
// with data gets NBD_REP_ERR_INVALID and closes. STARTTLS is acknowledged,
// then the TLS handshake runs in the connection's reader coroutine
// (nbd_server/tls.h): each GNUTLS_E_AGAIN waits for the socket through the
// epoll set below in the direction GnuTLS reports, like any other socket
// wait; a failed handshake or refused client certificate closes the
// connection. Afterwards every byte of the connection goes through the
// session's records (ReadFull / WriteFull pick the session by fd); a reply
// is corked into one write. Negotiation failures that qemu-nbd prints
// ("option negotiation failed: ...") go to ExportOptions::report, with or
// without TLS.
//
// Design: one process, one thread (the io engine's). Every socket is
// non-blocking; a coroutine that would block registers itself as the
// socket's reader or writer in one epoll set (one-shot), and Serve's loop
// keeps exactly one io::OpKind::kPoll request in flight on the epoll fd and
// resumes the waiters of the sockets it reports. So the engine thread never
// blocks on a socket, and with the thread-pool and native engines (whose
// kPoll is a poll(2) in a worker thread) idle connections hold no worker.
// The epoll set also holds the listening socket (while fewer than
// max_connections clients are connected), an eventfd (wakeups) and an
// optional signalfd (SIGTERM/SIGINT/SIGHUP: stop). Each connection
// runs a reader coroutine (handshake, then one request at a time) that
// spawns one coroutine per request; a request's I/O runs on the block graph
// concurrently with the others of all connections, and its reply is sent
// under the connection's send mutex. No thread per request or connection.
// Thread model: everything on the engine's thread; Serve() is awaited from
// a task driven by that engine.
#ifndef IMGTOOL_NBD_SERVER_NBD_SERVER_H_
#define IMGTOOL_NBD_SERVER_NBD_SERVER_H_

#include <coroutine>
#include <cstdint>
#include <functional>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/block_node.h"
#include "io/engine.h"
#include "io/sync.h"
#include "io/task.h"
#include "nbd_server/tls.h"

namespace imgtool::nbd_server {

// The largest READ / WRITE payload accepted (qemu's NBD_MAX_BUFFER_SIZE),
// bytes; also the INFO_BLOCK_SIZE maximum.
inline constexpr uint32_t kMaxPayload = 32 * 1024 * 1024;
// Requests of one connection in flight together (qemu's MAX_NBD_REQUESTS).
inline constexpr int kMaxRequests = 16;

struct ExportOptions {
  std::string name;         // -x; "" by default
  std::string description;  // -D; not sent when empty
  uint64_t size = 0;        // bytes the export shows (the image's size)
  bool read_only = false;   // -r
  // The export node's request alignment in bytes (QEMU's
  // blk_get_request_alignment; 512 for a probed raw image, else 1): the
  // INFO_BLOCK_SIZE minimum for NBD_OPT_INFO and for a GO that asked for
  // block sizes, 1 for a GO that did not (qemu 7.2's
  // nbd_negotiate_handle_info). Requests need not be aligned (qemu only
  // traces them).
  uint32_t min_block = 1;
  bool discard_unmap = false;  // --discard=unmap: TRIM and may-unmap zeroes
  // -e: clients connected at once (0: no limit); more wait in the backlog.
  int max_connections = 1;
  // -t: keep serving after the last client left; otherwise Serve returns
  // when a client that finished negotiation (entered transmission) leaves
  // and no other client is connected, as qemu-nbd 7.2's nbd_client_closed:
  // a client that leaves during the handshake (a port scan, `nbdinfo
  // --list`'s ABORT, the handshake limit below) does not stop the server.
  bool persistent = false;
  // Seconds a client may take from its connection to the end of
  // negotiation (TLS included) before the server shuts its socket down, as
  // Debian's qemu-nbd 7.2 (the CVE-2024-7409 backport in 7.2.14: nbd/server.c
  // nbd_co_client_start, NBD_DEFAULT_HANDSHAKE_MAX_SECS = 10). 0: no limit.
  // The stalled client still counts against max_connections until then.
  int handshake_limit_seconds = 10;
  // --detect-zeroes=on|unmap: a WRITE whose payload is all zeroes is done
  // as a write-zeroes (may unmap with detect_zeroes_unmap and
  // discard_unmap), as QEMU's bdrv_aligned_pwritev on the export's node.
  bool detect_zeroes = false;
  bool detect_zeroes_unmap = false;
  // --cache=writethrough|directsync: every WRITE and WRITE_ZEROES is
  // followed by a flush of the export before its reply, as QEMU's
  // BlockBackend with its write cache off (block/block-backend.c
  // blk_co_pwritev_part adds BDRV_REQ_FUA, which a qcow2 node emulates with
  // a flush): an acknowledged write is on disk, the image's metadata too.
  bool write_through = false;
  // -A: offer the qemu:allocation-depth context.
  bool allocation_depth = false;
  // -B NAME: a qemu:dirty-bitmap:NAME context each, ids 2, 3, ... in this
  // order. `dirty` returns the set ranges [begin, end) in bytes that meet
  // [offset, end) (not clipped, ascending, not overlapping), read when a
  // BLOCK_STATUS asks (so writes through the export show); called on the
  // engine's thread; errors are answered as the request's error.
  struct Bitmap {
    std::string name;
    std::function<absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>>(
        uint64_t offset, uint64_t end)>
        dirty;
  };
  std::vector<Bitmap> bitmaps;
  // --tls-creds: TLS required of every client (not owned; outlives the
  // server). nullptr: no TLS.
  const TlsServerCreds* tls = nullptr;
  // Receives the text of a negotiation failure qemu-nbd 7.2 reports on
  // stderr after "option negotiation failed: " (nbd_negotiate_options'
  // errors, nbd/server.c): TLS ("TLS handshake failed: ..."), "Failed to
  // read flags: E", "Unknown client flags 0xN received", "Failed to read
  // opts magic: E", "Bad magic received", "Failed to read option: E",
  // "Failed to read option length: E", "Failed to read export name: E",
  // "Bad length received", "export not found", and E alone for an option's
  // other data; E is "Unexpected end-of-file before all data were read" or
  // "Unable to read from socket: <strerror>" (QEMU's channel words). Write
  // failures are not reported. May be empty.
  std::function<void(const std::string&)> report;
  // Receives the text qemu-nbd 7.2 prints after "Disconnect client, due
  // to: " when it drops a client in the transmission phase (nbd/server.c
  // nbd_trip, nbd_read_eof, nbd_co_receive_request): "Unexpected
  // end-of-file before all bytes were read" (a request header cut short),
  // "Unable to read from socket: <strerror>", "Failed to read CMD_WRITE
  // data: E" (a WRITE's payload cut short; E as for `report`), "Request
  // handling failed in intermediate state" (a bad request magic, a WRITE
  // over 32 MiB: answered with EINVAL, then the stream cannot be
  // followed). Reply writes that fail are not reported. May be empty.
  std::function<void(const std::string&)> report_disconnect;
};

class Server {
 public:
  // `engine` and `node` outlive the server; `node` is the export (its
  // backing chain answers block status and reads as usual).
  Server(io::Engine& engine, io::BlockNode& node, ExportOptions options);
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;
  ~Server();

  // Serves clients on `listen_fd` (a listening socket; made non-blocking
  // here, not closed) until the last client left (not persistent) or a
  // signal arrived on `signal_fd` (a signalfd, or -1 for none; read here).
  // Connections still open at a stop are shut down and their requests
  // finished before it returns. Errors: kInternal for epoll/eventfd setup.
  io::Task<absl::Status> Serve(int listen_fd, int signal_fd);

  // Serves the one already-connected stream socket `fd` (a socketpair end
  // or an accepted socket; made non-blocking here; owned from the call on
  // and closed when its connection ends) as a client of the export, and
  // returns once that connection has ended (the client closed its end, sent
  // DISC, or was refused), its requests finished and replied. For the
  // fuzz target (nbd_server/server_fuzzer.cc) and tests: the same handshake
  // and request code as Serve, without a listening socket. Call at most
  // once per Server, instead of Serve. Errors: kInternal for epoll/eventfd
  // setup (fd is closed then too).
  io::Task<absl::Status> ServeConnected(int fd);
  // Drives the engine until `task` (Serve or ServeConnected of this server)
  // has finished and returns its result; use it instead of io::RunSync.
  // Before each wait for the engine it sends the replies that the batch of
  // completions just run has queued, with one send() per connection (a
  // reply is queued, not sent, so replies ready together go out together;
  // TLS connections send each reply as it is ready). kInternal if the
  // engine fails or the task waits with nothing in flight.
  absl::Status Run(io::Task<absl::Status> task);

 private:
  struct Connection;
  struct Request;

  // Creates the epoll set and the wake eventfd, adds them and `signal_fd`.
  absl::Status SetUp(int signal_fd);
  // The loop resuming socket waiters until the server stops (Serve's doc).
  // listen_fd < 0: no listening socket; stops when no client is left.
  io::Task<absl::Status> Loop(int listen_fd, int signal_fd);
  // Starts serving the connected socket `fd` (non-blocking) as a client.
  void AddConnection(int fd);
  // Ends `conn`'s handshake time limit (closes its timerfd), if any.
  void CancelHandshakeTimer(Connection& conn);
  // Reads a WRITE's `length` bytes of payload into `data` in pieces, the
  // buffer's touched memory growing with the bytes received, not with the
  // length announced. False when the stream ended first.
  io::Task<bool> ReadPayload(Connection& conn, std::vector<uint8_t>& data,
                             uint32_t length);
  // Copies the next `length` bytes of `conn`'s transmission stream to
  // `data`: first what an earlier recv() left in conn.rx; when that is used
  // up, one recv() of up to 64 KiB refills it, so the requests (headers and
  // small WRITE payloads) a client pipelines cost one recv() per 64 KiB,
  // not one per header and one per payload. Pieces of 64 KiB or more are
  // received straight into `data`. False when the stream ended first
  // (read_error_ says why; `*copied`, when given, how many bytes of
  // `data` it filled before).
  io::Task<bool> ReadBuffered(Connection& conn, void* data, size_t length,
                              size_t* copied = nullptr);
  // One recv() (or TLS record read) of at most `length` bytes into `data`,
  // waiting for the socket while none are ready: the bytes received, 0 at
  // the end of the stream or on an error.
  io::Task<size_t> RecvSome(int fd, void* data, size_t length);

  io::Task<void> WaitFd(int fd, int events);
  // False when the stream ended or failed first; read_error_ then says
  // why, in QEMU's words (read it before the next co_await).
  io::Task<bool> ReadFull(int fd, void* data, size_t length);
  // Reports "`what`: <read_error_>" (or the error alone when `what` is
  // empty) through ExportOptions::report.
  void ReportRead(const char* what);
  // Reports `why` through ExportOptions::report_disconnect.
  void ReportDisconnect(const std::string& why);
  std::string read_error_;
  io::Task<bool> WriteFull(int fd, const struct iovec* iov, int iovcnt);
  io::Task<bool> Drop(int fd, uint64_t length);
  io::Task<bool> StartTls(Connection& conn);

  io::Task<void> RunConnection(Connection* conn);
  // Appends a reply (the bytes of `iov`, copied) to conn.tx for
  // FlushReplies; false if an earlier send to the client failed.
  bool QueueReply(Connection& conn, const struct iovec* iov, int iovcnt);
  // Sends conn.tx without waiting: true when it is all sent (or the client
  // is gone: tx_failed, the socket shut down), false when the socket is
  // full (the rest stays in conn.tx).
  bool SendQueued(Connection& conn);
  // Sends the replies queued since the last call, one send() per
  // connection; a connection whose socket is full gets a FlushWhenWritable.
  void FlushReplies();
  io::Task<void> FlushWhenWritable(Connection* conn);
  // Resumes conn's reader if it waits and may go on (ReaderMayGo).
  void WakeReader(Connection& conn);
  io::Task<bool> Handshake(Connection& conn);
  io::Task<bool> SendOptionReply(Connection& conn, uint32_t option,
                                 uint32_t type, const std::string& data);
  io::Task<bool> SendExportInfo(Connection& conn, uint32_t option,
                                const std::vector<uint16_t>& requests);
  io::Task<void> HandleRequest(Connection* conn, Request* request);
  io::Task<bool> SendSimpleReply(Connection& conn, uint64_t handle,
                                 uint32_t error, const uint8_t* data,
                                 size_t length);
  io::Task<bool> SendChunk(Connection& conn, uint64_t handle, uint16_t flags,
                           uint16_t type, const std::string& head,
                           const uint8_t* data, size_t length);
  io::Task<bool> SendError(Connection& conn, uint64_t handle, uint32_t error,
                           const std::string& message);
  io::Task<bool> DoRead(Connection& conn, Request& request);
  io::Task<bool> DoBlockStatus(Connection& conn, Request& request);
  // One BLOCK_STATUS chunk for context `id` (kDone on the last).
  io::Task<bool> SendExtents(Connection& conn, Request& request, uint32_t id,
                             bool last);
  // The allocation depth of [offset, offset + at most max) and its length.
  io::Task<absl::StatusOr<std::pair<uint64_t, uint32_t>>> DepthAt(
      uint64_t offset, uint64_t max);
  // The state of [offset, offset + at most max) through the backing chain
  // as QEMU's bdrv_block_status_above: data in some layer, reads as zeroes.
  struct Extent {
    uint64_t length = 0;
    bool data = false;
    bool zero = false;
  };
  io::Task<absl::StatusOr<Extent>> ExtentAt(uint64_t offset, uint64_t max);
  uint16_t TransmissionFlags(const Connection& conn) const;
  void ConnectionEnded(Connection* conn);
  void Wake();

  // The coroutines waiting for a socket to become readable / writable.
  struct SocketWaiters {
    std::coroutine_handle<> in;
    std::coroutine_handle<> out;
    bool added = false;  // in the epoll set
  };
  // (Re-)arms `fd` in the epoll set, one-shot, for what `w` waits for.
  void Arm(int fd, SocketWaiters& w);

  io::Engine& engine_;
  io::BlockNode& node_;
  ExportOptions options_;
  int wake_fd_ = -1;
  int epoll_fd_ = -1;
  bool stopping_ = false;
  int clients_ = 0;
  std::list<std::unique_ptr<Connection>> connections_;
  // Connections with replies queued since the last FlushReplies.
  std::vector<Connection*> tx_pending_;
  std::unordered_map<int, SocketWaiters> waiters_;  // by fd
  // The TLS session of each connection that started TLS, by fd (owned by
  // the connection).
  std::unordered_map<int, TlsSession*> tls_;
  // The connection each handshake timerfd in the epoll set limits, by fd.
  std::unordered_map<int, Connection*> handshake_timers_;
};

}  // namespace imgtool::nbd_server

#endif  // IMGTOOL_NBD_SERVER_NBD_SERVER_H_
