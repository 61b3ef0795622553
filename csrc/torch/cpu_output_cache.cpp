// The recycling cache of the CPU ops' large outputs (cpu_output_cache.h says why).
//
// A c10::Allocator whose blocks, when their tensor is freed, go to a list instead of back to
// the system. The next large output takes the smallest cached block that fits it without
// wasting more than a quarter of itself. Blocks are made with 1/16 headroom, so a decode loop's
// present, one row longer each call, reuses the same blocks for many calls.
//
// What the cache may hold is bounded three ways: its byte limit (oldest blocks freed first), a
// block left unused while 256 large outputs were allocated is freed, and
// release_cpu_output_cache() frees everything at once.
#include "cpu_output_cache.h"

#include <ATen/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>

#include <algorithm>
#include <mutex>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__unix__) || defined(__APPLE__)
#include <pthread.h>
#include <unistd.h>
#endif

namespace gqa {
namespace {

constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMostDefaultLimit = size_t{2} << 30;
constexpr uint64_t kMaxIdleAllocations = 256;

size_t round_up(size_t bytes, size_t to) { return (bytes + to - 1) / to * to; }

// 2 GiB, or an eighth of the machine's memory where that is less: what a cache may keep idle
// without a user noticing it (a B = 8 decode with 4,096 keys of past recycles 277 MB).
size_t default_limit() {
#if defined(_SC_PHYS_PAGES) && defined(_SC_PAGESIZE)
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  if (pages > 0 && page > 0) return std::min(kMostDefaultLimit, size_t(pages) * size_t(page) / 8);
#endif
  return kMostDefaultLimit;
}

// Fresh blocks are large and about to be written whole: transparent huge pages cut the kernel's
// first-touch cost about 3x. Only whole 2 MB pages inside the block are advised; a kernel
// without THP ignores the advice.
void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  const uintptr_t start = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = round_up(start, kHugePage);
  const uintptr_t last = (start + bytes) / kHugePage * kHugePage;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);  // advice only
#else
  (void)data;
  (void)bytes;
#endif
}

struct Block {
  void* data;
  size_t capacity;
  uint64_t freed_at;  // the allocation count when it entered the cache
};

class RecyclingAllocator final : public c10::Allocator {
 public:
  c10::DataPtr allocate(size_t bytes) override {
    if (bytes < kMinRecycledBytes) return c10::GetDefaultCPUAllocator()->allocate(bytes);
    std::vector<Block> stale;
    Block* block = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++allocations_;
      take_idle(&stale);
      block = take_fitting(bytes);
      ++(block ? hits_ : misses_);
    }
    free_blocks(stale);
    if (!block) {
      const size_t capacity = round_up(bytes + bytes / 16, kHugePage);
      block = new Block{c10::alloc_cpu(capacity), capacity, 0};
      advise_huge_pages(block->data, capacity);
    }
    return {block->data, block, &RecyclingAllocator::return_block, c10::Device(c10::DeviceType::CPU)};
  }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    default_copy_data(dest, src, count);
  }

  CpuOutputCacheInfo info() {
    std::lock_guard<std::mutex> lock(mutex_);
    return {limit_, cached_bytes_, cached_.size(), hits_, misses_};
  }

  void set_limit(size_t bytes) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_ = bytes;
      trim_to_limit(&evicted);
    }
    free_blocks(evicted);
  }

  void release() {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      evicted.swap(cached_);
      cached_bytes_ = 0;
    }
    free_blocks(evicted);
  }

  static RecyclingAllocator& instance() {
    // Never destroyed: tensors freed during interpreter shutdown still return their blocks here.
    static RecyclingAllocator* allocator = [] {
      auto* made = new RecyclingAllocator();
#if defined(__unix__) || defined(__APPLE__)
      // A fork while another thread holds the lock would leave it held forever in the child (a
      // DataLoader worker, say): hold it across fork, as glibc does for malloc's.
      pthread_atfork([] { instance().mutex_.lock(); }, [] { instance().mutex_.unlock(); },
                     [] { instance().mutex_.unlock(); });
#endif
      return made;
    }();
    return *allocator;
  }

 private:
  static void return_block(void* context) {
    Block* block = static_cast<Block*>(context);
    instance().give_back(*block);
    delete block;
  }

  void give_back(Block block) {
    std::vector<Block> evicted;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (block.capacity > limit_) {
        evicted.push_back(block);  // keeping it would only push out every other block
      } else {
        block.freed_at = allocations_;
        cached_.push_back(block);  // oldest first
        cached_bytes_ += block.capacity;
        trim_to_limit(&evicted);
      }
    }
    free_blocks(evicted);
  }

  // The smallest cached block that holds `bytes` and wastes at most a quarter of them plus a
  // huge page, removed from the cache; nullptr when none fits.
  Block* take_fitting(size_t bytes) {
    const size_t most = bytes + bytes / 4 + kHugePage;
    auto best = cached_.end();
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {
      if (it->capacity >= bytes && it->capacity <= most && (best == cached_.end() || it->capacity < best->capacity))
        best = it;
    }
    if (best == cached_.end()) return nullptr;
    Block* block = new Block(*best);
    cached_bytes_ -= best->capacity;
    cached_.erase(best);
    return block;
  }

  void take_idle(std::vector<Block>* out) {
    auto idle = [&](const Block& b) { return allocations_ - b.freed_at > kMaxIdleAllocations; };
    for (const Block& b : cached_)
      if (idle(b)) {
        out->push_back(b);
        cached_bytes_ -= b.capacity;
      }
    cached_.erase(std::remove_if(cached_.begin(), cached_.end(), idle), cached_.end());
  }

  void trim_to_limit(std::vector<Block>* out) {
    size_t oldest = 0;
    while (cached_bytes_ > limit_ && oldest < cached_.size()) {
      out->push_back(cached_[oldest]);
      cached_bytes_ -= cached_[oldest].capacity;
      ++oldest;
    }
    cached_.erase(cached_.begin(), cached_.begin() + oldest);
  }

  // Outside the lock: giving memory back to the system can take a while.
  static void free_blocks(const std::vector<Block>& blocks) {
    for (const Block& b : blocks) c10::free_cpu(b.data);
  }

  std::mutex mutex_;
  std::vector<Block> cached_;
  size_t cached_bytes_ = 0;
  size_t limit_ = default_limit();
  uint64_t allocations_ = 0;
  uint64_t hits_ = 0;
  uint64_t misses_ = 0;
};

}  // namespace

at::Tensor empty_cpu_output(at::IntArrayRef shape, const at::TensorOptions& options) {
  RecyclingAllocator& allocator = RecyclingAllocator::instance();
  const size_t bytes = size_t(c10::multiply_integers(shape)) * options.dtype().itemsize();
  if (bytes < kMinRecycledBytes) return at::empty(shape, options);
  // With the cache disabled the allocator still makes the block (huge-page advice) and frees it
  // on return.
  return at::detail::empty_generic(shape, &allocator, c10::DispatchKeySet(c10::DispatchKey::CPU),
                                   c10::typeMetaToScalarType(options.dtype()), c10::nullopt);
}

CpuOutputCacheInfo cpu_output_cache_info() { return RecyclingAllocator::instance().info(); }

void release_cpu_output_cache() { RecyclingAllocator::instance().release(); }

void set_cpu_output_cache_limit(size_t bytes) { RecyclingAllocator::instance().set_limit(bytes); }

}  // namespace gqa
