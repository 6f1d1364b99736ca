// Block attention of the drafter: one threadgroup per (query row, head, batch row).
// Template: T (dtype), D (head dim, a multiple of 32), NSG (simdgroups).
// params = [L, S, n_heads, n_heads / n_kv_heads, window (0: none), causal (0/1)];
// lengths[r] = how many of batch row r's S keys are real (the rest is padding).
// Each simdgroup runs an online softmax over every NSG-th visible key and the
// lanes split the head dim, so a key costs one simd_sum; the simdgroups'
// partial softmaxes are merged through threadgroup memory at the end.
constexpr int PER_LANE = D / 32;
const int L = params[0];
const int S = params[1];
const int n_heads = params[2];
const int group = params[3];
const int window = params[4];
const bool causal = params[5] != 0;
const int row = threadgroup_position_in_grid.x;
const int head = threadgroup_position_in_grid.y;
const int batch = threadgroup_position_in_grid.z;
const int sg = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;

// The mask comes from positions: this batch row's block is the last L of its
// `end` keys, so query `row` sits at end - L + row. The window limits context
// keys only and the block's keys start at end - L, so the visible keys are one
// contiguous range, and padding (from `end` on) is never read. Clamping `end`
// to [L, S] keeps any lengths value inside the buffers.
const int end = min(max(int(lengths[batch]), L), S);
const int qpos = end - L + row;
const int lo = window > 0 ? min(max(0, qpos - window + 1), end - L) : 0;
const int hi = causal ? qpos + 1 : end;

const device T* qrow = q + ((size_t(batch) * n_heads + head) * L + row) * D;
const size_t kv_head = size_t(batch) * (n_heads / group) + head / group;
const device T* keys = k + kv_head * S * D;
const device T* values = v + kv_head * S * D;

float qs[PER_LANE];
float acc[PER_LANE];
for (int d = 0; d < PER_LANE; ++d) {
  qs[d] = float(qrow[lane + 32 * d]) * scale[0];
  acc[d] = 0.0f;
}
float m = -INFINITY;
float l = 0.0f;
for (int j = lo + sg; j < hi; j += NSG) {
  float s = 0.0f;
  for (int d = 0; d < PER_LANE; ++d) {
    s += qs[d] * float(keys[size_t(j) * D + lane + 32 * d]);
  }
  s = simd_sum(s);
  float m_new = max(m, s);
  float rescale = exp(m - m_new);
  float w = exp(s - m_new);
  l = l * rescale + w;
  for (int d = 0; d < PER_LANE; ++d) {
    acc[d] = acc[d] * rescale + w * float(values[size_t(j) * D + lane + 32 * d]);
  }
  m = m_new;
}

threadgroup float tg_m[NSG];
threadgroup float tg_l[NSG];
threadgroup float tg_acc[NSG * D];
if (lane == 0) {
  tg_m[sg] = m;
  tg_l[sg] = l;
}
for (int d = 0; d < PER_LANE; ++d) {
  tg_acc[sg * D + lane + 32 * d] = acc[d];
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (sg == 0) {
  float m_all = -INFINITY;
  for (int g = 0; g < NSG; ++g) {
    m_all = max(m_all, tg_m[g]);
  }
  // A simdgroup that saw no key has m = -inf and so weight exp(-inf) = 0.
  float l_all = 0.0f;
  float o[PER_LANE];
  for (int d = 0; d < PER_LANE; ++d) {
    o[d] = 0.0f;
  }
  for (int g = 0; g < NSG; ++g) {
    float w = exp(tg_m[g] - m_all);
    l_all += w * tg_l[g];
    for (int d = 0; d < PER_LANE; ++d) {
      o[d] += w * tg_acc[g * D + lane + 32 * d];
    }
  }
  device T* orow = out + ((size_t(batch) * n_heads + head) * L + row) * D;
  for (int d = 0; d < PER_LANE; ++d) {
    orow[lane + 32 * d] = T(o[d] / l_all);
  }
}
