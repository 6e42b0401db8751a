// Oldstyle NBD servers whose greeting has transmission flags 0, for libnbd.
//
// The oldstyle greeting (the NBD protocol document, doc/proto.md,
// "Oldstyle negotiation") is 152 bytes: "NBDMAGIC", the magic
// 0x00420281861253, the export's size (64 bits), flags (32 bits: the
// transmission flags are the low 16) and 124 zero bytes, all big-endian.
// The protocol wants NBD_FLAG_HAS_FLAGS (bit 0) set; libnbd 1.14 refuses a
// server whose transmission flags are 0 ("handshake: invalid eflags == 0
// from server", lib/flags.c nbd_internal_set_size_and_flags), while QEMU
// 7.2's client takes them as they are (nbd/client.c
// nbd_negotiate_finish_oldstyle: no flush, trim, zeroes or FUA, writable).
// QEMU's iotest 277 runs such a server (tests/qemu-iotests/
// nbd-fault-injector.py --classic-negotiation).
//
// AdaptOldstyle lets libnbd stay the client of such a server over the one
// connection the node made (a second connection is not possible: the
// fault injector and qemu-nbd without -t serve one client): it gives
// libnbd one end of a socketpair whose first bytes are the server's
// greeting with NBD_FLAG_HAS_FLAGS set (the other bits as the server sent
// them, so libnbd sees what QEMU sees), and a relay thread copies bytes
// both ways between the pair's other end and the server's socket. This is
// for that legacy case only: every other server (newstyle, oldstyle with
// flags, anything else) gets no relay and libnbd reads its greeting from
// the socket itself, unread.
//
// The relay (one detached thread per such connection, poll(2) on two
// non-blocking sockets, 256 KiB buffered each way) passes a half-close on
// (a side's end of file becomes shutdown(SHUT_WR) of the other once the
// bytes before it are passed on) and ends, closing both sockets, when a
// side hangs up (the server closed: libnbd then reads the end of file and
// the node sees the connection lost, as with a direct connection; libnbd's
// end closed by nbd_close: the server sees the end of file), when both
// directions have ended, or at an error on either socket.
//
// Thread-safety: the functions keep no state; the relay thread owns the
// two sockets it was given and touches nothing else.
#ifndef IMGTOOL_NBD_BLOCK_OLDSTYLE_H_
#define IMGTOOL_NBD_BLOCK_OLDSTYLE_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace imgtool::nbd_block {

// Bytes of the oldstyle greeting; of its start that tells oldstyle from
// newstyle ("NBDMAGIC" and the next magic); the offset of its flags.
inline constexpr size_t kOldstyleGreetingSize = 152;
inline constexpr size_t kGreetingMagicsSize = 16;
inline constexpr size_t kOldstyleFlagsOffset = 24;

// Whether `start` (at least kGreetingMagicsSize bytes) begins an oldstyle
// greeting ("NBDMAGIC", then 0x00420281861253).
bool IsOldstyleStart(absl::Span<const uint8_t> start);

// Whether `greeting` (kOldstyleGreetingSize bytes of an oldstyle greeting)
// has transmission flags (the low 16 bits of its flags) 0: the greeting
// libnbd refuses and AdaptOldstyle relays.
bool HasNoTransmissionFlags(absl::Span<const uint8_t> greeting);

// Looks at the greeting the server sends on `fd` (a connected stream
// socket, blocking) without reading it (MSG_PEEK), waiting for it up to
// `wait_ms` milliseconds (no limit when negative). Returns the descriptor
// to hand to libnbd (nbd_connect_socket): `fd` itself, nothing read, for
// any greeting but an oldstyle one with transmission flags 0, and for a
// server that closes before 16 bytes (libnbd then reports it); for that
// one greeting, the greeting is read from `fd` and the result is one end
// of a socketpair relayed to `fd` (see the file comment), which then
// belongs to the relay thread. Errors (`fd` is closed): kUnavailable "no
// greeting from the server" when `wait_ms` passes first, or "Unable to
// read from socket: <strerror>" when reading fails; kInternal when the
// socketpair or the thread cannot be made.
absl::StatusOr<int> AdaptOldstyle(int fd, int wait_ms);

}  // namespace imgtool::nbd_block

#endif  // IMGTOOL_NBD_BLOCK_OLDSTYLE_H_
