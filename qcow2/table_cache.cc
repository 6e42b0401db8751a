#include "qcow2/table_cache.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <utility>
#include <vector>

#include "base/status_macros.h"

namespace imgtool::qcow2 {

TableCache::Ref::Ref(TableCache* cache, Table* table)
    : cache_(cache), table_(table) {
  ++table_->pins;
}

TableCache::Ref::Ref(Ref&& other) noexcept
    : cache_(std::exchange(other.cache_, nullptr)),
      table_(std::exchange(other.table_, nullptr)) {}

TableCache::Ref& TableCache::Ref::operator=(Ref&& other) noexcept {
  if (this != &other) {
    reset();
    cache_ = std::exchange(other.cache_, nullptr);
    table_ = std::exchange(other.table_, nullptr);
  }
  return *this;
}

void TableCache::Ref::reset() {
  if (table_ != nullptr) {
    cache_->Unpin(std::exchange(table_, nullptr));
    cache_ = nullptr;
  }
}

TableCache::TableCache(uint64_t table_size, size_t capacity, ReadFn read,
                       WriteFn write)
    : table_size_(table_size),
      alignment_(std::min<size_t>(
          io::AlignedBuffer::kDefaultAlignment,
          table_size == 0 ? io::AlignedBuffer::kDefaultAlignment
                          : size_t{1} << std::countr_zero(table_size))),
      capacity_(std::max<size_t>(capacity, 1)),
      read_(std::move(read)),
      write_(std::move(write)) {}

void TableCache::Unpin(Table* table) {
  if (--table->pins == 0 && table->discarded) graveyard_.erase(table);
}

void TableCache::Drop(
    absl::flat_hash_map<uint64_t, std::unique_ptr<Table>>::iterator it) {
  std::unique_ptr<Table> table = std::move(it->second);
  tables_.erase(it);
  table->dirty = false;
  if (table->pins > 0) {
    table->discarded = true;
    Table* raw = table.get();
    graveyard_[raw] = std::move(table);
  }
}

io::Task<absl::Status> TableCache::MakeRoom() {
  while (tables_.size() >= capacity_) {
    Table* victim = nullptr;
    for (auto& [offset, t] : tables_) {
      if (t->pins > 0) continue;
      if (victim == nullptr || t->last_use < victim->last_use) victim = t.get();
    }
    if (victim == nullptr) co_return absl::OkStatus();  // all pinned: grow
    if (victim->dirty) {
      // Pin while writing so that nothing else evicts or reuses it.
      Ref pin(this, victim);
      CO_RETURN_IF_ERROR(co_await write_(victim->offset, victim->data.span()));
      victim->dirty = false;
      // Someone may have touched it meanwhile; start over.
      continue;
    }
    tables_.erase(victim->offset);
  }
  co_return absl::OkStatus();
}

io::Task<absl::StatusOr<TableCache::Ref>> TableCache::Get(uint64_t offset) {
  auto it = tables_.find(offset);
  if (it == tables_.end()) {
    CO_RETURN_IF_ERROR(co_await MakeRoom());
    // MakeRoom may have suspended: look again.
    it = tables_.find(offset);
  }
  if (it != tables_.end()) {
    it->second->last_use = ++clock_;
    co_return Ref(this, it->second.get());
  }
  auto table = std::make_unique<Table>();
  table->offset = offset;
  // Not zeroed: the read fills all of it (BlockNode::Read reads zeroes
  // past the end) or the table is dropped.
  table->data = io::AlignedBuffer::Uninitialized(table_size_, alignment_);
  table->last_use = ++clock_;
  Table* raw = table.get();
  tables_[offset] = std::move(table);
  // Pinned during the read so that it can't be evicted meanwhile.
  Ref ref(this, raw);
  absl::Status st = co_await read_(offset, raw->data.span());
  if (!st.ok()) {
    auto again = tables_.find(offset);
    if (again != tables_.end() && again->second.get() == raw) Drop(again);
    co_return st;
  }
  co_return ref;
}

TableCache::Table* TableCache::Zeroed(uint64_t offset, bool dirty) {
  Table* raw = Peek(offset);
  if (raw != nullptr) {
    std::memset(raw->data.data(), 0, table_size_);
  } else {
    auto table = std::make_unique<Table>();
    table->offset = offset;
    table->data = io::AlignedBuffer(table_size_, alignment_);  // zeroes
    raw = table.get();
    tables_[offset] = std::move(table);
  }
  raw->dirty = dirty;
  raw->last_use = ++clock_;
  return raw;
}

io::Task<absl::StatusOr<TableCache::Ref>> TableCache::GetEmpty(uint64_t offset) {
  if (Peek(offset) == nullptr) CO_RETURN_IF_ERROR(co_await MakeRoom());
  co_return Ref(this, Zeroed(offset, /*dirty=*/true));
}

void TableCache::PutZeroed(uint64_t offset) {
  if (Peek(offset) != nullptr || tables_.size() < capacity_) {
    Zeroed(offset, /*dirty=*/false);
  }
}

TableCache::Table* TableCache::Peek(uint64_t offset) {
  auto it = tables_.find(offset);
  return it == tables_.end() ? nullptr : it->second.get();
}

void TableCache::Discard(uint64_t offset) {
  auto it = tables_.find(offset);
  if (it != tables_.end()) Drop(it);
}

io::Task<absl::Status> TableCache::WriteDirty() {
  std::vector<uint64_t> dirty;
  for (auto& [offset, t] : tables_) {
    if (t->dirty) dirty.push_back(offset);
  }
  std::sort(dirty.begin(), dirty.end());
  for (uint64_t offset : dirty) {
    CO_RETURN_IF_ERROR(co_await WriteOne(offset));
  }
  co_return absl::OkStatus();
}

io::Task<absl::Status> TableCache::WriteOne(uint64_t offset) {
  Table* t = Peek(offset);
  if (t == nullptr || !t->dirty) co_return absl::OkStatus();
  Ref pin(this, t);
  // Clear first: a change made while the write is in flight sets it again.
  t->dirty = false;
  absl::Status st = co_await write_(offset, t->data.span());
  if (!st.ok()) t->dirty = true;
  co_return st;
}

bool TableCache::HasDirty() const {
  for (const auto& [offset, t] : tables_) {
    if (t->dirty) return true;
  }
  return false;
}

}  // namespace imgtool::qcow2
