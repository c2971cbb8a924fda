#include "slab_allocator.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <stdexcept>
#include <string>

namespace orca {

SlabAllocator::SlabAllocator(int64_t n_slots) : n_slots_(n_slots) {
  if (n_slots < 1) throw std::invalid_argument("SlabAllocator: n_slots must be >= 1, got " + std::to_string(n_slots));
  insert_free_run(0, n_slots);
}

void SlabAllocator::insert_free_run(int64_t start, int64_t len) {
  free_by_start_.emplace(start, len);
  free_by_size_.emplace(len, start);
}

void SlabAllocator::erase_free_run(std::map<int64_t, int64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_start_.erase(it);
}

int64_t SlabAllocator::allocate(int64_t n) {
  if (n < 1) throw std::invalid_argument("SlabAllocator.allocate: n must be >= 1, got " + std::to_string(n));
  std::lock_guard<std::mutex> lock(mutex_);
  auto fit = free_by_size_.lower_bound({n, INT64_MIN});
  if (fit == free_by_size_.end()) return -1;
  const int64_t len = fit->first, start = fit->second;
  erase_free_run(free_by_start_.find(start));
  if (len > n) insert_free_run(start + n, len - n);  // keep the tail free
  allocated_.emplace(start, n);
  n_used_ += n;
  return start;
}

void SlabAllocator::free(int64_t start) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto a = allocated_.find(start);
  if (a == allocated_.end())
    throw std::invalid_argument("SlabAllocator.free: no allocated slab starts at slot " + std::to_string(start));
  int64_t run_start = start, run_len = a->second;
  n_used_ -= a->second;
  allocated_.erase(a);
  // Coalesce with the free run right after, then the one right before.
  auto next = free_by_start_.lower_bound(run_start);
  if (next != free_by_start_.end() && next->first == run_start + run_len) {
    run_len += next->second;
    erase_free_run(next);
  }
  auto after = free_by_start_.lower_bound(run_start);
  if (after != free_by_start_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == run_start) {
      run_start = prev->first;
      run_len += prev->second;
      erase_free_run(prev);
    }
  }
  insert_free_run(run_start, run_len);
}

std::vector<std::array<int64_t, 3>> SlabAllocator::compact() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<std::pair<int64_t, int64_t>> slabs(allocated_.begin(), allocated_.end());  // (start, length)
  std::sort(slabs.begin(), slabs.end());
  std::vector<std::array<int64_t, 3>> moves;
  allocated_.clear();
  int64_t end = 0;
  for (const auto& [start, len] : slabs) {
    if (start != end) moves.push_back({start, end, len});
    allocated_.emplace(end, len);
    end += len;
  }
  free_by_start_.clear();
  free_by_size_.clear();
  if (end < n_slots_) insert_free_run(end, n_slots_ - end);
  return moves;
}

int64_t SlabAllocator::n_used() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return n_used_;
}

int64_t SlabAllocator::n_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return n_slots_ - n_used_;
}

int64_t SlabAllocator::largest_free() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

int64_t SlabAllocator::n_free_runs() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<int64_t>(free_by_start_.size());
}

}  // namespace orca
