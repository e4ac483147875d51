// The convolution layer's kernels (see conv_gpu.rs, whose `host` module is their reference,
// index for index). x [n, c, h, w]; cols [n·oh·ow, c·k·k] (a window per row); z [n·oh·ow, o]
// (cols · weightᵀ); y [n, o, oh', ow'] (oh' = oh / 2 when pooled, else oh; ow' alike).
// `load` and `store` (from ELEMENTS) read and write f32 or bf16 values as f32.

// The four values of z's 2×2 window at (s, oc, py, px), each plus the bias; the largest, and
// the place (0-3, row-major) of the first value equal to it (a NaN loses to any number).
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
    unsigned long long ckk = (unsigned long long)c * k * k, row = i / ckk; \
    unsigned int col = (unsigned int)(i % ckk); \
    unsigned int kx = col % k, ky = col / k % k, ci = col / (k * k); \
    unsigned int ox = (unsigned int)(row % ow), oy = (unsigned int)(row / ow % oh); \
    unsigned long long s = row / ow / oh; \
    long long iy = (long long)oy * stride + ky - pad, ix = (long long)ox * stride + kx - pad; \
    cols[i] = iy >= 0 && iy < h && ix >= 0 && ix < w \
        ? x[((s * c + ci) * h + (unsigned long long)iy) * w + (unsigned long long)ix] : (T)0; \
} \
extern "C" __global__ void ddpjob_fold_##NAME(const T* cols, T* x, unsigned long long total, \
        unsigned int c, unsigned int h, unsigned int w, unsigned int k, unsigned int stride, \
        unsigned int pad, unsigned int oh, unsigned int ow) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int ix = (unsigned int)(i % w), iy = (unsigned int)(i / w % h); \
    unsigned int ci = (unsigned int)(i / w / h % c); \
    unsigned long long s = i / w / h / c, ckk = (unsigned long long)c * k * k; \
    float sum = 0.0f; \
    for (unsigned int ky = 0; ky < k; ++ky) { \
        long long ty = (long long)iy + pad - ky; \
        if (ty < 0 || ty % stride != 0 || ty / stride >= oh) continue; \
        unsigned long long oy = (unsigned long long)(ty / stride); \
        for (unsigned int kx = 0; kx < k; ++kx) { \
            long long tx = (long long)ix + pad - kx; \
            if (tx < 0 || tx % stride != 0 || tx / stride >= ow) continue; \
            unsigned long long ox = (unsigned long long)(tx / stride); \
            sum += load(cols, ((s * oh + oy) * ow + ox) * ckk + (ci * k + ky) * k + kx); \
        } \
    } \
    store(x, i, sum); \
} \
extern "C" __global__ void ddpjob_conv_finish_##NAME(const T* z, const T* b, T* y, \
        unsigned long long total, unsigned int o, unsigned int oh, unsigned int ow, \
        unsigned int pooled, unsigned int relu) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int ph = pooled ? oh / 2 : oh, pw = pooled ? ow / 2 : ow; \
    unsigned int px = (unsigned int)(i % pw), py = (unsigned int)(i / pw % ph); \
    unsigned int oc = (unsigned int)(i / pw / ph % o); \
    unsigned long long s = i / pw / ph / o; \
    float bias = load(b, oc), v; \
    if (pooled) { \
        unsigned long long r = (s * oh + 2 * py) * ow + 2 * px; \
        float win[4] = {load(z, r * o + oc) + bias, load(z, (r + 1) * o + oc) + bias, \
                        load(z, (r + ow) * o + oc) + bias, load(z, (r + ow + 1) * o + oc) + bias}; \
        unsigned int first; \
        v = window_max(win, &first); \
    } else { \
        v = load(z, ((s * oh + py) * ow + px) * o + oc) + bias; \
    } \
    store(y, i, relu && v < 0.0f ? 0.0f : v); \
} \
extern "C" __global__ void ddpjob_conv_finish_grad_##NAME(const T* z, const T* b, const T* g, \
        T* gz, unsigned long long total, unsigned int o, unsigned int oh, unsigned int ow, \
        unsigned int pooled, unsigned int relu) { \
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; \
    if (i >= total) return; \
    unsigned int oc = (unsigned int)(i % o); \
    unsigned long long row = i / o; \
    unsigned int ox = (unsigned int)(row % ow), oy = (unsigned int)(row / ow % oh); \
    unsigned long long s = row / ow / oh; \
    float bias = load(b, oc), out = 0.0f; \
    if (!pooled) { \
        float v = load(z, i) + bias; \
        if (!relu || v > 0.0f) out = load(g, ((s * o + oc) * oh + oy) * ow + ox); \
    } else if (oy / 2 < oh / 2 && ox / 2 < ow / 2) { \
        unsigned int py = oy / 2, px = ox / 2, ph = oh / 2, pw = ow / 2; \
        unsigned long long r = (s * oh + 2 * py) * ow + 2 * px; \
        float win[4] = {load(z, r * o + oc) + bias, load(z, (r + 1) * o + oc) + bias, \
                        load(z, (r + ow) * o + oc) + bias, load(z, (r + ow + 1) * o + oc) + bias}; \
        unsigned int first; \
        float m = window_max(win, &first); \
        unsigned int mine = (oy - 2 * py) * 2 + (ox - 2 * px); \
        if (first == mine && (!relu || m > 0.0f)) out = load(g, ((s * o + oc) * ph + py) * pw + px); \
    } \
    store(gz, i, out); \
}
CONV(f32, float)
CONV(bf16, unsigned short)
