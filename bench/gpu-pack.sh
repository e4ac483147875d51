#!/usr/bin/env bash
# Packs what bench/gpu-check.sh needs on a GPU machine into target/gpu-carry/ (about 62 MB, under
# the device tool's 64 MiB carry limit): the CUDA binary from ../shared/gpu/build-cuda.sh
# (xz-compressed: 59 MB -> 9 MB), the unit tests of the crates with GPU tests built for CUDA
# (its `kernels` step runs their GPU tests; KERNEL_TESTS=0 leaves them out), run-gpu.sh, Fashion-MNIST's
# four .gz files, the tiny Shakespeare text and the two PyTorch reference scripts.
#
#   bash ../shared/gpu/build-cuda.sh && bench/gpu-pack.sh
#   then, with the device tool: carry ["target/gpu-carry"], one call of "bench/gpu-check.sh"
#   (every step: about 3 minutes on an H200)
set -euo pipefail
cd "$(dirname "$0")/.."
dist=${DIST:-target/gpu-dist}
data=${DATA:-/usr/share/datasets/fashion-mnist}
text=${TEXT:-../shared/data/tinyshakespeare/input.txt}
refs=${REFS:-../shared/bench}
[ -x "$dist/ddpjob" ] || { echo "no $dist/ddpjob: run bash ../shared/gpu/build-cuda.sh first" >&2; exit 2; }
[ -f "$data/train-images-idx3-ubyte.gz" ] || { echo "no Fashion-MNIST in $data: apt-get install dataset-fashion-mnist" >&2; exit 2; }
carry=target/gpu-carry
rm -rf "$carry"
mkdir -p "$carry/fashion-mnist" "$carry/ref"
xz -T2 -6 -c "$dist/ddpjob" > "$carry/ddpjob.xz"
cp "$dist/run-gpu.sh" "$carry/"
cp "$data"/*-ubyte.gz "$carry/fashion-mnist/"
cp "$text" "$carry/input.txt"
cp "$refs/torch_ref.py" "$refs/gpt_ref.py" "$carry/ref/"
if [ "${KERNEL_TESTS:-1}" != 0 ]; then
  # The same toolchain and target folder as build-cuda.sh; cargo names the test executable.
  venv=${VENV:-$HOME/.cache/ddpjob-cuda-venv}
  cu13=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cu13
  # Every crate whose unit tests hold GPU tests (`the_gpu_*`): the kernels', the model
  # families' and the trainer's (the root has none); one executable each,
  # `ddpjob-tests-<crate>.xz`.
  PATH=$cu13/bin:$PATH CUDA_HOME=$cu13 CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90} \
      CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-target/cuda} \
      cargo test --release --features cuda -p ddpjob-kernels -p ddpjob-models -p ddpjob-train --lib \
        --no-run --message-format=json |
    python3 -c 'import json, sys
for m in map(json.loads, sys.stdin):
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["lib"]:
        print(m["target"]["name"], m["executable"])' |
    while read -r name exe; do
      strip -o "$carry/ddpjob-tests-$name" "$exe"
      xz -T2 -6 "$carry/ddpjob-tests-$name"
    done
fi
du -sh "$carry"
