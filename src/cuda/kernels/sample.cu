// Choosing the next token of every row of a decode batch on the device: the CPU
// `Sampler`'s rules (src/engine/sampling.rs) over one block per row, so that only the chosen
// ids leave the device. Shared by every mixer; it needs nothing of the model but the
// vocabulary's size and the logits' row stride.
//
// Per row, in the CPU's order: logit bias, repetition penalty (over the tokens seen in the
// prompt or generated), frequency and presence penalties (over the generated ones), then
// either the first index of the maximum (temperature 0; NaN never wins; 0 when nothing
// beats −∞) or temperature, top-k, top-p, min-p and a seeded draw.
//
// The draw's candidates are found without sorting: top-k's k-th largest value by a radix
// select on the order-preserving bits of the scaled logits, top-p's cut by the same select
// on the bits of the softmax weights with each bin holding the weight mass instead of a
// count (ties at either cut go to the lowest indices, as the CPU's sort orders them), min-p
// as weight ≥ min_p · the largest (which is 1). Masses are fixed point (2⁴⁰ per unit weight)
// and summed as integers, so that a row's result does not depend on the order of the
// block's additions: same seed, same logits, same token. The draw walks the candidates in
// index order. Its uniform comes from a counter-based generator (SplitMix64 keyed by the
// row's seed, at the row's draw counter), and the kernel advances the counter: a replayed
// launch needs nothing written by the host.

#define SAMPLE_THREADS 1024
#define SAMPLE_WARPS (SAMPLE_THREADS / 32)
// Bit of a count word: the token was in the prompt or generated (repetition penalty); the
// bits below count how often it was generated (frequency and presence penalties).
#define SEEN_BIT 0x80000000u
// Fixed-point scale of a weight in [0, 1]: sums of 2²³ entries stay below 2⁶³.
#define MASS_ONE 1099511627776.0f
#define NEG_INF __int_as_float(0xff800000u)

// A row's options (twin of `RowOptions` in src/engine/cuda/sample.rs: 13 words).
struct RowOptions {
    float temperature;  // < 1e-5: greedy
    unsigned top_k;     // 0: off
    float top_p;        // 1: off
    float min_p;        // 0: off
    float repetition_penalty;
    float frequency_penalty;
    float presence_penalty;
    unsigned bias_start;  // the row's entries of the bias list
    unsigned bias_len;
    unsigned seed_lo, seed_hi;
    unsigned slot;  // its count words and draw counter
    unsigned logprobs;  // 0: none; n + 1: the chosen token's and the n best tokens'
};

typedef unsigned long long u64;

__device__ __forceinline__ u64 splitmix64(u64 z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// The `draw`-th 64-bit random number of the stream of `seed`.
__device__ __forceinline__ u64 random_at(u64 seed, u64 draw) {
    return splitmix64(splitmix64(seed) + (draw + 1) * 0x9E3779B97F4A7C15ull);
}

// Bits of a float ordered as the floats (total order: −NaN < −∞ < … < −0 < +0 < … < +∞).
__device__ __forceinline__ unsigned order_key(float v) {
    const unsigned u = __float_as_uint(v);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// A softmax weight e^d for d = x − max ≤ 0; 0 below e⁻⁸⁷ and for NaN (as the CPU's).
__device__ __forceinline__ float weight_of(float d) { return d >= -87.f ? expf(d) : 0.f; }

__device__ __forceinline__ u64 mass_of(float w) { return __float2ull_rz(w * MASS_ONE); }

// Block-wide reductions (every thread gets the result); `sh` holds SAMPLE_WARPS entries.
template <class T> __device__ T block_sum(T v, T* sh) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    T s = 0;
    for (int w = 0; w < SAMPLE_WARPS; ++w) s += sh[w];
    return s;
}
__device__ u64 block_sum_u64(u64 v, u64* sh) { return block_sum<u64>(v, sh); }

__device__ float block_max(float v, float* sh) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) sh[threadIdx.x >> 5] = v;
    __syncthreads();
    float m = NEG_INF;
    for (int w = 0; w < SAMPLE_WARPS; ++w) m = fmaxf(m, sh[w]);
    return m;
}

// The first index of the largest value (NaN never wins); `n` when nothing beats −∞.
__device__ unsigned block_argmax(const float* row, int n, float* shv, unsigned* shi) {
    float best = NEG_INF;
    unsigned at = n;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        const float v = row[i];
        if (v > best) best = v, at = i;
    }
    for (int o = 16; o > 0; o >>= 1) {
        const float bv = __shfl_xor_sync(0xffffffffu, best, o);
        const unsigned bi = __shfl_xor_sync(0xffffffffu, at, o);
        if (bv > best || (bv == best && bi < at)) best = bv, at = bi;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) shv[threadIdx.x >> 5] = best, shi[threadIdx.x >> 5] = at;
    __syncthreads();
    best = NEG_INF, at = n;
    for (int w = 0; w < SAMPLE_WARPS; ++w)
        if (shv[w] > best || (shv[w] == best && shi[w] < at)) best = shv[w], at = shi[w];
    return at;
}

// What the passes over a row need of it once its maximum and cuts are known.
struct Row {
    const float* x;  // the row after bias and penalties
    float inv_t, max_y, min_p;
    // top-k: key > k_key, or key == k_key and index ≤ k_last (k_last = n: every tie)
    unsigned k_key, k_last;
    bool top_k;
    // top-p: weight bits > p_bits, or == p_bits and index ≤ p_last
    unsigned p_bits, p_last;
    bool top_p;

    __device__ float y(int i) const { return x[i] * inv_t; }
    __device__ float w(int i) const { return weight_of(y(i) - max_y); }
    __device__ bool in_top_k(int i) const {
        const float v = y(i);
        if (isnan(v)) return false;
        if (!top_k) return true;
        const unsigned k = order_key(v);
        return k > k_key || (k == k_key && (unsigned)i <= k_last);
    }
    __device__ bool in_top_p(int i, float wi) const {
        if (!top_p) return true;
        const unsigned b = __float_as_uint(wi);
        return b > p_bits || (b == p_bits && (unsigned)i <= p_last);
    }
    // The draw's mass of entry i (0: not a candidate).
    __device__ u64 mass(int i) const {
        if (!in_top_k(i)) return 0;
        const float wi = w(i);
        if (!in_top_p(i, wi) || wi < min_p) return 0;
        return mass_of(wi);
    }
};

// The first index i whose inclusive prefix sum of q(0..=i), in index order, exceeds `r`
// (n − 1 when none does). Each warp sums a contiguous segment; one thread finds the
// segment, and its warp walks it 32 entries at a time.
template <class Q> __device__ unsigned walk(Q q, int n, u64 r, u64* sh, unsigned* found) {
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int seg = ((n + SAMPLE_WARPS - 1) / SAMPLE_WARPS + 31) & ~31;
    const int lo = warp * seg, hi = min(n, lo + seg);
    u64 s = 0;
    for (int i = lo + lane; i < hi; i += 32) s += q(i);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    __syncthreads();
    if (lane == 0) sh[warp] = s;
    __syncthreads();
    __shared__ int seg_of;
    __shared__ u64 rest;
    if (threadIdx.x == 0) {
        int w = 0;
        u64 left = r;
        while (w < SAMPLE_WARPS - 1 && left >= sh[w]) left -= sh[w], ++w;
        seg_of = w, rest = left;
        *found = n - 1;
    }
    __syncthreads();
    if (warp == seg_of) {
        u64 left = rest;
        const int wlo = seg_of * seg, whi = min(n, wlo + seg);
        for (int base = wlo; base < whi; base += 32) {
            const int i = base + lane;
            const u64 v = i < whi ? q(i) : 0;
            u64 incl = v;
            for (int o = 1; o < 32; o <<= 1) {
                const u64 up = __shfl_up_sync(0xffffffffu, incl, o);
                if (lane >= o) incl += up;
            }
            const unsigned over = __ballot_sync(0xffffffffu, incl > left);
            if (over) {
                if (lane == 0) *found = base + __ffs(over) - 1;
                break;
            }
            left -= __shfl_sync(0xffffffffu, incl, 31);
        }
    }
    __syncthreads();
    return *found;
}

// The radix select of one byte: among the entries whose selected bits so far equal the
// prefix, the byte (from the top) where the running total of `amount` from the largest
// down first reaches `need`. Returns the byte; `need` becomes what is still needed within
// it, `above` grows by the amount of the entries past it, `in_bin` is the bin's count.
template <class K, class A>
__device__ unsigned select_byte(K key, A amount, int n, unsigned prefix, unsigned mask,
                                int shift, u64& need, u64& above, unsigned& in_bin,
                                u64* mass_hist, unsigned* count_hist) {
    for (int b = threadIdx.x; b < 256; b += SAMPLE_THREADS) mass_hist[b] = 0, count_hist[b] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        unsigned k;
        if (!key(i, k) || (k & mask) != prefix) continue;
        const unsigned bin = (k >> shift) & 255u;
        const u64 a = amount(i);
        if (a) atomicAdd(&mass_hist[bin], a);
        atomicAdd(&count_hist[bin], 1u);
    }
    __syncthreads();
    __shared__ unsigned chosen;
    __shared__ u64 chosen_need, chosen_above;
    if (threadIdx.x == 0) {
        u64 left = need, past = 0;
        int b = 255;
        for (; b > 0; --b) {
            if (mass_hist[b] >= left) break;
            left -= mass_hist[b];
            past += mass_hist[b];
        }
        chosen = b, chosen_need = left, chosen_above = past;
    }
    __syncthreads();
    need = chosen_need;
    above += chosen_above;
    in_bin = count_hist[chosen];
    const unsigned b = chosen;
    __syncthreads();
    return b;
}

// Words of a row's log-probabilities (`logprobs`): the chosen token's (f32 bits), the ids of
// the LOGPROB_TOP best (NO_TOKEN past the last) and theirs.
#define LOGPROB_TOP 20
#define LOGPROB_WORDS (1 + 2 * LOGPROB_TOP)
#define NO_TOKEN 0xffffffffu

// x − m, with the entries equal to m at 0 (engine/logprobs.rs: rows whose largest entry
// is ±∞ stay defined).
__device__ __forceinline__ double shifted(float x, float m) {
    return x == m ? 0.0 : (double)x - (double)m;
}

// Whether (v, i) comes before (bv, bi) in the order of the best: larger value, then lower
// index; bi == NO_TOKEN is nothing yet.
__device__ __forceinline__ bool before(float v, unsigned i, float bv, unsigned bi) {
    return i != NO_TOKEN && (bi == NO_TOKEN || v > bv || (v == bv && i < bi));
}

// The log-probabilities of `token` and of the `top` best entries of the raw row `x`, in the
// CPU's arithmetic (engine/logprobs.rs): m the largest number, Σ e^{x − m} over the
// numbers in f64, NaN never among the best. The best come from `top` passes of a block
// argmax, each over the entries after the last one found in the order of the best: a
// few passes over a row the block has just read (the rows that ask pay them alone).
__device__ void row_logprobs(const float* x, int n, unsigned token, unsigned top,
                             unsigned* out, float* red_f, double* red_d, unsigned* red_i) {
    float m = NEG_INF;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) m = fmaxf(m, x[i]);
    m = block_max(m, red_f);
    double s = 0.0;
    for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
        const float v = x[i];
        if (!isnan(v)) s += exp(shifted(v, m));
    }
    const double log_sum = log(block_sum<double>(s, red_d));
    if (threadIdx.x == 0) out[0] = __float_as_uint((float)(shifted(x[token], m) - log_sum));
    float last_v = 0.f;
    unsigned last_i = NO_TOKEN;
    for (unsigned k = 0; k < LOGPROB_TOP; ++k) {
        float bv = NEG_INF;
        unsigned bi = NO_TOKEN;
        if (k < top)
            for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
                const float v = x[i];
                const bool after = last_i == NO_TOKEN || v < last_v ||
                                   (v == last_v && (unsigned)i > last_i);
                if (!isnan(v) && after && before(v, i, bv, bi)) bv = v, bi = i;
            }
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const unsigned oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (before(ov, oi, bv, bi)) bv = ov, bi = oi;
        }
        __syncthreads();
        if ((threadIdx.x & 31) == 0) red_f[threadIdx.x >> 5] = bv, red_i[threadIdx.x >> 5] = bi;
        __syncthreads();
        bv = NEG_INF, bi = NO_TOKEN;
        for (int w = 0; w < SAMPLE_WARPS; ++w)
            if (before(red_f[w], red_i[w], bv, bi)) bv = red_f[w], bi = red_i[w];
        if (threadIdx.x == 0) {
            out[1 + k] = bi;
            out[1 + LOGPROB_TOP + k] =
                bi == NO_TOKEN ? 0u : __float_as_uint((float)(shifted(bv, m) - log_sum));
        }
        last_v = bv, last_i = bi;
        if (bi == NO_TOKEN) {
            // (nothing left: the rest of the list is empty too)
            if (threadIdx.x == 0)
                for (unsigned j = k + 1; j < LOGPROB_TOP; ++j) out[1 + j] = NO_TOKEN;
            break;
        }
    }
}

// One block per row. `row_opts[r]` says how row r of `logits` (stride `ld`, the first
// `vocab` entries are tokens) is sampled; its token lands in `ids[r]`, and its slot's
// count words (`counts`, `vocab` per slot) and draw counter (`draws`) record it. `scratch`
// (a row of `ld` per batch row) holds the row after bias and penalties when it has any.
// With `check_finite`, a row holding NaN or ±∞ is not sampled: id 0, `finite[r]` 0 (the
// engine fails its sequence, as on the CPU); without, such rows are sampled (NaN never
// chosen). A row whose options ask for log-probabilities gets them, of its raw logits, in
// its LOGPROB_WORDS words of `logprobs`.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS)
    sample_rows(const float* __restrict__ logits, int ld, int vocab,
                const RowOptions* __restrict__ row_opts, const uint2* __restrict__ bias,
                unsigned* __restrict__ counts, u64* __restrict__ draws,
                float* __restrict__ scratch, unsigned* __restrict__ ids,
                unsigned* __restrict__ finite, int check_finite,
                unsigned* __restrict__ logprobs) {
    __shared__ u64 mass_hist[256];
    __shared__ unsigned count_hist[256];
    __shared__ u64 red_u64[SAMPLE_WARPS];
    __shared__ float red_f[SAMPLE_WARPS];
    __shared__ unsigned red_i[SAMPLE_WARPS];
    __shared__ double red_d[SAMPLE_WARPS];
    __shared__ unsigned found;
    const int r = blockIdx.x, n = vocab;
    const RowOptions o = row_opts[r];
    unsigned* seen = counts + (size_t)o.slot * vocab;
    const float* raw = logits + (size_t)r * ld;
    const float* x = raw;
    if (check_finite) {
        int bad = 0;
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS)
            bad |= (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u;
        if (__syncthreads_or(bad)) {
            if (threadIdx.x == 0) ids[r] = 0, finite[r] = 0;
            return;  // (the whole block: the condition is the block's)
        }
    }

    // Bias, then the penalties, into the scratch row (only for a row that has any).
    const bool penalised = o.repetition_penalty != 1.f || o.frequency_penalty != 0.f ||
                           o.presence_penalty != 0.f;
    if (o.bias_len > 0 || penalised) {
        float* y = scratch + (size_t)r * ld;
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) y[i] = x[i];
        __syncthreads();
        // In list order, one thread: a token listed twice gets both, as on the CPU.
        if (threadIdx.x == 0)
            for (unsigned j = 0; j < o.bias_len; ++j) {
                const uint2 e = bias[o.bias_start + j];
                if ((int)e.x < n) y[e.x] += __uint_as_float(e.y);
            }
        __syncthreads();
        if (penalised)
            for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
                const unsigned c = seen[i];
                if (c == 0) continue;
                float v = y[i];
                if ((c & SEEN_BIT) && o.repetition_penalty != 1.f)
                    v = v > 0.f ? v / o.repetition_penalty : v * o.repetition_penalty;
                const unsigned times = c & ~SEEN_BIT;
                if (times > 0) v -= (float)times * o.frequency_penalty + o.presence_penalty;
                y[i] = v;
            }
        __syncthreads();
        x = y;
    }

    unsigned token;
    if (o.temperature < 1e-5f) {
        token = block_argmax(x, n, red_f, red_i);
        if (token >= (unsigned)n) token = 0;
    } else {
        // The largest scaled logit (NaN skipped: fmaxf), and whether any entry is a number.
        float m = NEG_INF;
        unsigned numbers = 0;
        for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) {
            const float v = x[i];
            m = fmaxf(m, v);
            numbers += !isnan(v);
        }
        m = block_max(m, red_f);
        const u64 any = block_sum_u64(numbers, red_u64);
        Row row;
        row.x = x;
        row.inv_t = 1.f / o.temperature;
        row.max_y = m * row.inv_t;  // (x ↦ x · inv_t is monotonic: the max of the products)
        row.min_p = o.min_p > 0.f ? o.min_p : -1.f;
        row.top_k = false, row.top_p = false;
        row.k_key = 0, row.k_last = n, row.p_bits = 0, row.p_last = n;
        if (any == 0) {
            token = 0;  // every entry is NaN
        } else {
            // Top-k: the k-th largest key, and which of its ties (lowest indices) are in.
            if (o.top_k > 0 && (u64)o.top_k < any) {
                u64 need = o.top_k, above = 0;
                unsigned prefix = 0, mask = 0, in_bin = 0;
                auto key = [&](int i, unsigned& k) {
                    const float v = row.y(i);
                    k = order_key(v);
                    return !isnan(v);
                };
                auto one = [](int) -> u64 { return 1; };
                for (int shift = 24; shift >= 0; shift -= 8) {
                    const unsigned b = select_byte(key, one, n, prefix, mask, shift, need, above,
                                                   in_bin, mass_hist, count_hist);
                    prefix |= b << shift;
                    mask |= 255u << shift;
                }
                row.top_k = true;
                row.k_key = prefix;
                if (need < in_bin) {
                    auto tie = [&](int i) -> u64 {
                        const float v = row.y(i);
                        return !isnan(v) && order_key(v) == prefix ? 1 : 0;
                    };
                    row.k_last = walk(tie, n, need - 1, red_u64, &found);
                }
            }
            // Top-p: the weight where the mass from the largest down reaches top_p of the
            // candidates' total; its ties in index order up to the one that reaches it.
            if (o.top_p < 1.f) {
                u64 total = 0;
                for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS)
                    if (row.in_top_k(i)) total += mass_of(row.w(i));
                total = block_sum_u64(total, red_u64);
                const u64 target = (u64)ceil((double)o.top_p * (double)total);
                if (target > 0) {
                    u64 need = target, above = 0;
                    unsigned prefix = 0, mask = 0, in_bin = 0;
                    auto key = [&](int i, unsigned& k) {
                        if (!row.in_top_k(i)) return false;
                        k = __float_as_uint(row.w(i));
                        return true;
                    };
                    auto amount = [&](int i) -> u64 { return mass_of(row.w(i)); };
                    for (int shift = 24; shift >= 0; shift -= 8) {
                        const unsigned b = select_byte(key, amount, n, prefix, mask, shift,
                                                       need, above, in_bin, mass_hist,
                                                       count_hist);
                        prefix |= b << shift;
                        mask |= 255u << shift;
                    }
                    row.top_p = true;
                    row.p_bits = prefix;
                    const u64 each = mass_of(__uint_as_float(prefix));
                    const u64 ties = each > 0 ? (need + each - 1) / each : in_bin;
                    if (ties < in_bin) {
                        auto tie = [&](int i) -> u64 {
                            return row.in_top_k(i) && __float_as_uint(row.w(i)) == prefix ? 1 : 0;
                        };
                        row.p_last = walk(tie, n, ties - 1, red_u64, &found);
                    }
                }
            }
            // The draw over what is left, in index order.
            u64 total = 0;
            for (int i = threadIdx.x; i < n; i += SAMPLE_THREADS) total += row.mass(i);
            total = block_sum_u64(total, red_u64);
            if (total == 0) {
                // (every weight underflowed: only a row of −∞ gets here) the first maximum
                token = block_argmax(x, n, red_f, red_i);
                if (token >= (unsigned)n) token = 0;
            } else {
                const u64 seed = ((u64)o.seed_hi << 32) | o.seed_lo;
                const u64 u = random_at(seed, draws[o.slot]);
                const u64 at = __umul64hi(u, total);  // uniform in [0, total)
                auto mass = [&](int i) -> u64 { return row.mass(i); };
                token = walk(mass, n, at, red_u64, &found);
            }
        }
    }
    if (o.logprobs > 0)
        row_logprobs(raw, n, token, o.logprobs - 1, logprobs + (size_t)r * LOGPROB_WORDS, red_f,
                     red_d, red_i);
    __syncthreads();
    if (threadIdx.x == 0) {
        ids[r] = token;
        finite[r] = 1;
        const unsigned c = seen[token];
        seen[token] = ((c & ~SEEN_BIT) + 1) | SEEN_BIT;
        draws[o.slot] += 1;  // (every step, greedy or not: the host's mirror counts alike)
    }
}
