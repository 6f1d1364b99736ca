// Shared by the dflash kernels; passed to mx.fast.metal_kernel as `header`.

// Marks "no element seen yet" so that any real index wins a tie against it.
constant constexpr int DFLASH_NO_INDEX = 0x7fffffff;

// Lowest index wins ties, the same rule as mx.argmax.
inline void dflash_argmax_merge(thread float& best, thread int& index, float value, int j) {
  if (value > best || (value == best && j < index)) {
    best = value;
    index = j;
  }
}

// After this, lane 0 holds the argmax of the simdgroup's (best, index) pairs.
inline void dflash_simd_argmax(thread float& best, thread int& index) {
  for (ushort offset = 16; offset > 0; offset /= 2) {
    float other = simd_shuffle_down(best, offset);
    int other_index = simd_shuffle_down(index, offset);
    dflash_argmax_merge(best, index, other, other_index);
  }
}

// Residual weight of the rejection sampler, in fp32 whatever the input dtype.
// P and Q point into `device` or `constant` memory, whichever MLX bound.
template <typename P, typename Q>
inline float dflash_weight(P p, Q q, bool has_q, bool from_p, int j) {
  float pj = float(p[j]);
  if (from_p) {
    return pj;
  }
  return max(pj - (has_q ? float(q[j]) : 0.0f), 0.0f);
}
