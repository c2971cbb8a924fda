// SlabAllocator: hands out contiguous runs ("slabs") of KV-cache token slots.
//
// Policy: best-fit over free runs (the smallest free run that fits; ties go to the lowest start).
// Why best-fit: Orca's FCFS admission stalls the whole queue when the head request finds no
// contiguous slab, so keeping large runs intact matters more than the few extra log-n steps.
// Both maps are ordered, so allocate and free are O(log n) in the number of free runs, freed
// neighbours coalesce at once, and n_used / n_free / largest_free are O(1).
// A mutex makes each call atomic, so an abort on a user thread can never race the engine loop.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <unordered_map>
#include <utility>
#include <vector>

namespace orca {

class SlabAllocator {
 public:
  explicit SlabAllocator(int64_t n_slots);

  // Start slot of a free contiguous run of n slots, or -1 when none exists. Throws
  // std::invalid_argument for n < 1.
  int64_t allocate(int64_t n);
  // Returns the slab that starts at `start`. Throws std::invalid_argument when no slab starts there.
  void free(int64_t start);
  // Slides every slab toward slot 0, keeping their order, so that the free slots become one run
  // at the end. Returns {old_start, new_start, length} of each slab that moved, in address order:
  // copying the slabs' contents in that order never overwrites a slab that has yet to be copied.
  std::vector<std::array<int64_t, 3>> compact();

  int64_t n_slots() const { return n_slots_; }
  int64_t n_used() const;
  int64_t n_free() const;
  int64_t largest_free() const;
  int64_t n_free_runs() const;

 private:
  void insert_free_run(int64_t start, int64_t len);
  void erase_free_run(std::map<int64_t, int64_t>::iterator it);

  const int64_t n_slots_;
  int64_t n_used_ = 0;
  std::map<int64_t, int64_t> free_by_start_;             // start -> length
  std::set<std::pair<int64_t, int64_t>> free_by_size_;   // (length, start)
  std::unordered_map<int64_t, int64_t> allocated_;       // start -> length
  mutable std::mutex mutex_;
};

}  // namespace orca
