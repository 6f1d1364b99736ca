// Runs Metal kernel bodies on the CPU: one std::thread per Metal thread of a
// threadgroup, a real barrier per threadgroup and per simdgroup, and simd
// functions emulated by exchanging values through the simdgroup's slots.
// Threadgroups run one after another, so function-scope statics (what the
// harness turns threadgroup declarations into) act as threadgroup memory.
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

typedef unsigned int uint;
typedef unsigned short ushort;
typedef _Float16 float16_t;
typedef _Float16 half;

// GCC 12 has no arithmetic __bf16: a storage type that converts through float
// with round-to-nearest-even, like the hardware conversion.
struct bfloat16_t {
  uint16_t bits;
  bfloat16_t() = default;
  bfloat16_t(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    bits = std::isnan(f) ? 0x7fc0 : uint16_t((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
  bfloat16_t(int i) : bfloat16_t(float(i)) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

struct uint3 {
  uint x, y, z;
};

namespace emu {

constexpr unsigned SIMD = 32;

struct SimdGroup {
  std::barrier<> sync{SIMD};
  alignas(16) unsigned char slots[SIMD][16];
};

struct Lane {
  std::barrier<>* group;
  SimdGroup* simd;
  unsigned index;
};

inline thread_local Lane* self = nullptr;

// Every lane publishes x and gets all 32 values back (lane order).
template <typename T>
std::array<T, SIMD> gather(T x) {
  static_assert(sizeof(T) <= 16);
  SimdGroup& s = *self->simd;
  std::memcpy(s.slots[self->index], &x, sizeof(T));
  s.sync.arrive_and_wait();
  std::array<T, SIMD> all;
  for (unsigned i = 0; i < SIMD; ++i) {
    std::memcpy(&all[i], s.slots[i], sizeof(T));
  }
  // Nobody may overwrite a slot before every lane has read it.
  s.sync.arrive_and_wait();
  return all;
}

struct Ids {
  uint3 thread_position_in_grid, thread_position_in_threadgroup, threadgroup_position_in_grid;
  uint3 threads_per_threadgroup, threadgroups_per_grid, grid_size;
  uint thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup;
  uint simdgroups_per_threadgroup, threads_per_simdgroup;
};

template <typename F>
void run_grid(uint3 grid, uint3 tg, F body) {
  if (grid.x % tg.x || grid.y % tg.y || grid.z % tg.z) {
    std::fprintf(stderr, "harness: grid must be a multiple of the threadgroup\n");
    std::exit(2);
  }
  const unsigned n = tg.x * tg.y * tg.z;
  if (n % SIMD) {
    std::fprintf(stderr, "harness: threadgroup size must be a multiple of %u\n", SIMD);
    std::exit(2);
  }
  const uint3 groups{grid.x / tg.x, grid.y / tg.y, grid.z / tg.z};
  std::barrier<> group(n);
  std::unique_ptr<SimdGroup[]> simds(new SimdGroup[n / SIMD]);
  std::vector<std::thread> threads;
  for (unsigned t = 0; t < n; ++t) {
    threads.emplace_back([&, t] {
      Lane lane{&group, &simds[t / SIMD], t % SIMD};
      self = &lane;
      Ids id{};
      id.thread_position_in_threadgroup = {t % tg.x, (t / tg.x) % tg.y, t / (tg.x * tg.y)};
      id.threads_per_threadgroup = tg;
      id.threadgroups_per_grid = groups;
      id.grid_size = grid;
      id.thread_index_in_threadgroup = t;
      id.simdgroup_index_in_threadgroup = t / SIMD;
      id.thread_index_in_simdgroup = t % SIMD;
      id.simdgroups_per_threadgroup = n / SIMD;
      id.threads_per_simdgroup = SIMD;
      for (uint z = 0; z < groups.z; ++z)
        for (uint y = 0; y < groups.y; ++y)
          for (uint x = 0; x < groups.x; ++x) {
            id.threadgroup_position_in_grid = {x, y, z};
            const uint3& p = id.thread_position_in_threadgroup;
            id.thread_position_in_grid = {x * tg.x + p.x, y * tg.y + p.y, z * tg.z + p.z};
            body(id);
            // Threadgroup memory is reused by the next threadgroup.
            group.arrive_and_wait();
          }
    });
  }
  for (auto& th : threads) th.join();
}

// Job file: int64 grid[3], tg[3], n; int64 sizes[n]; then the n buffers.
// The buffers (inputs, then outputs) are written back to the output file.
inline int main(int argc, char** argv, void (*dispatch)(uint3, uint3, void**)) {
  if (argc != 3) return 2;
  std::FILE* f = std::fopen(argv[1], "rb");
  int64_t head[7];
  if (!f || std::fread(head, 8, 7, f) != 7) return 3;
  std::vector<int64_t> sizes(head[6]);
  if (std::fread(sizes.data(), 8, sizes.size(), f) != sizes.size()) return 3;
  std::vector<std::vector<unsigned char>> data;
  std::vector<void*> ptrs;
  for (int64_t s : sizes) {
    data.emplace_back(s + 16);
    if (std::fread(data.back().data(), 1, s, f) != size_t(s)) return 3;
    ptrs.push_back(data.back().data());
  }
  std::fclose(f);
  dispatch(uint3{uint(head[0]), uint(head[1]), uint(head[2])},
           uint3{uint(head[3]), uint(head[4]), uint(head[5])}, ptrs.data());
  std::FILE* out = std::fopen(argv[2], "wb");
  for (size_t i = 0; i < sizes.size(); ++i) std::fwrite(data[i].data(), 1, sizes[i], out);
  std::fclose(out);
  return 0;
}

}  // namespace emu

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline void threadgroup_barrier(mem_flags) { emu::self->group->arrive_and_wait(); }
inline void simdgroup_barrier(mem_flags) { emu::self->simd->sync.arrive_and_wait(); }

template <typename T> T max(T a, T b) { return a > b ? a : b; }
template <typename T> T min(T a, T b) { return a < b ? a : b; }
template <typename T> T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
using std::abs;
using std::exp;
using std::exp2;
using std::fma;
using std::isinf;
using std::isnan;
using std::log;
using std::sqrt;
using std::tanh;
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace fast {
using std::exp;
using std::exp2;
using std::log;
}
namespace precise {
using std::exp;
using std::log;
}

// Sums run in lane order; Metal's hardware order may round differently.
template <typename T> T simd_sum(T x) {
  auto all = emu::gather(x);
  T acc = all[0];
  for (unsigned i = 1; i < emu::SIMD; ++i) acc = acc + all[i];
  return acc;
}
template <typename T> T simd_max(T x) {
  auto all = emu::gather(x);
  T acc = all[0];
  for (unsigned i = 1; i < emu::SIMD; ++i) acc = max(acc, all[i]);
  return acc;
}
template <typename T> T simd_min(T x) {
  auto all = emu::gather(x);
  T acc = all[0];
  for (unsigned i = 1; i < emu::SIMD; ++i) acc = min(acc, all[i]);
  return acc;
}
template <typename T> T simd_prefix_exclusive_sum(T x) {
  auto all = emu::gather(x);
  T acc = T(0);
  for (unsigned i = 0; i < emu::self->index; ++i) acc = acc + all[i];
  return acc;
}
template <typename T> T simd_prefix_inclusive_sum(T x) {
  return simd_prefix_exclusive_sum(x) + x;
}
template <typename T> T simd_shuffle(T x, ushort lane) { return emu::gather(x)[lane % emu::SIMD]; }
template <typename T> T simd_broadcast(T x, ushort lane) { return simd_shuffle(x, lane); }
// Lanes whose source is out of range keep their own value, as in Metal.
template <typename T> T simd_shuffle_down(T x, ushort delta) {
  auto all = emu::gather(x);
  unsigned src = emu::self->index + delta;
  return src < emu::SIMD ? all[src] : x;
}
template <typename T> T simd_shuffle_up(T x, ushort delta) {
  auto all = emu::gather(x);
  return emu::self->index >= delta ? all[emu::self->index - delta] : x;
}
template <typename T> T simd_shuffle_xor(T x, ushort mask) {
  return emu::gather(x)[(emu::self->index ^ mask) % emu::SIMD];
}
inline bool simd_all(bool x) { return simd_min(int(x)) != 0; }
inline bool simd_any(bool x) { return simd_max(int(x)) != 0; }
}  // namespace metal

using namespace metal;

// Address spaces last: the runtime above uses std::thread.
#define device
#define constant
#define thread
#define threadgroup
