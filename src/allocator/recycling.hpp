// Two small containers for the allocator's hot path. They exist because the
// general ones cost most of an allocate+free pair: std::pmr's pool resource
// and std::unordered_map's node and bucket arithmetic were 40% and 15% of the
// instructions measured with callgrind (docs/benchmarks.md).
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace reservoir::detail {

// A std allocator that recycles single-object allocations through a free
// list, for node-based containers whose nodes all have one size. Not thread
// safe: the allocator's mutex guards it.
class NodeRecycler {
 public:
  NodeRecycler() = default;
  NodeRecycler(const NodeRecycler&) = delete;
  NodeRecycler& operator=(const NodeRecycler&) = delete;
  ~NodeRecycler() {
    for (void* p : chunks_) ::operator delete(p);
  }
  void* take(std::size_t bytes) {
    if (bytes != node_size_) {
      if (node_size_ == 0) {
        node_size_ = bytes;
      } else {
        return ::operator new(bytes);  // a second node size (never in practice)
      }
    }
    if (free_ == nullptr) grow();
    Free* f = free_;
    free_ = f->next;
    return f;
  }
  void give(void* p, std::size_t bytes) {
    if (bytes != node_size_) {
      ::operator delete(p);
      return;
    }
    auto* f = static_cast<Free*>(p);
    f->next = free_;
    free_ = f;
  }

 private:
  struct Free {
    Free* next;
  };
  void grow() {
    const std::size_t size = node_size_ < sizeof(Free) ? sizeof(Free) : node_size_;
    constexpr std::size_t kPerChunk = 256;
    char* chunk = static_cast<char*>(::operator new(size* kPerChunk));
    chunks_.push_back(chunk);
    for (std::size_t i = 0; i < kPerChunk; ++i) {
      auto* f = reinterpret_cast<Free*>(chunk + i * size);
      f->next = free_;
      free_ = f;
    }
  }
  std::size_t node_size_ = 0;
  Free* free_ = nullptr;
  std::vector<void*> chunks_;
};

template <typename T>
class RecyclingAllocator {
 public:
  using value_type = T;
  explicit RecyclingAllocator(NodeRecycler* recycler) noexcept : recycler_(recycler) {}
  template <typename U>
  RecyclingAllocator(const RecyclingAllocator<U>& other) noexcept : recycler_(other.recycler_) {}
  T* allocate(std::size_t n) {
    return n == 1 ? static_cast<T*>(recycler_->take(sizeof(T)))
                  : static_cast<T*>(::operator new(n * sizeof(T)));
  }
  void deallocate(T* p, std::size_t n) noexcept {
    if (n == 1) {
      recycler_->give(p, sizeof(T));
    } else {
      ::operator delete(p);
    }
  }
  template <typename U>
  bool operator==(const RecyclingAllocator<U>& o) const noexcept {
    return recycler_ == o.recycler_;
  }
  NodeRecycler* recycler_;
};

// Open-addressing map from a non-zero address to a pointer: linear probing,
// power-of-two capacity, backward-shift deletion (no tombstones).
template <typename V>
class AddressMap {
 public:
  AddressMap() : slots_(16) {}
  std::size_t size() const noexcept { return size_; }

  V* find(std::uintptr_t key) noexcept {
    for (std::size_t i = home(key);; i = (i + 1) & mask()) {
      if (slots_[i].key == key) return &slots_[i].value;
      if (slots_[i].key == 0) return nullptr;
    }
  }
  const V* find(std::uintptr_t key) const noexcept {
    return const_cast<AddressMap*>(this)->find(key);
  }
  // key must be absent and non-zero.
  [[gnu::always_inline]] void insert(std::uintptr_t key, V value) {
    if (size_ >= grow_at_) [[unlikely]]
      rehash(slots_.size() * 2);
    std::size_t i = home(key);
    while (slots_[i].key != 0) i = (i + 1) & mask();
    slots_[i] = Slot{key, value};
    ++size_;
  }
  // Returns false when key is absent.
  bool erase(std::uintptr_t key) noexcept {
    std::size_t i = home(key);
    while (slots_[i].key != key) {
      if (slots_[i].key == 0) return false;
      i = (i + 1) & mask();
    }
    erase_slot(i);
    return true;
  }
  // Erases the entry whose value find() returned (no insert or erase since).
  void erase_found(V* value) noexcept {
    const Slot* slot =
        reinterpret_cast<const Slot*>(reinterpret_cast<const char*>(value) - offsetof(Slot, value));
    erase_slot(static_cast<std::size_t>(slot - slots_.data()));
  }
  void clear() {
    for (Slot& s : slots_) s = Slot{};
    size_ = 0;
  }
  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_) {
      if (s.key != 0) f(s.key, s.value);
    }
  }

 private:
  struct Slot {
    std::uintptr_t key = 0;
    V value{};
  };
  void erase_slot(std::size_t i) noexcept {
    // Shift later members of the probe run back over the hole.
    std::size_t hole = i;
    for (std::size_t j = (i + 1) & mask(); slots_[j].key != 0; j = (j + 1) & mask()) {
      const std::size_t h = home(slots_[j].key);
      const bool movable = hole <= j ? (h <= hole || h > j) : (h <= hole && h > j);
      if (movable) {
        slots_[hole] = slots_[j];
        hole = j;
      }
    }
    slots_[hole] = Slot{};
    --size_;
  }
  std::size_t mask() const noexcept { return mask_; }
  std::size_t home(std::uintptr_t key) const noexcept {
    // The top log2(capacity) bits of the product: below the capacity.
    return static_cast<std::size_t>(((key >> 9) * 0x9E3779B97F4A7C15ull) >> shift_);
  }
  [[gnu::noinline]] void rehash(std::size_t capacity) {
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    shift_ = 64 - static_cast<unsigned>(__builtin_ctzll(capacity));
    mask_ = capacity - 1;
    grow_at_ = capacity * 3 / 4;  // at most three quarters full
    size_ = 0;
    for (const Slot& s : old) {
      if (s.key != 0) insert(s.key, s.value);
    }
  }
  std::vector<Slot> slots_;
  std::size_t size_ = 0;
  std::size_t mask_ = 15;     // slots_.size() - 1
  std::size_t grow_at_ = 12;  // sizes from which an insert grows the table first
  unsigned shift_ = 60;       // 64 - log2(16)
};

}  // namespace reservoir::detail
