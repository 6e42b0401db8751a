// Qcow2Node::Amend: `qemu-img amend` for qcow2 (QEMU 7.2's
// qcow2_amend_options, qcow2_upgrade, qcow2_downgrade and
// qcow2_expand_zero_clusters).
#include <cstdint>
#include <functional>
#include <utility>

#include "absl/strings/str_format.h"
#include "base/status_macros.h"
#include "qcow2/format/l2_entry.h"
#include "qcow2/qcow2_node.h"

namespace imgtool::qcow2 {

using format::ClusterType;
using format::L2Entry;

io::Task<absl::Status> Qcow2Node::MarkClean() {
  if (!header_.dirty()) co_return absl::OkStatus();
  CO_RETURN_IF_ERROR(co_await FlushAll());
  header_.incompatible_features &= ~format::kIncompatibleDirty;
  dirty_set_by_us_ = false;
  co_return co_await WriteHeader();
}

io::Task<absl::Status> Qcow2Node::ExpandZeroClusters(
    const std::function<void(int64_t, int64_t)>& progress) {
  const int64_t total = static_cast<int64_t>(l1_.size());
  for (uint64_t i = 0; i < l1_.size(); ++i) {
    if ((l1_[i] & format::kL1OffsetMask) != 0) {
      CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await LoadL2(i));
      CO_ASSIGN_OR_RETURN(const uint64_t l2_refcount,
                          co_await refcounts_->Get(l2.offset() >> cluster_bits_));
      for (uint64_t j = 0; j < l2_entries_; ++j) {
        const L2Entry old = GetEntry(l2, j);
        CO_ASSIGN_OR_RETURN(const ClusterType type,
                            co_await Classify(old, l2.offset(), j));
        if (type != ClusterType::kZeroPlain && type != ClusterType::kZeroAlloc) {
          continue;
        }
        if (l2_refcount != 1) {
          co_return absl::UnimplementedError(absl::StrFormat(
              "%s: downgrading an image with shared L2 tables is not "
              "supported yet",
              filename()));
        }
        uint64_t host = old.host_offset();
        if (type == ClusterType::kZeroPlain) {
          if (!has_backing_file()) {
            // Unallocated reads as zeroes without a backing file.
            SetEntry(l2, j, L2Entry{});
            continue;
          }
          CO_ASSIGN_OR_RETURN(host, co_await refcounts_->Allocate(cluster_size_));
        }
        CO_RETURN_IF_ERROR(co_await CheckOverlapOrFail(host, cluster_size_, 0));
        absl::Status zeroed =
            co_await file_->WriteZeroes(host, cluster_size_, io::WriteZeroesFlags{});
        if (!zeroed.ok()) {
          if (type == ClusterType::kZeroPlain) {
            (void)co_await refcounts_->Free(host, cluster_size_);
          }
          co_return zeroed;
        }
        ++write_gen_;
        L2Entry e;
        e.word = host | format::kCopiedFlag;
        SetEntry(l2, j, e);
      }
    }
    if (progress) progress(static_cast<int64_t>(i) + 1, total);
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> Qcow2Node::Amend(AmendOptions o) {
  if (read_only()) {
    co_return absl::FailedPreconditionError(
        absl::StrFormat("%s: image is read-only", filename()));
  }
  {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    const uint32_t old_version = header_.version;
    const uint32_t new_version = o.version.value_or(old_version);

    // Upgrade first: later steps may need version 3.
    if (new_version > old_version) {
      if (snapshot_extra_too_short_) {
        // QEMU rewrites the snapshot table then.
        co_return absl::UnimplementedError(absl::StrFormat(
            "%s: upgrading an image whose snapshots lack version 3's extra "
            "data is not supported yet",
            filename()));
      }
      if (o.progress) o.progress(0, 2);
      if (o.progress) o.progress(1, 2);
      header_.version = 3;
      header_.refcount_order = format::kV2RefcountOrder;
      if (absl::Status st = co_await WriteHeader(); !st.ok()) {
        header_.version = old_version;
        co_return st;
      }
      if (o.progress) o.progress(2, 2);
    }

    if (o.refcount_bits.has_value() &&
        *o.refcount_bits != header_.refcount_bits()) {
      if (new_version < 3 && *o.refcount_bits != 16) {
        co_return absl::InvalidArgumentError(
            "Refcount widths other than 16 bits require compatibility level "
            "1.1 or above (use compat=1.1 or greater)");
      }
      co_return absl::UnimplementedError(absl::StrFormat(
          "%s: changing refcount_bits of an existing image is not supported "
          "yet",
          filename()));
    }

    // No external data file: its raw bit never stays.
    header_.autoclear_features &= ~format::kAutoclearDataFileRaw;
    CO_RETURN_IF_ERROR(co_await WriteHeader());

    if (o.backing_file.has_value() || o.backing_format.has_value()) {
      if (o.backing_file != header_.backing_file ||
          o.backing_format != header_.backing_format) {
        co_return absl::InvalidArgumentError(
            "Cannot amend the backing file\n"
            "You can use 'imgtool rebase' instead.");
      }
    }

    if (o.lazy_refcounts.has_value() &&
        *o.lazy_refcounts != config_.lazy_refcounts) {
      if (*o.lazy_refcounts) {
        if (new_version < 3) {
          co_return absl::InvalidArgumentError(
              "Lazy refcounts only supported with compatibility level 1.1 "
              "and above (use compat=1.1 or greater)");
        }
        header_.compatible_features |= format::kCompatibleLazyRefcounts;
        if (absl::Status st = co_await WriteHeader(); !st.ok()) {
          header_.compatible_features &= ~format::kCompatibleLazyRefcounts;
          co_return st;
        }
        config_.lazy_refcounts = true;
      } else {
        CO_RETURN_IF_ERROR(co_await MarkClean());
        header_.compatible_features &= ~format::kCompatibleLazyRefcounts;
        if (absl::Status st = co_await WriteHeader(); !st.ok()) {
          header_.compatible_features |= format::kCompatibleLazyRefcounts;
          co_return st;
        }
        config_.lazy_refcounts = false;
      }
    }
  }

  if (o.size != 0) {
    CO_RETURN_IF_ERROR(co_await Truncate(o.size, io::PreallocMode::kOff));
  }

  // Downgrade last, once nothing needs version 3 any more.
  if (o.version.has_value() && *o.version < header_.version) {
    auto lock = co_await io::ScopedLock::Take(meta_lock_);
    CO_RETURN_IF_ERROR(CheckUsable());
    if (header_.refcount_order != format::kV2RefcountOrder) {
      co_return absl::FailedPreconditionError(
          "compat=0.10 requires refcount_bits=16");
    }
    if (header_.nb_snapshots > 0) {
      co_return absl::UnimplementedError(absl::StrFormat(
          "%s: downgrading an image with internal snapshots is not "
          "supported yet",
          filename()));
    }
    CO_RETURN_IF_ERROR(co_await MarkClean());
    const uint64_t incompatible =
        header_.incompatible_features & ~format::kIncompatibleCompressionType;
    if (incompatible != 0) {
      co_return absl::FailedPreconditionError(absl::StrFormat(
          "Cannot downgrade an image with incompatible features %#x set",
          incompatible));
    }
    header_.compatible_features = 0;
    config_.lazy_refcounts = false;
    header_.autoclear_features = 0;
    CO_RETURN_IF_ERROR(co_await ExpandZeroClusters(o.progress));
    if (header_.incompatible_features & format::kIncompatibleCompressionType) {
      // Version 2 has zlib only: fine while no cluster is compressed.
      for (uint64_t i = 0; i < l1_.size(); ++i) {
        if ((l1_[i] & format::kL1OffsetMask) == 0) continue;
        CO_ASSIGN_OR_RETURN(TableCache::Ref l2, co_await LoadL2(i));
        for (uint64_t j = 0; j < l2_entries_; ++j) {
          CO_ASSIGN_OR_RETURN(const ClusterType type,
                              co_await Classify(GetEntry(l2, j), l2.offset(), j));
          if (type == ClusterType::kCompressed) {
            co_return absl::FailedPreconditionError(
                "Cannot downgrade an image with zstd compression type and "
                "existing compressed clusters");
          }
        }
      }
      header_.incompatible_features &= ~format::kIncompatibleCompressionType;
      header_.compression_type = format::kCompressionZlib;
    }
    // The expanded L2 tables are durable before a version 2 header makes
    // their zero flags invalid.
    CO_RETURN_IF_ERROR(co_await FlushAll());
    const uint32_t current = header_.version;
    header_.version = 2;
    if (absl::Status st = co_await WriteHeader(); !st.ok()) {
      header_.version = current;
      co_return st;
    }
  }
  co_return absl::OkStatus();
}

}  // namespace imgtool::qcow2
