#!/bin/bash
# Issue 42, part 3 (2026-12-05): which UCX transports NIXL selects between two processes on one GPU,
# and what each UCX setting moves, next to a device-to-device copy of the same size on that GPU.
# Run on the lent machine from the repository root, with nixl + nixl-cu13 on PYTHONPATH:
#   bash docs/gpu-verification/2026-12-05-ucx-diag.sh OUTDIR
# Each probe: python -m pd_sessions.vllm_side.link_probe (a NIXL agent pair over UCX, the decode's
# READ of 32 MiB of VRAM in N descriptors, 2 warm-ups, 10 timed), with UCX_LOG_LEVEL=info and
# UCX_PROTO_INFO=y so that UCX itself prints the lanes and protocols it chose.
set -u
out=${1:?OUTDIR}
mkdir -p "$out/logs"
BYTES=33554432
facts() {
  echo "## machine"; nvidia-smi -L; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  echo "## nvlink"; nvidia-smi nvlink -s 2>&1 | head -20; echo "## topo"; nvidia-smi topo -m 2>&1 | head -20
  echo "## interfaces"; ls /sys/class/net; ls /sys/class/infiniband 2>&1
  echo "## ucx_info"; command -v ucx_info || echo "no ucx_info on PATH"
  ${PY:-python3} - <<'PY'
import ctypes, glob, importlib.util, os
name = next(n for n in ("nixl_cu13", "nixl_cu12") if importlib.util.find_spec(n))
libs = os.path.join(os.path.dirname(importlib.util.find_spec(name).origin), "..", name + ".libs")
ucp = glob.glob(os.path.join(libs, "libucp-*.so*"))[0]
lib = ctypes.CDLL(ucp)
lib.ucp_get_version_string.restype = ctypes.c_char_p
print(f"UCX (bundled with {name}):", lib.ucp_get_version_string().decode(), os.path.basename(ucp))
print("UCX modules:", sorted(os.path.basename(p) for p in glob.glob(os.path.join(libs, "ucx", "*.so*"))))
import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))
PY
}
probe() {  # name descriptors env...
  local name=$1 descs=$2; shift 2
  local log="$out/logs/$name-d$descs.log"
  echo "## $name d=$descs env: $*" > "$log"
  env "$@" UCX_LOG_LEVEL=${UCX_LOG_LEVEL_OVERRIDE:-info} UCX_PROTO_INFO=${UCX_PROTO_INFO_OVERRIDE:-y} timeout 90 \
    ${PY:-python3} -m pd_sessions.vllm_side.link_probe --transport nixl --device ${DEVICE:-cuda} --bytes $BYTES \
    --descriptors "$descs" --repeats 10 --out "$out/logs/$name-d$descs.json" >> "$log" 2>&1
  local rc=$?
  local line; line=$(grep -h "link_probe:" "$log" | tail -1)
  printf '%-28s d=%-5s rc=%-3s %s\n' "$name" "$descs" "$rc" "${line#*: }" | tee -a "$out/summary.txt"
}
facts > "$out/facts.txt" 2>&1; cat "$out/facts.txt"
: > "$out/summary.txt"
ipc_get=UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y
probe default            2048 PD_X=1
probe default            1    PD_X=1
probe tls-ipc-copy-sm-tcp 2048 UCX_TLS=cuda_ipc,cuda_copy,sm,tcp
probe tls-not-tcp         2048 UCX_TLS=^tcp
probe tls-ipc-copy-tcp    2048 UCX_TLS=cuda_ipc,cuda_copy,tcp
probe ipc-get             2048 $ipc_get
probe ipc-get             1    $ipc_get
probe ipc-get-tls-ipc-sm  2048 $ipc_get UCX_TLS=cuda_ipc,cuda_copy,sm,tcp
probe ipc-get-not-tcp     2048 $ipc_get UCX_TLS=^tcp
UCX_LOG_LEVEL_OVERRIDE=warn UCX_PROTO_INFO_OVERRIDE=n probe ipc-get-quiet 2048 $ipc_get
UCX_LOG_LEVEL_OVERRIDE=debug probe default-debug 2048 PD_X=1
grep -h -i -E "nvlink|get zcopy|cuda_ipc|cuda-ipc" "$out/logs/default-debug-d2048.log" | sort | uniq -c | sort -rn | head -40 > "$out/default-debug-ipc-lines.txt"
# the physical limit: a device-to-device copy of the same size on the same GPU (torch, CUDA events)
python3 - <<'PY' | tee "$out/d2d.txt"
import torch
def bw(n, iters):
    a = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda:0"); b = torch.empty_like(a)
    for _ in range(5): b.copy_(a)
    torch.cuda.synchronize(); ts = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); b.copy_(a); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
    ts.sort(); t = ts[len(ts) // 2]
    assert torch.equal(a, b)
    print(f"d2d copy {n} bytes on {torch.cuda.get_device_name(0)}: median {t*1e3:.4f} ms = {n/t/1e9:.1f} GB/s "
          f"(bytes moved once; read+write {2*n/t/1e9:.1f} GB/s), {iters} copies")
bw(33554432, 200); bw(1 << 30, 50)
PY
echo "## summary"; cat "$out/summary.txt"
