//! CUDA source that more than one kernel starts with, and (in tests) a way to run a kernel's
//! source on the host: a GPU is lent to this project only now and then, so a kernel made of
//! plain index arithmetic is checked against its host reference on every `cargo test`, not
//! only when one is.

/// f32 and bf16 values read as f32 and written back from it, for kernels over both: bf16 is
/// handled as its bits (no `cuda_bf16.h`: NVRTC would need the toolkit's headers on the GPU
/// machine); the store rounds to nearest even as the `half` crate does.
#[cfg(any(feature = "cuda", test))]
pub const ELEMENTS: &str = r#"
__device__ __forceinline__ float load(const float* p, unsigned long long i) { return p[i]; }
__device__ __forceinline__ float load(const unsigned short* p, unsigned long long i) {
    return __uint_as_float(((unsigned int)p[i]) << 16);
}
__device__ __forceinline__ void store(float* p, unsigned long long i, float v) { p[i] = v; }
__device__ __forceinline__ void store(unsigned short* p, unsigned long long i, float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = (unsigned short)((u >> 16) | 0x40u); return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (unsigned short)(u >> 16);
}
"#;

/// Kernel source compiled by the host's C++ compiler and run one thread after another
/// ([`host::HostKernel::compile`]: for kernels whose threads do not talk to each other), or a
/// block's threads side by side ([`host::HostKernel::compile_block`]: shared memory and
/// `__syncthreads`, no warp shuffles); the compiler is told not to fuse multiply-adds, as the
/// kernels that must round like the host are compiled by NVRTC.
#[cfg(test)]
pub mod host {
    use std::path::{Path, PathBuf};
    use std::process::Command;

    /// What CUDA's built-ins become on the host.
    const SHIM: &str = r#"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <string>
#include <vector>
#define __global__
#define __device__
#define __forceinline__ inline
struct Dim3 { unsigned int x, y, z; };
static inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
static inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
"#;

    /// Threads run one after another.
    const SEQUENTIAL: &str = r#"
static Dim3 blockIdx, threadIdx, blockDim, gridDim;
#define LAUNCH(CALL) \
    for (unsigned int block_ = 0; block_ < gridDim.x; ++block_) \
        for (unsigned int thread_ = 0; thread_ < blockDim.x; ++thread_) { \
            blockIdx.x = block_; threadIdx.x = thread_; CALL; \
        }
"#;

    /// A block's threads run side by side (one block after another): `__shared__` memory is a
    /// function's static and `__syncthreads` a barrier of the block's threads. (No warp
    /// shuffles: a kernel that uses them does not compile here.)
    const BLOCKS: &str = r#"
#include <barrier>
#include <thread>
#define __shared__ static
static Dim3 blockIdx, blockDim, gridDim;
static thread_local Dim3 threadIdx;
static std::barrier<>* block_barrier_;
static inline void __syncthreads() { block_barrier_->arrive_and_wait(); }
#define LAUNCH(CALL) \
    for (unsigned int block_ = 0; block_ < gridDim.x; ++block_) { \
        blockIdx.x = block_; \
        std::barrier<> block(blockDim.x); \
        block_barrier_ = &block; \
        std::vector<std::thread> threads_; \
        for (unsigned int thread_ = 0; thread_ < blockDim.x; ++thread_) \
            threads_.emplace_back([&, thread_] { threadIdx.x = thread_; CALL; }); \
        for (auto& t : threads_) t.join(); \
    }
"#;

    const MAIN: &str = r#"
template <typename T> static std::vector<T> read_all(const std::string& path) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) { perror(path.c_str()); exit(2); }
    fseek(f, 0, SEEK_END); long bytes = ftell(f); fseek(f, 0, SEEK_SET);
    std::vector<T> v(bytes / sizeof(T));
    if (!v.empty() && fread(v.data(), sizeof(T), v.size(), f) != v.size()) { perror(path.c_str()); exit(2); }
    fclose(f);
    return v;
}
template <typename T> static void write_all(const std::string& path, const std::vector<T>& v) {
    FILE* f = fopen(path.c_str(), "wb");
    if (!f || (!v.empty() && fwrite(v.data(), sizeof(T), v.size(), f) != v.size())) { perror(path.c_str()); exit(2); }
    fclose(f);
}
int main(int argc, char** argv) {
    std::string dir = argv[1];
    unsigned long long threads = strtoull(argv[2], 0, 10);
    std::vector<unsigned long long> scalars;
    for (int i = 3; i < argc; ++i) scalars.push_back(strtoull(argv[i], 0, 10));
#define A(i) scalars.at(i)
    DECLARE
    blockDim.x = 256; blockDim.y = blockDim.z = 1;
    gridDim.x = (unsigned int)((threads + 255) / 256); gridDim.y = gridDim.z = 1;
    LAUNCH(CALL);
    WRITE
    return 0;
}
"#;

    /// A buffer a kernel reads or writes: f32 values, bf16 values as their bits, or u32s.
    #[derive(Debug, Clone, PartialEq)]
    pub enum Buffer {
        F32(Vec<f32>),
        Bf16(Vec<u16>),
        U32(Vec<u32>),
    }

    impl Buffer {
        /// The values' bits, to compare results bit for bit.
        pub fn bits(&self) -> Vec<u32> {
            match self {
                Buffer::F32(v) => v.iter().map(|x| x.to_bits()).collect(),
                Buffer::Bf16(v) => v.iter().map(|&x| u32::from(x)).collect(),
                Buffer::U32(v) => v.clone(),
            }
        }

        fn bytes(&self) -> Vec<u8> {
            match self {
                Buffer::F32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::Bf16(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                Buffer::U32(v) => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            }
        }

        fn refill(&mut self, bytes: &[u8]) {
            match self {
                Buffer::F32(v) => *v = words(bytes).map(f32::from_bits).collect(),
                Buffer::Bf16(v) => {
                    *v = bytes
                        .chunks_exact(2)
                        .map(|b| u16::from_le_bytes(b.try_into().expect("2 bytes")))
                        .collect()
                }
                Buffer::U32(v) => *v = words(bytes).collect(),
            }
        }

        fn c_type(&self) -> &'static str {
            match self {
                Buffer::F32(_) => "float",
                Buffer::Bf16(_) => "unsigned short",
                Buffer::U32(_) => "unsigned int",
            }
        }
    }

    /// Little-endian 32-bit words of `bytes` (f32 values as their bits, or u32s).
    fn words(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
        bytes
            .chunks_exact(4)
            .map(|b| u32::from_le_bytes(b.try_into().expect("4 bytes")))
    }

    /// One kernel call, compiled: `call` (C++, e.g. `ddpjob_k_f32(x, y, A(0))`) names the
    /// buffers by the names given and the run's scalars as `A(i)`.
    pub struct HostKernel {
        dir: tempfile::TempDir,
        exe: PathBuf,
        names: Vec<String>,
    }

    impl HostKernel {
        /// Compiles `source` with a harness for `call` over buffers of these names and kinds,
        /// its threads run one after another; `None` (after saying so) where the machine has
        /// no C++ compiler.
        pub fn compile(source: &[&str], call: &str, buffers: &[(&str, &Buffer)]) -> Option<Self> {
            Self::build(source, call, buffers, false)
        }

        /// [`HostKernel::compile`] for a kernel whose threads share memory and wait at
        /// `__syncthreads`: a block's 256 threads run side by side.
        pub fn compile_block(
            source: &[&str],
            call: &str,
            buffers: &[(&str, &Buffer)],
        ) -> Option<Self> {
            Self::build(source, call, buffers, true)
        }

        fn build(
            source: &[&str],
            call: &str,
            buffers: &[(&str, &Buffer)],
            blocks: bool,
        ) -> Option<Self> {
            let compiler = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
            // `CXX` may carry arguments (`ccache g++`).
            let words: Vec<&str> = compiler.split_whitespace().collect();
            let cxx = || {
                let mut command = Command::new(words.first().copied().unwrap_or("c++"));
                command.args(words.iter().skip(1));
                command
            };
            if cxx().arg("--version").output().is_err() {
                eprintln!(
                    "skipping: no C++ compiler `{compiler}` to run the kernels' source on the host (install g++)"
                );
                return None;
            }
            let dir = tempfile::tempdir().expect("a temporary directory");
            let declare: String = buffers
                .iter()
                .map(|(name, b)| {
                    let t = b.c_type();
                    format!(
                        "std::vector<{t}> buf_{name} = read_all<{t}>(dir + \"/{name}\"); {t}* {name} = buf_{name}.data();\n"
                    )
                })
                .collect();
            let write: String = buffers
                .iter()
                .map(|(name, _)| format!("write_all(dir + \"/{name}\", buf_{name});\n"))
                .collect();
            let main = MAIN
                .replace("DECLARE", &declare)
                .replace("CALL", call)
                .replace("WRITE", &write);
            let launch = if blocks { BLOCKS } else { SEQUENTIAL };
            let program = [SHIM, launch, &source.concat(), &main].concat();
            let (cpp, exe) = (dir.path().join("kernel.cpp"), dir.path().join("kernel"));
            std::fs::write(&cpp, program).expect("write the kernel's program");
            // Warnings are errors, and the sanitizers stop the run at any read or write outside
            // a buffer and at undefined arithmetic.
            let built = cxx()
                .args(["-std=c++20", "-pthread", "-O1", "-ffp-contract=off"])
                .args(["-Wall", "-Wextra", "-Werror"])
                .args([
                    "-fsanitize=address,undefined",
                    "-fno-sanitize-recover=all",
                    "-o",
                ])
                .arg(&exe)
                .arg(&cpp)
                .output()
                .expect("run the C++ compiler");
            assert!(
                built.status.success(),
                "the kernel's source does not compile on the host:\n{}",
                String::from_utf8_lossy(&built.stderr)
            );
            let names = buffers.iter().map(|(n, _)| n.to_string()).collect();
            Some(HostKernel { dir, exe, names })
        }

        /// Runs `threads` threads in blocks of 256 (for a kernel of `compile`, whose threads
        /// do not depend on each other, the block size is immaterial) over `buffers`, in the
        /// order given at compilation, which hold the kernel's results afterwards.
        pub fn run(&self, threads: u64, scalars: &[u64], buffers: &mut [&mut Buffer]) {
            assert_eq!(buffers.len(), self.names.len(), "one buffer per name");
            let at = |name: &str| -> PathBuf { Path::new(self.dir.path()).join(name) };
            for (name, b) in self.names.iter().zip(buffers.iter()) {
                std::fs::write(at(name), b.bytes()).expect("write a buffer");
            }
            let ran = Command::new(&self.exe)
                .arg(self.dir.path())
                .arg(threads.to_string())
                .args(scalars.iter().map(u64::to_string))
                .output()
                .expect("run the kernel's program");
            assert!(
                ran.status.success(),
                "the kernel failed on the host ({}): {}",
                ran.status,
                String::from_utf8_lossy(&ran.stderr)
            );
            for (name, b) in self.names.iter().zip(buffers.iter_mut()) {
                b.refill(&std::fs::read(at(name)).expect("read a buffer back"));
            }
        }
    }
}
