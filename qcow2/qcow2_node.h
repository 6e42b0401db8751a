// The `qcow2` format driver (version 2 and 3 images with standard 64-bit L2
// entries; qcow2 spec and ../shared/reference/qcow2-format.md): a block node
// over an image file node, with an optional backing node.
//
// Reads resolve each guest cluster through the L1 and L2 tables: data
// clusters are read from the file, zero clusters read as zeroes, compressed
// clusters are inflated (zlib), unallocated clusters come from the backing
// node (zeroes past its end, or without one). Writes allocate host clusters
// with QEMU 7.2's allocator, copying the untouched part of a new cluster from
// its old contents (the backing file, a compressed or shared cluster) or
// zero-filling it with the file's write-zeroes, and write in place into
// clusters whose L2 entry has the COPIED flag.
//
// Metadata (L2 tables, refcount blocks) is cached and written back so that
// the image is consistent after a crash at any point (leaks are possible,
// corruption is not): data is written and synced before an L2 table that
// points to it, raised refcounts before the L2 table or L1 entry that uses
// the cluster, an L2 table before its L1 entry; a cluster whose reference
// was dropped is freed only after the L2 table no longer pointing to it is
// durable and no request that could still be using it is in flight.
//
// Concurrency: requests run concurrently on the engine's thread. One
// metadata mutex guards the tables; it is not held during data I/O, so
// requests to different clusters overlap. Requests that would allocate a
// cluster another request is allocating wait for it to finish; with
// standard L2 entries, a request writing other bytes of that cluster
// writes them as soon as the allocating request has zeroed the cluster and
// completes after it (CanWriteBeside).
//
// Corruption found while running (a table or data cluster at a misaligned
// offset or past the end of the file, an allocation or write landing on
// metadata) marks the image corrupt (the incompatible-features field only)
// when it is writable, fails the request with kDataLoss "qcow2: Marking
// image as corrupt: ..." and makes every later request fail the same way;
// metadata is never overwritten.
//
// Extended L2 entries (incompatible bit 4): each cluster has 32
// subclusters that are allocated, zero or unallocated on their own
// (subclusters.md): reads resolve each subcluster, writes reserve the host
// cluster once and copy only the untouched parts of the subclusters they
// touch, write zeroes and discard work per subcluster (discards of whole
// subclusters inside a cluster make them read as zeroes instead of being
// dropped), block status reports per subcluster. An invalid subcluster
// bitmap is a corruption event ("Invalid cluster entry found").
// Compressed clusters are never subdivided: a discard that does not cover a
// whole compressed cluster leaves it unchanged (as QEMU does), and a zero
// write that does not cover it is written as data.
// A discard on a version 2 image with a backing file does nothing and
// succeeds (no zero flag: the clusters would show the backing file again;
// QEMU 7.2's qcow2_co_pdiscard returns -ENOTSUP, ignored by its block layer).
//
// Allocating writes copy on write the way QEMU 7.2 does: the head and the
// tail of the new cluster (subcluster) are read with one request when at
// most 16 KiB lie between them and written with the data as one request;
// when they read as zeroes anyway, the range is zeroed with the file's
// write zeroes instead.
//
// Errors: kDataLoss for corrupt images, kUnimplemented for valid images
// using features not implemented (external data files, encryption),
// kDataLoss also for a compressed cluster (zlib or zstd) that does not
// decompress to a whole cluster (QEMU: EIO), kOutOfRange for requests
// past the end, I/O errors of the file. Open errors carry QEMU's text
// without the file name (callers prefix "Could not open '<file>': ").
// Thread model: like every node, used from its engine's thread only.
#ifndef IMGTOOL_QCOW2_QCOW2_NODE_H_
#define IMGTOOL_QCOW2_QCOW2_NODE_H_

#include <cstdint>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "io/aligned_buffer.h"
#include "io/block_node.h"
#include "io/sync.h"
#include "io/task.h"
#include "qcow2/format/bitmap.h"
#include "qcow2/format/header.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/format/snapshot.h"
#include "qcow2/metadata_io.h"
#include "qcow2/qcow2_options.pb.h"
#include "qcow2/refcounts.h"
#include "qcow2/table_cache.h"

namespace imgtool::qcow2 {

// Opens the backing file of an image: `filename` is the name stored in the
// image resolved against the image's directory (absolute names and names
// with a protocol prefix such as "json:" are passed unchanged), `format`
// the backing format stored in the image ("" = probe). The returned node
// should be read-only; the qcow2 node owns it. A coroutine because opening
// a qcow2 backing file does I/O on the same engine.
using BackingOpener =
    std::function<io::Task<absl::StatusOr<std::unique_ptr<io::BlockNode>>>(
        std::string filename, std::string format)>;

// Rebuilds the refcounts of the dirty image in `file` (lazy refcounts after
// a crash) and clears its dirty bit, like `qemu-img check -r all`. The
// default is qcow2/check.h's RebuildRefcounts.
using RefcountRepairer =
    std::function<io::Task<absl::Status>(io::BlockNode& file)>;

class Qcow2Node final : public io::BlockNode, private MetadataIo {
 public:
  // Opens the qcow2 image in `file` (read-only if `file` is). Validates the
  // header, the L1 table, refcount table and snapshot table positions
  // against the file size (qcow2-format.md §9 messages). Refuses unknown
  // incompatible features (naming them), and a read-write open of an image
  // with the corrupt bit ("qcow2: Image is corrupt; cannot be opened
  // read/write", kDataLoss). A read-write open of a dirty image (lazy
  // refcounts, not closed cleanly) repairs it first with `repair_refcounts`
  // (null: RebuildRefcounts), as QEMU does; kFailedPrecondition if the
  // image is still dirty afterwards.
  // Opens the backing file through `open_backing` unless it is null (then
  // unallocated clusters read as zeroes, as with QEMU's backing=null);
  // its errors come back as "Could not open backing file: <cause>".
  static io::Task<absl::StatusOr<std::unique_ptr<Qcow2Node>>> Open(
      std::unique_ptr<io::BlockNode> file, Qcow2OpenOptions options,
      BackingOpener open_backing, RefcountRepairer repair_refcounts = nullptr);

  ~Qcow2Node() override;

  // Virtual size in bytes (the header's size field).
  uint64_t size() const override;
  // The image file's allocated bytes.
  absl::StatusOr<uint64_t> AllocatedSize() const override;
  io::BlockNode* backing() const override { return backing_.get(); }
  // Flushes caches, frees what is left to free, clears the dirty bit this
  // node set, then closes the backing node and the file. If writing back
  // the caches fails, the error's message is QEMU's report of it, one line
  // per cache ("Failed to flush the L2 table cache: Input/output error",
  // see FlushCachesForClose), and the dirty bit stays.
  io::Task<absl::Status> Close() override;

  // Writes the guest clusters from `offset` (cluster aligned) compressed,
  // one at a time, as `qemu-img convert -c` and `qemu-io write
  // -c` do: `data` is whole clusters, or ends at the end of the image.
  // Compressed data is packed byte-wise after the previous compressed
  // cluster; a cluster that does not compress is written normally. An
  // empty `data` pads the image file to a multiple of 512 bytes, which
  // `qemu-img convert -c` asks for at its end (QEMU: a compressed write of
  // 0 bytes). Errors: kInvalidArgument for a misaligned or wrongly sized
  // request, kFailedPrecondition if a cluster is allocated already
  // (compression can't overwrite anything; the clusters before it are
  // written), and those of Write(). Clusters are compressed with the
  // image's compression_type (zlib or zstd, qcow2/compress.h), with QEMU
  // 7.2's parameters, so the same library version makes the same bytes.
  io::Task<absl::Status> WriteCompressed(uint64_t offset, io::ConstIoVec data);

  // The VM state area (QEMU 7.2's qcow2_save_vmstate / qcow2_load_vmstate,
  // what `qemu-io write -b` / `read -b` reach): guest bytes from
  // vm_state_offset() on, past the virtual disk, mapped by the same L1 and
  // L2 tables as the disk (the L1 table grows as QEMU's
  // qcow2_grow_l1_table(index + 1, false) makes it grow, before the L2
  // table of a new L1 entry is allocated). `pos` is in bytes from the start
  // of the area; any alignment (qemu-io asks for 512-byte sectors). Reads
  // of unwritten bytes give zeroes (or the backing file's bytes there, which
  // are zeroes past its end). Errors: those of Write()/Read(); EFBIG
  // ("Failed to grow the L1 table") past the largest L1 table;
  // kFailedPrecondition for writes to a read-only node.
  io::Task<absl::Status> WriteVmState(uint64_t pos, io::ConstIoVec data);
  io::Task<absl::Status> ReadVmState(uint64_t pos, io::IoVec buf);
  // Where the VM state area starts: the virtual size (whole 512-byte
  // sectors) rounded up to what one L1 entry maps (QEMU's
  // qcow2_vm_state_offset: l1_vm_state_index << (cluster_bits + l2_bits)).
  uint64_t vm_state_offset() const;

  // Drops every cluster of the image, as QEMU 7.2's qcow2_make_empty does
  // after qemu-img commit: a version 3 image without snapshots or bitmaps
  // (whose L1 table fits beside the header in one refcount block's reach)
  // is rewritten as a new one in QEMU's make_completely_empty steps, with
  // its debug events on the file: caches written back and emptied, dirty
  // bit set (synced), l1_update and the L1 table zeroed,
  // empty_image_prepare and clusters 1..2+L1 zeroed, l1_update and
  // reftable_update and the header pointed at a refcount table in cluster 1
  // and the L1 table at cluster 3 (synced), refblock_alloc and the refcount
  // block in cluster 2 entered in the table (synced), the first 3 + L1
  // clusters allocated, the image marked clean (header cluster rewritten),
  // the file cut after the L1 table. Other images get every cluster
  // discarded (L2 entries cleared, clusters freed).
  // No request may be in flight. Errors: kFailedPrecondition on a
  // read-only node, I/O errors of the file. A failure after the dirty bit
  // is set and before the allocation succeeded leaves the refcounts wrong
  // (the image on disk is what QEMU leaves; the next read-write open
  // repairs it): the node is then unusable, every later request fails with
  // ENOMEDIUM and Close writes nothing (QEMU ejects the driver).
  io::Task<absl::Status> MakeEmpty();

  // End in bytes of the last host cluster with a nonzero refcount
  // (Refcounts::UsedEnd; 0 if none): no cluster the image uses lies past
  // it. block/registry.cc gives it to the file node after a read-write
  // open (posix_file::FileNode::AdoptHoleTail), so that the hole a killed
  // writer left after the data is cut at close. kDataLoss if a refcount
  // table entry is unaligned or past the end of the file (the image is
  // not marked corrupt for it), and read errors of the file.
  io::Task<absl::StatusOr<uint64_t>> RefcountedEnd();

  // Where QEMU's messages of failures that do not stop an operation go
  // (qcow2_free_clusters' "qcow2_free_clusters failed: <cause>", printed
  // on stderr by every QEMU tool); std::cerr unless set. Not owned; must
  // outlive the node.
  void set_messages(std::ostream* out) { messages_ = out; }

  // Sets (`backing_file` given) or clears the backing file name and the
  // backing format extension (`backing_format`; nullopt drops it) in the
  // header, as QEMU 7.2's qcow2_change_backing_file does (qemu-img rebase,
  // both modes): cluster 0 is encoded again (format::EncodeHeader: header,
  // backing format, feature table, other extensions, end marker, then the
  // name right after it) and written in one write of the whole cluster,
  // after everything written before through this node is flushed (data,
  // L2 tables, refcounts), and synced. A crash leaves the old header or the
  // new one. The backing node opened with the image stays in use until
  // Close (reopen the image to read through the new backing file).
  // Errors, with nothing written:
  //  * kFailedPrecondition: the node is read-only.
  //  * kInvalidArgument (QEMU: EINVAL): a backing file on an image whose
  //    data file is raw (data_file_raw), a name longer than 1023 bytes.
  //  * kResourceExhausted (QEMU: ENOSPC, qemu-img "No space left in the
  //    file header"): the header, the extensions and the name do not fit in
  //    the first cluster; QEMU never moves data out of cluster 0 to make
  //    room, so neither does this (with 512-byte clusters a v3 header with a
  //    backing format leaves 376 bytes for the name).
  //  * the flush's and the write's errors (the header on disk is then the
  //    old one or, if the write reached the disk, the new one).
  io::Task<absl::Status> ChangeBackingFile(
      std::optional<std::string> backing_file,
      std::optional<std::string> backing_format);

  // Block status of this layer as QEMU's bdrv_is_allocated asks for it
  // (want_zero false): what GetBlockStatus answers, except that a data
  // range of an image with preallocated metadata is not cut where its
  // host clusters are holes in the file (QEMU's BDRV_BLOCK_RECURSE is
  // followed only when zeroes are wanted), so the length is the run of
  // clusters of one kind at contiguous host offsets. `offset` < size().
  // Errors: those of GetBlockStatus.
  io::Task<absl::StatusOr<io::BlockStatus>> GetAllocationStatus(
      uint64_t offset, uint64_t max_length);

  // What `qemu-img amend -o ...` changes in the image (QEMU 7.2's
  // qcow2_amend_options); unset fields stay as they are.
  struct AmendOptions {
    std::optional<uint32_t> version;        // 2 (compat=0.10) or 3 (1.1)
    std::optional<bool> lazy_refcounts;
    std::optional<uint32_t> refcount_bits;  // a power of two, 1..64
    uint64_t size = 0;                      // new virtual size; 0 = keep
    // backing_file / backing_fmt as given: they must be what the image
    // has already (QEMU 7.2 amends no backing file; rebase does).
    std::optional<std::string> backing_file;
    std::optional<std::string> backing_format;
    // Progress of the step that has one (the upgrade's 2 steps, the
    // downgrade's L1 entries): (done, total); may be null.
    std::function<void(int64_t done, int64_t total)> progress;
  };
  // Applies `options` in QEMU 7.2's order: upgrade to version 3 (the
  // snapshot table rewritten when an entry lacks version 3's extra data),
  // refcount width (new refcount blocks and table allocated and written,
  // one header write switches to them, the old ones freed: a crash leaves
  // leaked clusters at worst), header rewrite (always, as QEMU does),
  // backing file check, lazy refcounts, size (exact, as resize without
  // preallocation, shrinking allowed), downgrade to version 2 (zero
  // clusters of the active and every snapshot's L2 tables become
  // unallocated without a backing file, allocated zeroed data clusters
  // with one or when preallocated; the dirty bit cleared first; compatible
  // and autoclear bits dropped; the snapshot table kept as it is). The
  // progress reports the operations as one line, as QEMU's
  // qcow2_amend_helper_cb does. A step that fails leaves the earlier ones
  // done, as in QEMU.
  // Errors (kInvalidArgument unless noted, QEMU's words): "Cannot amend the
  // backing file\nYou can use 'imgtool rebase' instead."; "Lazy refcounts
  // only supported with compatibility level 1.1 and above (use compat=1.1
  // or greater)"; "Refcount widths other than 16 bits require
  // compatibility level 1.1 or above (use compat=1.1 or greater)";
  // "Cannot decrease refcount entry width to N bits: Cluster at offset 0x..
  // has a refcount of M" (nothing changed then);
  // kFailedPrecondition "compat=0.10 requires refcount_bits=16",
  // "Internal snapshots prevent downgrade of image" (a snapshot of another
  // size or with a VM state over 4 GiB), "Cannot downgrade an image with
  // incompatible features 0x10 set", "Cannot downgrade an image with zstd
  // compression type and existing compressed clusters" (QEMU's ENOTSUP);
  // the errors of Truncate and of the file.
  io::Task<absl::Status> Amend(AmendOptions options);


  // ---- Internal snapshots (qcow2 spec, "Snapshots"; qcow2_snapshot.cc,
  // QEMU 7.2's block/qcow2-snapshot.c). No request may be in flight.
  // A snapshot table entry (qcow2 spec, "Snapshots"), with QEMU 7.2's
  // defaults for what its extra data lacks (format/snapshot.h).
  using SnapshotRecord = format::SnapshotEntry;
  // The snapshot table, in table order, as read at open (QEMU 7.2's
  // qcow2_read_snapshots: past the end of the file it reads as zeroes; a
  // snapshot's L1 table is checked only when the snapshot is used), with
  // ids and names read as C strings (up to a NUL) and cut to 127 and 255
  // bytes as QEMU's bdrv_snapshot_list
  // (what info and snapshot -l print, and what snapshot -d looks up).
  io::Task<absl::StatusOr<std::vector<SnapshotRecord>>> Snapshots();
  // Messages QEMU prints during an operation beside its result, oldest
  // first: an error_report (`with_program`: "qemu-img: " goes before it),
  // or a bare fprintf to stderr such as "qcow2_free_clusters failed:
  // Input/output error" (a failed free that only leaks). Taking them
  // clears the list; the CLI prints them before the operation's error.
  struct Diagnostic {
    bool with_program = false;
    std::string text;
  };
  std::vector<Diagnostic> TakeDiagnostics() { return std::move(diagnostics_); }
  // Index in `snapshots` of the first entry whose id (`by_id`) or name is
  // `key`, or -1 (QEMU's find_snapshot_by_id_and_name with one of the two).
  static int FindSnapshot(const std::vector<SnapshotRecord>& snapshots,
                          const std::string& key, bool by_id);
  // qcow2_snapshot_create: copies the active L1 table to new clusters,
  // raises the refcount of every L2 table and cluster it reaches (COPIED
  // flags cleared in the active tables), then appends the entry (id: the
  // largest numeric id + 1; VM clock and VM state 0; version 3 extra data
  // with the virtual size and icount 0, as qemu-img writes it) through a
  // new snapshot table. Names may repeat (as in QEMU).
  // Crash safety: on a version 3 image the dirty bit is set (synced) for
  // the duration, so that a crash leaves an image whose COPIED flags the
  // next read-write open or `check -r` fixes; refcounts always reach the
  // disk before the table that relies on them, so a crash leaks at worst.
  // Errors carry QEMU's errno (base/errno_status.h): EFBIG for 65536
  // snapshots or a table over 64 MiB, EINVAL when a refcount would exceed
  // refcount_bits (the L1 copy is then leaked, as in QEMU), EIO for
  // corruption events; kFailedPrecondition on a read-only node.
  io::Task<absl::Status> CreateSnapshot(const std::string& name,
                                        uint32_t date_sec, uint32_t date_nsec);
  // qcow2_snapshot_goto of the snapshot whose id, else name, is
  // `id_or_name`: the image resized to the snapshot's disk size if it
  // differs, the L1 table grown to the snapshot's, the snapshot's clusters
  // referenced, its L1 table written as the active one (synced), the old
  // active state's references dropped (clusters only it used freed and
  // punched), COPIED flags recomputed. Errors: ENOENT (no such snapshot),
  // EINVAL/EFBIG for a snapshot L1 table that is misaligned/too large
  // (`*report` gets QEMU's error_report line, "Snapshot L1 table offset
  // invalid"), those of Truncate and of the file.
  io::Task<absl::Status> GotoSnapshot(const std::string& id_or_name,
                                      std::string* report);
  // qcow2_snapshot_delete of entry `index` of Snapshots(): the table is
  // rewritten without it first, then its references are dropped and its L1
  // table freed (a crash in between leaks), then COPIED flags recomputed.
  // Errors, QEMU's words: "Snapshot L1 table offset invalid" /
  // "... too large" (nothing changed), "Failed to remove snapshot from
  // snapshot list: <strerror>", "Failed to free the cluster and L1 table:
  // <strerror>", "Failed to update snapshot status in disk: <strerror>".
  io::Task<absl::Status> DeleteSnapshot(size_t index);
  // qcow2_snapshot_load_tmp: a read-only node reads the snapshot whose id
  // and name match (nullopt: any) from now on; the
  // virtual size stays the image's (as in QEMU). Errors (QEMU's words):
  // kFailedPrecondition "Device is not readonly", kNotFound "Can't find
  // snapshot", "Snapshot L1 table offset invalid" / "too large".
  io::Task<absl::Status> LoadSnapshotReadOnly(
      std::optional<std::string> id, std::optional<std::string> name);
  // Persistent dirty bitmaps (qcow2_bitmap.cc; qcow2 spec "Bitmaps",
  // QEMU 7.2's block/qcow2-bitmap.c and block/dirty-bitmap.c). Open loads
  // the bitmap directory and the data of every bitmap not in use (errors
  // fail the open with QEMU's words, e.g. "Bitmap 'b0' doesn't satisfy the
  // constraints"); a bitmap found in use (a writer was killed) is
  // inconsistent: kept on disk as it is, never tracked or stored again. A
  // read-write open marks every consistent bitmap in use (directory
  // rewritten in place, synced) before anything else is written, as QEMU's
  // does (so a killed writer leaves them in use even if it wrote nothing,
  // and Close always stores them again, moving them as QEMU does); every
  // write, write-zeroes and discard then sets the bits of the enabled
  // bitmaps (one bit per granularity bytes touched, whether or not the
  // request succeeds, as QEMU's bdrv_co_write_req_finish), and Close stores
  // them as QEMU's qcow2_store_persistent_dirty_bitmaps: new data clusters
  // (none for an all-zero cluster), new tables, a new directory, the header
  // (synced), then the old directory, tables and data freed; in_use clear.
  // Read-only opens change nothing.
  struct BitmapInfo {
    std::string name;
    uint32_t granularity = 0;  // bytes
    bool in_use = false;       // as on disk
    bool enabled = false;      // "auto" flag (for new bitmaps: as added)
    bool inconsistent = false; // in use at open
  };
  // The bitmaps in directory order (then those added since open), flags as
  // the directory on disk has them (qemu-img info's "bitmaps:").
  std::vector<BitmapInfo> Bitmaps() const;
  // `qemu-img bitmap` operations (QMP block-dirty-bitmap-*; errors are
  // QEMU's messages, kInvalidArgument / kNotFound / kFailedPrecondition):
  // Add: granularity 0 = QEMU's default (the cluster size within 4..64 KiB);
  // a new bitmap is stored at Close. Remove: rewrites the directory at once.
  // Clear / Enable / Disable / Merge change the in-memory bitmap, stored at
  // Close. Merge ORs `src` (of the same virtual size, any granularity) into
  // `target`. All need a writable node (kFailedPrecondition).
  // Marks the bitmaps in use if the open has not (it has on a writable
  // node). kFailedPrecondition on a read-only node; write errors.
  io::Task<absl::Status> PrepareBitmapChanges();
  io::Task<absl::Status> AddBitmap(const std::string& name,
                                   uint32_t granularity, bool disabled);
  io::Task<absl::Status> RemoveBitmap(const std::string& name);
  io::Task<absl::Status> ClearBitmap(const std::string& name);
  io::Task<absl::Status> EnableBitmap(const std::string& name, bool enable);
  io::Task<absl::Status> MergeBitmap(const std::string& target,
                                     const Qcow2Node& src_node,
                                     const std::string& src);
  // The set ranges [offset, end) in bytes of bitmap `name` as it is in
  // memory, among the bits that cover bytes [from, to) (the whole bitmap by
  // default): ranges are whole granules, so the first may begin before
  // `from` and the last end after `to` (never past size()). Scans only
  // those bits. kNotFound; kFailedPrecondition if inconsistent.
  absl::StatusOr<std::vector<std::pair<uint64_t, uint64_t>>> BitmapExtents(
      const std::string& name, uint64_t from = 0,
      uint64_t to = UINT64_MAX) const;

  // The header as it is now (dirty and corrupt bits included).
  const format::Header& header() const { return header_; }
  uint64_t cluster_size() const { return cluster_size_; }
  // The backing file name as stored in the image ("" if none), and resolved
  // against the image's directory (the file's io::BlockNode::Dirname);
  // full_backing_filename() is "" when a relative name cannot be resolved
  // because the file has no directory (a quorum node: qemu-img info's
  // "(cannot determine actual path)"), and opening the backing file then
  // fails with Dirname's error, as QEMU's bdrv_get_full_backing_filename.
  std::string backing_filename() const;
  const std::string& full_backing_filename() const { return full_backing_filename_; }
  // The backing format extension ("" if none).
  std::string backing_format() const;
  // "1.1" for version 3, "0.10" for version 2.
  const char* compat() const { return header_.version >= 3 ? "1.1" : "0.10"; }
  bool lazy_refcounts() const { return header_.lazy_refcounts(); }
  uint32_t refcount_bits() const { return header_.refcount_bits(); }
  bool corrupt() const { return header_.corrupt(); }
  bool extended_l2() const { return header_.extended_l2(); }
  bool dirty() const { return header_.dirty(); }
  io::BlockNode& file() const { return *file_; }
  // `file` (QEMU's primary child of a qcow2 node).
  io::BlockNode* primary_child() const override { return file_.get(); }
  // Debug events go to `file`, as QEMU's qcow2 raises them on bs->file.
  io::DebugEventAwaitable FileDebugEvent(io::BlkdebugEvent event) override {
    return file_->DebugEvent(event);
  }
  bool FileHandlesDebugEvents() const override {
    return file_->HandlesDebugEvents();
  }

 protected:
  io::Task<absl::Status> DoRead(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> DoWrite(uint64_t offset, io::ConstIoVec data) override;
  io::Task<absl::Status> DoWriteZeroes(uint64_t offset, uint64_t length,
                                       io::WriteZeroesFlags flags) override;
  io::Task<absl::Status> DoDiscard(uint64_t offset, uint64_t length) override;
  io::Task<absl::Status> DoFlush() override;
  io::Task<absl::Status> DoTruncate(uint64_t size,
                                    io::PreallocMode prealloc) override;
  io::Task<absl::StatusOr<io::BlockStatus>> DoGetBlockStatus(
      uint64_t offset, uint64_t max_length) override;
  // DoGetBlockStatus; `want_zero` false skips the look at the file of
  // GetAllocationStatus.
  io::Task<absl::StatusOr<io::BlockStatus>> LayerStatus(uint64_t offset,
                                                        uint64_t max_length,
                                                        bool want_zero);
  // DoRead and DoWrite past their range checks: guest offsets beyond
  // size() too (the VM state area); WriteGuest needs the L1 table to cover
  // the range.
  io::Task<absl::Status> ReadGuest(uint64_t offset, io::IoVec buf);
  io::Task<absl::Status> WriteGuest(uint64_t offset, io::ConstIoVec data);

 private:
  // The state of a run of guest clusters in this image (QEMU's cluster
  // types, standard L2 entries).
  struct Mapping {
    format::ClusterType type = format::ClusterType::kUnallocated;
    uint64_t host_offset = 0;  // kNormal/kZeroAlloc: host byte of `offset`
    uint64_t l2_word = 0;      // kCompressed: the L2 entry
    uint64_t length = 0;       // bytes from the queried offset
  };
  // How a write treats a cluster.
  enum class WriteKind {
    kInPlace,   // data cluster with COPIED: write where it is
    kReuse,     // preallocated zero cluster with COPIED: same host cluster,
                // L2 entry rewritten
    kAllocate,  // needs a new host cluster
  };
  // An allocating write in flight on guest clusters [first, first + count).
  struct Inflight {
    uint64_t first = 0;
    uint64_t count = 0;
    uint64_t host = 0;  // host offset of cluster `first`; 0 if not known
    // The guest bytes [data_begin, data_end) the allocating write puts in
    // these clusters.
    uint64_t data_begin = 0;
    uint64_t data_end = 0;
    // Set once the allocating write has written everything but its data
    // there (the zeroes of the rest of the clusters): other writes may then
    // write their data into the rest while it is in flight (see
    // CanWriteBeside). Never set when it copies old contents.
    bool ready = false;
    // Set after `ready` once the allocating write's data request is queued
    // (so that the writes that waited for it queue theirs after it), or when
    // it is done.
    io::Event settled;
    // Writes that wrote beside this one (their data may be in the clusters,
    // so the clusters are freed only after them should this write fail).
    uint32_t writers_beside = 0;
    bool linked = false;  // the L2 entries point at `host` now
    io::Event done;
  };
  // A fresh L2 table being allocated by AllocateL2Grouped.
  struct PendingL2 {
    uint64_t index = 0;  // L1 entry
    uint64_t table = 0;  // host offset of the table's cluster
    bool synced = false;     // its refcount and contents are on disk
    bool finished = false;   // linked, given back or failed: `status`
    absl::Status status;
    io::Event done;
  };
  struct SyncRound {
    absl::Status status;
    io::Event done;
  };
  struct PendingFree {
    uint64_t offset = 0;
    uint64_t length = 0;
    uint64_t seq = 0;       // data requests numbered below may use it
    bool discard = false;   // punch a hole in the file once freed
  };
  struct SnapshotL1 {
    uint64_t offset = 0;
    uint64_t bytes = 0;
  };
  struct Config {
    size_t l2_cache_tables = 0;
    size_t refcount_cache_tables = 0;
    bool lazy_refcounts = false;
    uint32_t overlap_check = kOverlapCached;  // Overlap bits checked
  };

  Qcow2Node(std::unique_ptr<io::BlockNode> file, format::Header header,
            Config config);

  // The cache sizes of `options` for an image with `header`, checked as
  // QEMU 7.2's read_cache_sizes (block/qcow2.c) with its messages
  // (kInvalidArgument): "cache-size, l2-cache-size and refcount-cache-size
  // may not be set at the same time", "... may not exceed cache-size", "L2
  // cache entry size must be a power of two between 512 and the cluster
  // size (N)", "L2 cache size too big", "Refcount cache size too big",
  // "Cache clean interval too big". Sets the table counts of `config`.
  static absl::Status CacheSizes(const format::Header& header,
                                 const Qcow2OpenOptions& options,
                                 Config* config);

  // The Overlap bits `options` select, as QEMU 7.2's
  // qcow2_update_options_prepare: the template (overlap-check, or
  // overlap-check.template; "cached" when neither is given) with each
  // overlap-check.<kind> boolean overriding its bit. kInvalidArgument with
  // QEMU's messages: "Conflicting values for qcow2 options 'overlap-check'
  // ('A') and 'overlap-check.template' ('B')", "Unsupported value 'X' for
  // qcow2 option 'overlap-check'. Allowed are any of the following: none,
  // constant, cached, all".
  static absl::StatusOr<uint32_t> OverlapChecks(
      const Qcow2OpenOptions& options);

  // MetadataIo.
  io::Task<absl::Status> WriteMetadata(uint64_t offset, io::ConstIoVec data,
                                       uint32_t ignore) override;
  io::Task<absl::Status> ReadMetadata(uint64_t offset, io::IoVec buf) override;
  io::Task<absl::Status> SyncFile() override;
  io::Task<absl::Status> SignalCorruption(std::string message) override;
  io::Task<absl::Status> SetRefcountTable(uint64_t offset,
                                          uint32_t clusters) override;
  void ClusterFreed(uint64_t offset) override;
  io::Task<absl::Status> BeforeAllocate() override {
    return ReclaimFreedClusters();
  }
  uint64_t FileSize() const override { return file_->size(); }

  // Bitmaps (qcow2_bitmap.cc).
  struct LiveBitmap {
    format::BitmapDirEntry entry;   // as on disk (table_size 0: not yet)
    std::vector<uint64_t> table;    // its bitmap table as read
    std::vector<uint64_t> bits;     // bit i covers [i << g, (i + 1) << g)
    bool inconsistent = false;      // in use at open: never stored
    bool enabled = false;
    bool on_disk = false;           // has a directory entry
  };
  io::Task<absl::Status> LoadBitmaps();
  // At a read-write open (and before any change): the consistent bitmaps
  // marked in use, once.
  io::Task<absl::Status> MarkBitmapsInUse();
  // Sets the bits of the enabled bitmaps for guest [offset, offset + length).
  void MarkDirty(uint64_t offset, uint64_t length);
  // Close's store (metadata lock held).
  io::Task<absl::Status> StoreBitmaps();
  // Writes a new directory for `entries` and points the header at it, then
  // frees the old one (QEMU's update_ext_header_and_dir).
  io::Task<absl::Status> ReplaceBitmapDirectory(
      const std::vector<format::BitmapDirEntry>& entries);
  // Frees the bitmap's data clusters (discarding them in the file) and
  // its table, as QEMU's free_bitmap_clusters; the table of an
  // inconsistent bitmap is read first (zeroes past the end of the file).
  io::Task<absl::Status> FreeBitmapClusters(const LiveBitmap& bm);
  // QEMU's qcow2_free_clusters for the bitmap code: a range with a cluster
  // whose refcount is already 0 (e.g. past the end of the file) is not
  // freed; "qcow2_free_clusters failed: Invalid argument" goes to
  // messages() and the caller goes on. Returns whether the range was
  // freed; other errors (I/O) as they are.
  io::Task<absl::StatusOr<bool>> FreeClustersOrReport(uint64_t offset,
                                                      uint64_t length);
  // Resize: kFailedPrecondition for an inconsistent bitmap; ResizeBitmaps
  // after a successful truncate.
  absl::Status CheckBitmapsResizable() const;
  void ResizeBitmaps(uint64_t new_size);
  LiveBitmap* FindBitmap(const std::string& name);
  const LiveBitmap* FindBitmap(const std::string& name) const;
  std::vector<LiveBitmap> bitmaps_;
  std::ostream* messages_ = &std::cerr;
  bool bitmaps_in_use_ = false;  // we marked them in use on disk
  bool bitmaps_changed_ = false; // something to store at Close

  // Open helpers.
  io::Task<absl::Status> LoadTables();
  io::Task<absl::Status> LoadSnapshotTable();

  // Header writes (all synced).
  io::Task<absl::Status> WriteHeader();
  io::Task<absl::Status> WriteHeaderField(uint64_t offset, io::ConstIoVec bytes);
  io::Task<absl::Status> WriteIncompatibleFeatures();
  io::Task<absl::Status> WriteL1Entry(uint64_t l1_index);
  // The 512-byte sector of the L1 table holding entry `l1_index`, from
  // l1_, not synced (metadata lock held); WriteL1Entry syncs after it.
  io::Task<absl::Status> WriteL1Sector(uint64_t l1_index);
  // Before the first change to the image: clear autoclear bits, set the
  // dirty bit with lazy refcounts.
  io::Task<absl::Status> PrepareFirstWrite();
  absl::Status CheckUsable() const { return broken_; }

  // QEMU 7.2's qcow2_check_metadata_overlap over the kinds the node's
  // overlap-check option selects, minus `ignore`: 0 or the first
  // overlapping kind, in QEMU's order. CheckOverlap answers from memory
  // and leaves out inactive L2 tables; InactiveL2Overlap reads each
  // snapshot's L1 table for them (an L1 table QEMU's qcow2_validate_table
  // rejects fails it: kInvalidArgument with EINVAL for a bad offset,
  // EFBIG for more than 32 MiB; read errors as they come).
  uint32_t CheckOverlap(uint64_t offset, uint64_t size, uint32_t ignore) const;
  io::Task<absl::StatusOr<bool>> InactiveL2Overlap(uint64_t offset,
                                                   uint64_t size);
  // qcow2_pre_write_overlap_check: an overlap marks the image corrupt
  // ("Preventing invalid write on metadata (overlaps with <kind>)") and
  // fails with SignalCorruption's error; a failed check fails with its
  // error and changes nothing.
  io::Task<absl::Status> CheckOverlapOrFail(uint64_t offset, uint64_t size,
                                            uint32_t ignore);

  // L1/L2 access (metadata lock held).
  uint64_t l1_index(uint64_t guest_offset) const {
    return (guest_offset >> cluster_bits_) / l2_entries_;
  }
  uint64_t l2_index(uint64_t guest_offset) const {
    return (guest_offset >> cluster_bits_) % l2_entries_;
  }
  // An empty L2 table cache: a miss raises l2_load on the file and reads
  // the table, write-back goes through WriteL2Table.
  std::unique_ptr<TableCache> NewL2Cache();
  // The L2 table of L1 entry `index` (which must be allocated), checked.
  io::Task<absl::StatusOr<TableCache::Ref>> LoadL2(uint64_t index);
  // The L2 table for L1 entry `index`, allocated (or copied from a shared
  // one) so that it can be changed.
  io::Task<absl::StatusOr<TableCache::Ref>> GetL2ForWrite(uint64_t index);
  // Gives back the cluster of a new L2 table that no L1 entry on disk
  // points to (metadata lock held): freed, and discarded in the file once
  // its refcount is 0, as QEMU's l2_allocate fail path. Errors are dropped
  // (QEMU only reports them; the request's own error counts).
  io::Task<void> GiveBackL2Table(uint64_t table);

  // Fresh L2 tables in groups (an imgtool addition; QEMU allocates each one
  // with three flushes of its own under its metadata lock, l2_allocate).
  // When writes are in flight beside this one and L1 entry `index` has no
  // table yet, a write allocates the table here instead of in
  // GetL2ForWrite: with the metadata lock held it allocates the cluster;
  // without the lock it writes the empty table and waits for
  // SyncNewTables (the dirty refcount blocks written, then a flush, both
  // shared by every table written meanwhile); then, with the lock again,
  // the first write back links every table whose flush is done, in one
  // write of each L1 sector they are in and one flush. So a table is on
  // disk, with its refcount, before an L1 entry on disk points to it, as in
  // GetL2ForWrite, but k tables cost 2 flushes instead of 3k, and the lock
  // is held for no I/O but the L1 writes. Another write for the same L1
  // entry meanwhile waits for it; a table whose L1 entry got one meanwhile
  // by another path (GetL2ForWrite) is given back.
  // `lock` (the metadata lock) is released on return; the caller then looks
  // at the L1 entry again. Errors: those of the allocation, the writes and
  // the flushes (the table given back, the L1 entry as before).
  bool ShouldAllocateL2Grouped(uint64_t index) const;
  io::Task<absl::Status> AllocateL2Grouped(uint64_t index, io::ScopedLock lock);
  // Gives back pending table `p` after error `st` (metadata lock held),
  // wakes the writes waiting for it; returns `st`.
  io::Task<absl::Status> DropPendingL2(std::shared_ptr<PendingL2> p,
                                       absl::Status st);
  // Links every synced pending table (metadata lock held); the status of
  // `mine` (which must be synced) after that.
  io::Task<absl::Status> LinkSyncedL2Tables(
      const std::shared_ptr<PendingL2>& mine);
  // Returns once the refcount blocks were written and then the file
  // flushed, both after the call (group commit: callers that arrive while
  // a round runs share the next one). Takes the metadata lock for the
  // refcount writes only (call it without). Its error is every sharer's.
  io::Task<absl::Status> SyncNewTables();
  format::L2Entry GetEntry(const TableCache::Ref& l2, uint64_t index) const;
  void SetEntry(TableCache::Ref& l2, uint64_t index, const format::L2Entry& e);
  // Whether the image has a backing file: one is open, or the header names
  // one.
  bool has_backing_file() const {
    return backing_ != nullptr || header_.backing_file.has_value();
  }
  // Classifies an entry the way QEMU does at run time; a corruption event
  // for misaligned offsets, past-EOF clusters, zero flags in v2 images and
  // invalid subcluster bitmaps. `for_write`: the entry is met by a data
  // write (QEMU's calculate_l2_meta), whose invalid-bitmap message has one
  // space before "(L2 offset" where the read path's (qcow2_get_host_offset)
  // has two.
  io::Task<absl::StatusOr<format::ClusterType>> Classify(
      const format::L2Entry& entry, uint64_t l2_offset, uint64_t index,
      bool for_write = false);
  // The corruption event for the invalid subcluster bitmap of entry `index`
  // of the L2 table at `l2_offset`, in the words of QEMU's read path or
  // (`for_write`) write path; see Classify.
  io::Task<absl::Status> SignalInvalidBitmap(uint64_t l2_offset,
                                             uint64_t index, bool for_write);
  // The mapping of [offset, offset + max_length) up to the end of its L2
  // table (metadata lock held).
  io::Task<absl::StatusOr<Mapping>> GetMapping(uint64_t offset,
                                               uint64_t max_length);
  // Write class of one entry of a given type.
  static WriteKind KindOf(format::ClusterType type, const format::L2Entry& e);

  // In-flight allocations.
  std::shared_ptr<Inflight> FindInflight(uint64_t first, uint64_t count) const;
  // Registers an allocating write on guest clusters [first, first + count)
  // whose first cluster goes to `host` (0 if not known); metadata lock held.
  std::shared_ptr<Inflight> AddInflight(uint64_t first, uint64_t count,
                                        uint64_t host);
  uint64_t BeginDataOp();
  void EndDataOp(uint64_t seq);
  // Queues the host clusters of an L2 entry that no longer references them.
  void FreeEntryLater(const format::L2Entry& entry, bool discard);
  // The host bytes an L2 entry references (offset, length; length 0 for
  // none): a whole cluster, or a compressed cluster's byte range.
  std::pair<uint64_t, uint64_t> HostBytesOf(const format::L2Entry& entry) const;
  // Before a discard, zero write, write or resize drops an L2 entry and
  // frees its host bytes: the overlap check, as for a write there but for
  // inactive L2 tables (QEMU 7.2 frees them unchecked). kDataLoss and the
  // image marked corrupt if they hold metadata of a kind checked.
  io::Task<absl::Status> CheckFreeOrFail(const format::L2Entry& entry);
  // The lowest sequence number of a data request in flight (next_seq_ if
  // none): pending frees queued at or below it are no longer read.
  uint64_t OldestDataOp() const;
  // Frees the pending clusters no data request in flight uses any more.
  io::Task<absl::Status> ApplyPendingFrees();
  // BeforeAllocate, i.e. before every cluster allocation, data or metadata
  // (metadata lock held): if pending frees can be applied, writes the
  // dirty L2 tables, syncs and applies them, so that the allocation finds
  // those clusters free again, as QEMU's allocator does (a free lowers
  // free_cluster_index; the refcount blocks wait for the L2 tables).
  // `write 0 1M; discard 0 1M; write 0 64k` thus puts the last write in the
  // first freed cluster, not at the file end, and a resize that follows a
  // discard puts its new L1 table there.
  io::Task<absl::Status> ReclaimFreedClusters();

  // Data paths (no lock held).
  io::Task<absl::Status> ReadBacking(uint64_t offset, io::IoVec buf);
  // Writes guest data (or data merged with its copy-on-write) to the file
  // at `host`, raising write_aio on the file first (qcow2_co_pwritev_task).
  io::Task<absl::Status> WriteData(uint64_t host, io::ConstIoVec data);
  // Writes guest data merged with its copy-on-write head and tail as one
  // request, raising write_aio then cow_write first (QEMU's perform_cow
  // with data_qiov).
  io::Task<absl::Status> WriteMergedCow(uint64_t host, io::ConstIoVec data);
  // Reads a copy-on-write region (nothing if `buf` is empty) with
  // ReadOldContents, raising cow_read first (do_perform_cow_read).
  io::Task<absl::Status> CowRead(const format::L2Entry& old, uint64_t offset,
                                 io::IoVec buf);
  io::Task<absl::Status> ReadCompressed(uint64_t l2_word,
                                        uint64_t offset_in_cluster,
                                        io::IoVec buf);
  // Reads what guest range [offset, offset + buf.size()) showed through
  // `old` before an allocating write replaced it (same cluster).
  io::Task<absl::Status> ReadOldContents(const format::L2Entry& old,
                                         uint64_t offset, io::IoVec buf);
  bool OldContentsAreZero(const format::L2Entry& old, uint64_t offset,
                          uint64_t length) const;
  io::Task<bool> BackingReadsZero(uint64_t offset, uint64_t length);
  // QEMU 7.2's is_zero_cow: whether a copy-on-write region of an allocating
  // write, guest range [offset, offset + length) inside one cluster whose
  // entry is `old`, reads as zeroes by block status alone
  // (bdrv_co_is_zero_fast, want_zero false): inside the image, and one run
  // of zero clusters (subclusters), or of unallocated ones with no backing
  // file, or unallocated in the whole backing chain or zero clusters of a
  // qcow2 backing layer (walked layer by layer), or past the backing
  // file's end. Only when both regions do does an allocating write zero its
  // new clusters with the file's efficient write zeroes (an unwritten
  // extent) and write the data alone (handle_alloc_space); otherwise the
  // zeroes it copies are written as data, as in qemu-img's files (the tail
  // of a partial last cluster of the image). true for length 0.
  io::Task<bool> CowRegionReadsZero(const format::L2Entry& old,
                                    uint64_t offset, uint64_t length);

  // Copy-on-write buffers, kept for reuse (up to kMaxPooledCowBytes in
  // all) so that allocating writes neither fault in nor zero fresh pages
  // each time. The lease gives its buffer back when destroyed.
  class CowBuffer {
   public:
    CowBuffer(Qcow2Node* node, uint64_t size);
    ~CowBuffer();
    CowBuffer(const CowBuffer&) = delete;
    CowBuffer& operator=(const CowBuffer&) = delete;
    uint8_t* data() { return buf_.data(); }

   private:
    Qcow2Node* node_;
    io::AlignedBuffer buf_;
  };
  static constexpr uint64_t kMaxPooledCowBytes = uint64_t{64} << 20;

  // WriteCompressed of one cluster (`data`: the cluster, or the image's
  // last, partial one).
  io::Task<absl::Status> WriteCompressedCluster(uint64_t offset,
                                                io::ConstIoVec data);
  // Write pieces.
  // QEMU's handle_alloc_space: zeroes file range [zero_at, zero_at +
  // zero_bytes) (bytes, the new clusters or subclusters a write allocates)
  // with the file's efficient write zeroes, then writes `data` at file
  // offset `data_at` inside it. false, with nothing written, when the file
  // has no efficient write zeroes (kUnimplemented): the caller then writes
  // the zeroes its own way (copy-on-write buffer, explicit zero writes).
  // Errors of either request otherwise.
  // With `inflight` (the allocation it is for), sets its `ready` and
  // `settled` once the zeroes are written.
  io::Task<absl::StatusOr<bool>> ZeroThenWrite(uint64_t zero_at,
                                               uint64_t zero_bytes,
                                               uint64_t data_at,
                                               io::ConstIoVec data,
                                               Inflight* inflight = nullptr);
  // Whether a write of guest bytes [offset, end) may write its share of the
  // clusters `other` is allocating while that write is in flight, instead
  // of waiting for it to finish: `other` has written all but its data and
  // the two data ranges do not meet. The later write still completes only
  // after `other` linked the clusters (WaitBeside). Sequential writes
  // smaller than a cluster (or not aligned to clusters) so reach the file
  // together, as one stream of adjacent requests, instead of one per
  // cluster at a time; QEMU 7.2 waits for the allocation
  // (handle_dependencies).
  static bool CanWriteBeside(const Inflight& other, uint64_t offset,
                             uint64_t end);
  // Whether guest bytes [offset, end) and the data of `other` do not meet.
  static bool DataApart(const Inflight& other, uint64_t offset, uint64_t end);
  // Waits until a write of [offset, end) that found `other` in its way may
  // look again: until `other` is settled if their data are apart (it may
  // then write beside it), else until `other` is done.
  static io::Task<void> WaitForInflight(std::shared_ptr<Inflight> other,
                                        uint64_t offset, uint64_t end);
  // After a write's data request beside the allocations `beside`: waits
  // until they are finished. false if one of them failed (the clusters were
  // not linked; the write must be done again).
  static io::Task<bool> WaitBeside(
      const std::vector<std::shared_ptr<Inflight>>& beside);
  // One write step within one L2 table (standard L2 entries): the run of
  // clusters from `offset` on that are written the same way (in place,
  // reusing reserved clusters, or allocating). Returns the bytes of `data`
  // written, 0 when the step is to be done again. `*host_hint` (in/out, 0
  // for none): the host offset right after the previous step of the same
  // request; clusters to allocate go there, as many as are free there
  // (QEMU's handle_alloc at the expected host offset), before a search
  // anywhere else. Set to the end of this step's host range when the step
  // ends at a cluster end, else to 0.
  io::Task<absl::StatusOr<uint64_t>> WriteStep(uint64_t offset,
                                               io::ConstIoVec data,
                                               uint64_t* host_hint);
  // Writes an allocating write's data into its new clusters (`inflight`,
  // at `host`) with what the rest of them must show: zeroes or the old
  // contents. Sets inflight->ready when only the data is left to write.
  io::Task<absl::Status> WriteAllocated(uint64_t offset, io::ConstIoVec data,
                                        uint64_t first_cluster, uint64_t count,
                                        uint64_t host,
                                        const std::vector<format::L2Entry>& olds,
                                        Inflight& inflight);
  // A write over `n` clusters written in place (or beside the allocations
  // `beside` in flight) from guest cluster `cluster`
  // (host offset `host` for `offset`) and the `news.size()` clusters after
  // them, just allocated at `new_host` right after the in-place ones (their
  // old L2 entries `news`, reading as zeroes): one data request over both,
  // then the new clusters linked. Takes the metadata lock held and the L2
  // table reference; returns the bytes of `data` written, or 0 when an
  // allocation in `beside` failed (the step is to be done again).
  io::Task<absl::StatusOr<uint64_t>> WriteInPlaceThenNew(
      io::ScopedLock lock, TableCache::Ref l2, uint64_t offset,
      io::ConstIoVec data, uint64_t cluster, uint64_t n, uint64_t host,
      uint64_t new_host, std::vector<format::L2Entry> news,
      std::vector<std::shared_ptr<Inflight>> beside);
  // After an allocating write's data request ended with `st`: links the
  // clusters of `inflight` (at `host`, old entries `olds`; the old ones
  // freed when `allocated`, else reused) under the metadata lock, gives
  // newly `allocated` clusters back on failure, ends `inflight` and wakes
  // its waiters. Returns `st` or the linking error.
  io::Task<absl::Status> FinishAllocatingWrite(
      absl::Status st, std::shared_ptr<Inflight> inflight, uint64_t host,
      const std::vector<format::L2Entry>& olds, bool allocated);
  io::Task<absl::Status> LinkL2(uint64_t first_cluster, uint64_t count,
                                uint64_t host,
                                const std::vector<format::L2Entry>& olds,
                                bool free_old);
  // Zero / discard of whole clusters [first, first + count) within one L2
  // table (metadata lock held; no allocation in flight there).
  io::Task<absl::Status> ZeroClusters(uint64_t first, uint64_t count,
                                      bool may_unmap);
  io::Task<absl::Status> DiscardClusters(uint64_t first, uint64_t count,
                                         bool full_discard);
  // Runs `fn(first, count)` under the metadata lock for each L2 table's
  // share of [first, first + count), waiting out allocations in flight.
  io::Task<absl::Status> ForEachL2Range(
      uint64_t first, uint64_t count,
      std::function<io::Task<absl::Status>(uint64_t, uint64_t)> fn);
  // Write zeroes of a part of one cluster (standard L2 entries): a zero
  // cluster when the rest of it reads zeroes and it holds no data (QEMU
  // 7.2's head/tail rule; with `may_unmap` an allocated zero cluster is
  // freed), zeroes written as data otherwise.
  io::Task<absl::Status> WriteZeroesPartial(uint64_t offset, uint64_t length,
                                            bool may_unmap);
  // Splits guest range [offset, offset + length) (inside the image) at
  // cluster boundaries: each run of whole clusters (the last may end at the
  // image end) goes to `whole(first_cluster, count)` through ForEachL2Range,
  // each piece of one cluster to `partial(offset, end)`, in ascending order.
  // Stops at the first error.
  io::Task<absl::Status> ForEachClusterPiece(
      uint64_t offset, uint64_t length,
      std::function<io::Task<absl::Status>(uint64_t, uint64_t)> whole,
      std::function<io::Task<absl::Status>(uint64_t, uint64_t)> partial);

  // Extended L2 entries (subclusters; subclusters.md).
  uint32_t subcluster_bits() const { return cluster_bits_ - 5; }
  // One write step within one guest cluster: writes in place into allocated
  // subclusters, otherwise allocates the host cluster once (or reuses the
  // reserved one) and writes the data padded to subcluster boundaries with
  // the old contents of the touched subclusters, then sets their alloc bits.
  // A new allocation spans the following clusters the write reaches that
  // need one too. `*host_hint` (in/out, 0 for none): the host offset right
  // after the previous step of the same request, where a new allocation
  // goes if it is free (as in QEMU); set to the end of this step's host
  // range when the step ends at a cluster end.
  io::Task<absl::StatusOr<uint64_t>> WriteStepExtended(uint64_t offset,
                                                       io::ConstIoVec data,
                                                       uint64_t* host_hint);
  // Write zeroes (`discard` false) or discard of the whole subclusters
  // [offset, end) of one guest cluster (subcluster aligned; `end` may be the
  // image end; partial subclusters count whole). Sets `*fallback` when
  // zeroes have to be written as data (compressed cluster). Takes the
  // metadata lock.
  // `if_no_data`: also sets `*fallback` (changing nothing) when one of the
  // subclusters holds data.
  io::Task<absl::Status> ChangeSubclusters(uint64_t offset, uint64_t end,
                                           bool discard, bool* fallback,
                                           bool if_no_data = false);
  // Write zeroes with extended L2 entries, split as QEMU 7.2 splits them
  // (bdrv_co_do_pwrite_zeroes over qcow2_co_pwrite_zeroes): the part before
  // the first subcluster boundary, the subcluster-aligned bulk, the part
  // after the last boundary, each zeroed by ZeroizeExtended, or written as
  // explicit zeroes (up to 16 MiB) where that is not possible.
  io::Task<absl::Status> WriteZeroesExtended(uint64_t offset, uint64_t length,
                                             bool may_unmap);
  // QEMU's qcow2_subcluster_zeroize of [offset, offset + length)
  // (subcluster aligned; the end may lie at or past the image end): zero
  // subclusters in the partial first and last clusters, whole zero
  // clusters (zero_in_l2_slice) between, the last cluster whole when the
  // range reaches the image end. Sets `*fallback` and stops when a partial
  // cluster is compressed, or with `if_no_data` when a subcluster holds
  // data.
  io::Task<absl::Status> ZeroizeExtended(uint64_t offset, uint64_t length,
                                         bool may_unmap, bool if_no_data,
                                         bool* fallback);
  // Whether guest range [offset, offset + length) (clamped to the image)
  // reads zeroes by block status (QEMU's is_zero): zero (sub)clusters, or
  // unallocated where the backing chain reads zeroes.
  io::Task<bool> ReadsZero(uint64_t offset, uint64_t length);

  // Flush (metadata lock held): L2 tables, refcount blocks, sync, frees.
  io::Task<absl::Status> FlushAll();
  // Close's write-back, as QEMU 7.2's qcow2_inactivate: the L2 table cache
  // (dirty tables, then a flush of the file), then the refcount block
  // cache (dirty L2 tables first if it has dirty blocks, its blocks, a
  // flush). The error of the first that failed, its message one line per
  // failed cache: "Failed to flush the L2 table cache: <strerror>",
  // "Failed to flush the refcount block cache: <strerror>".
  io::Task<absl::Status> FlushCachesForClose();
  // Before an L2 table write: the refcounts and data it relies on.
  io::Task<absl::Status> PrepareL2Write();
  io::Task<absl::Status> WriteL2Table(uint64_t offset, io::ConstIoVec data);

  // Resize pieces (metadata lock held).
  io::Task<absl::Status> GrowL1(uint64_t min_size, bool exact);
  io::Task<absl::Status> PreallocateMetadata(uint64_t from, uint64_t to);
  // The bytes [first, second) of a cluster that replaces `old` when a
  // request starting or ending in the subcluster holding byte `at` (of the
  // cluster) allocates it, i.e. what the new cluster gets written or copied
  // (QEMU's calculate_l2_meta): the whole cluster for standard L2 entries
  // and compressed clusters; with extended L2 entries the touched
  // subcluster, widened to the old cluster's allocated subclusters.
  std::pair<uint64_t, uint64_t> CowBounds(const format::L2Entry& old, uint64_t at) const;
  // Allocates host clusters for guest [from, to) (the first cluster anew
  // even if used, its part before `from` copied) in a grown file area;
  // `mark_allocated`: extended L2 bitmaps say "all data" (the area reads
  // as zeroes and must hide the backing file).
  io::Task<absl::Status> PreallocateData(uint64_t from, uint64_t to,
                                         io::PreallocMode mode,
                                         bool mark_allocated);
  io::Task<absl::Status> Shrink(uint64_t new_size);
  // Amend pieces (metadata lock held): QEMU's qcow2_mark_clean (flush,
  // clear the dirty bit, rewrite the header) and the zero cluster
  // expansion of a downgrade.
  io::Task<absl::Status> MarkClean();
  // qcow2_update_snapshot_refcount over L1 table `l1` (the active one when
  // `active`, else a snapshot's at `l1_offset`): adds `addend` (-1, 0, 1)
  // to the refcount of every cluster and L2 table it reaches, sets COPIED
  // where the refcount is 1 and clears it elsewhere, writes the L2 tables
  // and refcounts, and (addend >= 0) the L1 table if its flags changed.
  // Clusters whose refcount drops to 0 are punched in the file.
  // With `sync` false nothing is flushed: the L2 tables and refcounts stay
  // in their caches and the L1 table is written unsynced, for a caller whose
  // next FlushAll makes them durable before anything depends on them.
  io::Task<absl::Status> UpdateSnapshotRefcount(std::vector<uint64_t>& l1,
                                                bool active, uint64_t l1_offset,
                                                int addend, bool sync = true);
  // qcow2_validate_table for a snapshot's L1 table: kInvalidArgument
  // (EINVAL) "Snapshot L1 table offset invalid", kResourceExhausted (EFBIG)
  // "Snapshot L1 table too large".
  absl::Status ValidateSnapshotL1(const SnapshotRecord& sn) const;
  // Sets the dirty bit around a snapshot operation on a version 3 image
  // (false if it was set already or the image is version 2), and clears it.
  io::Task<absl::StatusOr<bool>> BeginSnapshotUpdate();
  io::Task<absl::Status> EndSnapshotUpdate(bool set_dirty);
  // Reads the whole snapshot table; `*table_bytes`: its length, from the
  // first entry to the end of the last name (unpadded).
  io::Task<absl::StatusOr<std::vector<SnapshotRecord>>> ReadSnapshotRecords(
      uint64_t* table_bytes);
  // qcow2_write_snapshots: writes `records` (every entry with at least
  // version 3's 24 bytes of extra data) to newly allocated clusters,
  // flushes everything cached (FlushAll), points the header at them
  // (synced) and frees the old table (in the refcount cache, not flushed),
  // punching a hole where a cluster became free (QEMU's
  // pass-discard-snapshot). With `incompatible_features` (version 3 only)
  // the header write also sets that field (e.g. the dirty bit changed), in
  // the same 20-byte write at offset 60, and header_ follows it.
  io::Task<absl::Status> RewriteSnapshotTable(
      const std::vector<SnapshotRecord>& records, uint64_t old_table_bytes,
      std::optional<uint64_t> incompatible_features = std::nullopt);
  // Zero clusters in the active L1's and every snapshot's L2 tables become
  // unallocated (no backing file) or zeroed data clusters
  // (qcow2_expand_zero_clusters); progress counts L1 entries.
  io::Task<absl::Status> ExpandZeroClusters(
      const std::vector<SnapshotRecord>& snapshots,
      const std::function<void(int64_t, int64_t)>& progress);
  // expand_zero_clusters_in_l1's work on one L2 table `l2` (at file offset
  // `l2_offset`, refcount `l2_refcount`): returns whether it changed.
  io::Task<absl::StatusOr<bool>> ExpandZeroClustersInL2(absl::Span<uint8_t> l2,
                                                        uint64_t l2_offset,
                                                        uint64_t l2_refcount);
  // Refcount width change (qcow2_change_refcount_order): new refcount
  // blocks and table are allocated (in the old refcounts) and written, then
  // one header write switches to them, then the old ones are freed.
  struct RefcountWalk;
  io::Task<absl::Status> ChangeRefcountOrder(
      uint32_t refcount_order,
      const std::function<void(int64_t, int64_t)>& progress);
  // One walk_over_reftable pass; `write`: fill and write the new blocks
  // (else allocate them). `walk`/`walks` place it in the progress.
  io::Task<absl::Status> WalkRefcounts(
      RefcountWalk& walk, bool write, int64_t walk_index, int64_t walks,
      const std::function<void(int64_t, int64_t)>& progress);
  io::Task<absl::Status> FinishNewRefblock(RefcountWalk& walk, bool write,
                                           bool empty);
  io::Task<bool> DetectMetadataPreallocation();

  std::unique_ptr<io::BlockNode> file_;
  std::unique_ptr<io::BlockNode> backing_;
  std::string full_backing_filename_;
  format::Header header_;
  Config config_;
  const uint32_t cluster_bits_;
  const uint64_t cluster_size_;
  const uint64_t l2_entries_;
  format::L2Format l2_format_;

  std::vector<uint64_t> l1_;                  // raw entries
  absl::flat_hash_set<uint64_t> l2_offsets_;  // active L2 tables
  std::vector<Diagnostic> diagnostics_;
  // The snapshot table as read at open (and after each rewrite).
  std::vector<SnapshotRecord> snapshot_records_;
  std::vector<SnapshotL1> snapshot_l1s_;
  uint64_t snapshots_bytes_ = 0;
  // A snapshot entry has less extra data than version 3 requires (the
  // 64-bit VM state size and the disk size: 16 bytes).
  bool snapshot_extra_too_short_ = false;
  std::unique_ptr<Refcounts> refcounts_;
  std::unique_ptr<TableCache> l2_cache_;

  io::Mutex meta_lock_;
  std::map<uint64_t, std::shared_ptr<Inflight>> inflight_;  // by first
  uint64_t next_seq_ = 1;
  std::multiset<uint64_t> ops_in_flight_;
  std::vector<PendingFree> pending_frees_;
  // AllocateL2Grouped's tables by L1 index, and the guest writes in flight
  // (WriteGuest) that decide whether it is used.
  std::map<uint64_t, std::shared_ptr<PendingL2>> pending_l2_;
  uint64_t guest_writes_ = 0;
  // SyncNewTables' round in flight and the one queued after it.
  std::shared_ptr<SyncRound> sync_running_;
  std::shared_ptr<SyncRound> sync_next_;
  uint64_t write_gen_ = 0;   // completed data writes
  uint64_t synced_gen_ = 0;  // write_gen_ at the last sync start
  bool first_write_done_ = false;
  bool dirty_set_by_us_ = false;
  std::optional<bool> metadata_preallocation_;
  std::vector<io::AlignedBuffer> cow_pool_;  // CowBuffer's free buffers
  uint64_t cow_pool_bytes_ = 0;
  absl::Status broken_;  // set by a fatal corruption event
  bool closed_ = false;
};

}  // namespace imgtool::qcow2

#endif  // IMGTOOL_QCOW2_QCOW2_NODE_H_
