// The convolution layer's kernels (see unfolded.rs, whose `host` module is their reference,
// index for index). x [n, c, h, w]; cols [n·oh·ow, c·k·k] (a window per row); z [n·oh·ow, o]
// (cols · weightᵀ); y [n, o, oh', ow'] (oh' = oh / 2 when pooled, else oh; ow' alike).
// `load` and `store` (from ELEMENTS) read and write f32 or bf16 values as f32. A launch holds
// at most 2³² threads (cuda.rs), so a thread's own index and what is divided out of it
// fit 32 bits (64-bit division is many instructions on a GPU); addresses are 64-bit.

// The four values of z's 2×2 window, each plus the bias: the largest, and the place (0-3,
// row-major) of the first value equal to it (a NaN loses to any number).
__device__ __forceinline__ float window_max(const float v[4], unsigned int* first) {
    float m = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    *first = v[0] != m ? (v[1] != m ? (v[2] != m ? 3u : 2u) : 1u) : 0u;
    return m;
}

#define CONV(NAME, T) \
extern "C" __global__ void ddpjob_unfold_##NAME(const T* x, T* cols, unsigned long long total, \
        unsigned int c, unsigned int h, unsigned int w, unsigned int k, unsigned int stride, \
        unsigned int pad, unsigned int oh, unsigned int ow) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int j = (unsigned int)i, ckk = c * k * k, row = j / ckk, col = j % ckk; \
    unsigned int kx = col % k, ky = col / k % k, ci = col / (k * k); \
    unsigned int ox = row % ow, oy = row / ow % oh, s = row / ow / oh; \
    long long iy = (long long)oy * stride + ky - pad, ix = (long long)ox * stride + kx - pad; \
    cols[i] = iy >= 0 && iy < h && ix >= 0 && ix < w \
        ? x[(((unsigned long long)s * c + ci) * h + (unsigned long long)iy) * w \
            + (unsigned long long)ix] \
        : (T)0; \
} \
extern "C" __global__ void ddpjob_fold_##NAME(const T* cols, T* x, unsigned long long total, \
        unsigned int c, unsigned int h, unsigned int w, unsigned int k, unsigned int stride, \
        unsigned int pad, unsigned int oh, unsigned int ow) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int j = (unsigned int)i, ix = j % w, iy = j / w % h, ci = j / w / h % c; \
    unsigned int s = j / w / h / c, ckk = c * k * k; \
    float sum = 0.0f; \
    for (unsigned int ky = 0; ky < k; ++ky) { \
        long long ty = (long long)iy + pad - ky; \
        if (ty < 0 || ty % stride != 0 || ty / stride >= oh) continue; \
        unsigned long long oy = (unsigned long long)(ty / stride); \
        for (unsigned int kx = 0; kx < k; ++kx) { \
            long long tx = (long long)ix + pad - kx; \
            if (tx < 0 || tx % stride != 0 || tx / stride >= ow) continue; \
            unsigned long long ox = (unsigned long long)(tx / stride); \
            sum += load(cols, (((unsigned long long)s * oh + oy) * ow + ox) * ckk \
                + (ci * k + ky) * k + kx); \
        } \
    } \
    store(x, i, sum); \
} \
extern "C" __global__ void ddpjob_conv_finish_##NAME(const T* z, const T* b, T* y, \
        unsigned long long total, unsigned int o, unsigned int oh, unsigned int ow, \
        unsigned int pooled, unsigned int relu) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int ph = pooled ? oh / 2 : oh, pw = pooled ? ow / 2 : ow, j = (unsigned int)i; \
    unsigned int px = j % pw, py = j / pw % ph, oc = j / pw / ph % o, s = j / pw / ph / o; \
    float bias = load(b, oc), v; \
    if (pooled) { \
        unsigned long long r = ((unsigned long long)s * oh + 2 * py) * ow + 2 * px; \
        float win[4] = {load(z, r * o + oc) + bias, load(z, (r + 1) * o + oc) + bias, \
                        load(z, (r + ow) * o + oc) + bias, load(z, (r + ow + 1) * o + oc) + bias}; \
        unsigned int first; \
        v = window_max(win, &first); \
    } else { \
        v = load(z, (((unsigned long long)s * oh + py) * ow + px) * o + oc) + bias; \
    } \
    store(y, i, relu && v < 0.0f ? 0.0f : v); \
} \
extern "C" __global__ void ddpjob_conv_finish_grad_##NAME(const T* z, const T* b, const T* g, \
        T* gz, unsigned long long total, unsigned int o, unsigned int oh, unsigned int ow, \
        unsigned int pooled, unsigned int relu) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int j = (unsigned int)i, oc = j % o, row = j / o; \
    unsigned int ox = row % ow, oy = row / ow % oh, s = row / ow / oh; \
    float bias = load(b, oc), out = 0.0f; \
    if (!pooled) { \
        float v = load(z, i) + bias; \
        if (!relu || v > 0.0f) \
            out = load(g, (((unsigned long long)s * o + oc) * oh + oy) * ow + ox); \
    } else if (oy / 2 < oh / 2 && ox / 2 < ow / 2) { \
        unsigned int py = oy / 2, px = ox / 2, ph = oh / 2, pw = ow / 2; \
        unsigned long long r = ((unsigned long long)s * oh + 2 * py) * ow + 2 * px; \
        float win[4] = {load(z, r * o + oc) + bias, load(z, (r + 1) * o + oc) + bias, \
                        load(z, (r + ow) * o + oc) + bias, load(z, (r + ow + 1) * o + oc) + bias}; \
        unsigned int first; \
        float m = window_max(win, &first); \
        unsigned int mine = (oy - 2 * py) * 2 + (ox - 2 * px); \
        if (first == mine && (!relu || m > 0.0f)) \
            out = load(g, (((unsigned long long)s * o + oc) * ph + py) * pw + px); \
    } \
    store(gz, i, out); \
}
CONV(f32, float)
CONV(bf16, unsigned short)
