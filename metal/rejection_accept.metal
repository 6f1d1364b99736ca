// Rejection-sampling verify, one threadgroup of NT threads per batch row
// (template: T, NT). params = [B, V]; p (R, B, V); q (R, B - 1, V), or any
// non-empty buffer when B == 1 (never read then); proposals (R, B), each row
// padded with one unused entry; uniforms (R, B).
// The residual row is sampled by inverse CDF: each thread owns a contiguous
// chunk of the vocabulary, so chunk totals plus an exclusive prefix over them
// give every CDF value without materialising the CDF.
constexpr int NSG = NT / 32;
const int B = params[0];
const int V = params[1];
const int t = thread_position_in_threadgroup.x;
const int sg = simdgroup_index_in_threadgroup;
const int lane = thread_index_in_simdgroup;
const int r = threadgroup_position_in_grid.y;
auto row_proposals = proposals + size_t(r) * B;
auto row_uniforms = uniforms + size_t(r) * B;
auto row_p = p + size_t(r) * B * V;
auto row_q = q + size_t(r) * (B - 1) * V;

threadgroup int tg_n;
threadgroup float tg_prefix[NT + 1];
threadgroup int tg_last_residual[NSG];
threadgroup int tg_last_p[NSG];
threadgroup int tg_count[NSG];

// B - 1 scalar ratio tests, in order: not worth parallelising.
if (t == 0) {
  int accepted = 0;
  while (accepted < B - 1) {
    const int x = row_proposals[accepted];
    const size_t at = size_t(accepted) * V + x;
    if (!(row_uniforms[accepted] * float(row_q[at]) < float(row_p[at]))) {
      break;
    }
    ++accepted;
  }
  tg_n = accepted;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const int n = tg_n;
// auto: MLX binds inputs under 8 elements as `constant`, larger as `device`.
auto pn = row_p + size_t(n) * V;
// q has no row for the bonus position: the bonus is drawn from p alone.
const bool has_q = n < B - 1;
auto qn = row_q + (has_q ? size_t(n) * V : 0);

const int chunk = (V + NT - 1) / NT;
const int lo = min(V, t * chunk);
const int hi = min(V, lo + chunk);

// Pass 1: last nonzero index of the residual and of p (fallback when the
// residual is all zero).
int last_residual = -1;
int last_p = -1;
for (int j = lo; j < hi; ++j) {
  if (dflash_weight(pn, qn, has_q, false, j) > 0.0f) {
    last_residual = j;
  }
  if (float(pn[j]) > 0.0f) {
    last_p = j;
  }
}
last_residual = simd_max(last_residual);
last_p = simd_max(last_p);
if (lane == 0) {
  tg_last_residual[sg] = last_residual;
  tg_last_p[sg] = last_p;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int g = 0; g < NSG; ++g) {
  last_residual = max(last_residual, tg_last_residual[g]);
  last_p = max(last_p, tg_last_p[g]);
}
const bool from_p = last_residual < 0;
// An all-zero row samples the last index, as the twin's clamp does.
const int last = from_p ? (last_p < 0 ? V - 1 : last_p) : last_residual;

// Pass 2: chunk totals, then an exclusive prefix over them.
float total = 0.0f;
for (int j = lo; j < hi; ++j) {
  total += dflash_weight(pn, qn, has_q, from_p, j);
}
tg_prefix[t + 1] = total;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (t == 0) {
  tg_prefix[0] = 0.0f;
  for (int i = 1; i <= NT; ++i) {
    tg_prefix[i] += tg_prefix[i - 1];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
const float threshold = row_uniforms[B - 1] * tg_prefix[NT];

// Pass 3: the sample is the number of CDF values <= threshold.
float cdf = tg_prefix[t];
int count = 0;
for (int j = lo; j < hi; ++j) {
  cdf += dflash_weight(pn, qn, has_q, from_p, j);
  count += cdf <= threshold ? 1 : 0;
}
count = simd_sum(count);
if (lane == 0) {
  tg_count[sg] = count;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

if (t == 0) {
  int sample = 0;
  for (int g = 0; g < NSG; ++g) {
    sample += tg_count[g];
  }
  num_accepted[r] = n;
  for (int b = 0; b < B; ++b) {
    tokens[size_t(r) * B + b] = b < n ? row_proposals[b] : (b == n ? min(sample, last) : 0);
  }
}
