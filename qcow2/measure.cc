#include "qcow2/measure.h"

#include <cstdint>

namespace imgtool::qcow2 {
namespace {

constexpr uint64_t kL1EntryBytes = 8;
constexpr uint64_t kRefcountTableEntryBytes = 8;
constexpr uint64_t kMaxL1TableBytes = uint64_t{32} << 20;

uint64_t DivRoundUp(uint64_t a, uint64_t b) { return a / b + (a % b != 0); }
uint64_t RoundUp(uint64_t a, uint64_t b) { return DivRoundUp(a, b) * b; }
uint64_t L2EntryBytes(const MeasureGeometry& g) {
  return g.extended_l2 ? 16 : 8;
}

}  // namespace

uint64_t RefcountMetadataBytes(uint64_t clusters, const MeasureGeometry& g) {
  const uint64_t entries_per_table_cluster =
      g.cluster_size / kRefcountTableEntryBytes;
  const uint64_t refcounts_per_block =
      g.cluster_size * 8 / (uint64_t{1} << g.refcount_order);
  // Blocks and table clusters count themselves too: iterate until adding
  // them needs no further block or table cluster.
  uint64_t table = 0;
  uint64_t blocks = 0;
  uint64_t total = 0;
  uint64_t last = 0;
  do {
    last = total;
    blocks = DivRoundUp(clusters + table + blocks, refcounts_per_block);
    table = DivRoundUp(blocks, entries_per_table_cluster);
    total = clusters + blocks + table;
  } while (total != last);
  return (blocks + table) * g.cluster_size;
}

uint64_t FullyAllocatedSize(uint64_t virtual_size, const MeasureGeometry& g) {
  const uint64_t cs = g.cluster_size;
  const uint64_t data = RoundUp(virtual_size, cs);
  uint64_t meta = cs;  // the header cluster
  // L2 tables: one entry per data cluster, whole tables.
  const uint64_t l2_entries = RoundUp(data / cs, cs / L2EntryBytes(g));
  meta += l2_entries * L2EntryBytes(g);
  // L1 table: one entry per L2 table, whole clusters.
  const uint64_t l1_entries =
      RoundUp(l2_entries * L2EntryBytes(g) / cs, cs / kL1EntryBytes);
  meta += l1_entries * kL1EntryBytes;
  meta += RefcountMetadataBytes((meta + data) / cs, g);
  return meta + data;
}

bool FitsL1Limit(uint64_t virtual_size, const MeasureGeometry& g) {
  const uint64_t cs = g.cluster_size;
  const uint64_t l2_tables =
      DivRoundUp(RoundUp(virtual_size, cs) / cs, cs / L2EntryBytes(g));
  return l2_tables * kL1EntryBytes <= kMaxL1TableBytes;
}

Measurement MeasureQcow2(uint64_t virtual_size, uint64_t data_bytes,
                         const MeasureGeometry& g) {
  Measurement m;
  m.fully_allocated = FullyAllocatedSize(virtual_size, g);
  m.required =
      m.fully_allocated - RoundUp(virtual_size, g.cluster_size) + data_bytes;
  return m;
}

}  // namespace imgtool::qcow2
