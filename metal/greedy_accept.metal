// Greedy verify, one threadgroup of NT threads per batch row (template: T, NT).
// params = [B, V]; logits (R, B, V); proposals (R, B), each row padded with one
// unused entry. Verify rows are reduced in order and the loop stops at the
// first mismatch, so rows after a rejection are never read.
constexpr int NSG = NT / 32;
const int B = params[0];
const int V = params[1];
const int t = thread_position_in_threadgroup.x;
const int sg = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;
const int r = threadgroup_position_in_grid.y;
auto row_proposals = proposals + size_t(r) * B;

threadgroup float tg_best[NSG];
threadgroup int tg_index[NSG];
threadgroup int tg_argmax;

int n = 0;
for (; n < B; ++n) {
  // auto: MLX binds inputs under 8 elements as `constant`, larger as `device`.
  auto x = logits + (size_t(r) * B + n) * V;
  float best = -INFINITY;
  int index = DFLASH_NO_INDEX;
  for (int j = t; j < V; j += NT) {
    dflash_argmax_merge(best, index, float(x[j]), j);
  }
  dflash_simd_argmax(best, index);
  if (lane == 0) {
    tg_best[sg] = best;
    tg_index[sg] = index;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (sg == 0) {
    best = lane < NSG ? tg_best[lane] : -INFINITY;
    index = lane < NSG ? tg_index[lane] : DFLASH_NO_INDEX;
    dflash_simd_argmax(best, index);
    if (lane == 0) {
      tg_argmax = index;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  // Every thread reads the same tg_argmax, so all leave the loop together.
  if (n == B - 1 || tg_argmax != row_proposals[n]) {
    break;
  }
}

for (int b = t; b < B; b += NT) {
  tokens[size_t(r) * B + b] = b < n ? row_proposals[b] : (b == n ? tg_argmax : 0);
}
if (t == 0) {
  num_accepted[r] = n;
}
