#!/bin/bash
# Issue 42, part 3 (2026-12-05): the runs on the lent GPU, from the repository root there.
#   bash 2026-12-05-runs.sh STAGE        (writes /tmp/work/STAGE; the caller tars /tmp/work into $OUT)
# Environment: vLLM 0.26.0 and ../shared/notes/gpu-vllm026-packages.txt (less nixl, nixl-cu13 and
# vllm/vllm-rs) installed here with `pip install --no-deps --target site` (Python 3.12.1),
# byte-compiled (compileall, unchecked-hash), a sitecustomize.py processing its .pth files, packed
# as site.tar.zst (zstd -9 --long=27, 403 MiB) in 7 parts carried one per call to
# /tmp/carry/parts; nixl 1.5.1 + nixl-cu13 1.5.1 wheels, these scripts and libnuma.so.1 /
# libmlx5.so.1 (Debian libnuma1, ibverbs-providers; Mooncake's engine.so needs them) in /tmp/carry/c1.
set -u
stage=${1:?STAGE}
here=$(cd "$(dirname "$0")" && pwd)
w=/tmp/work/$stage
mkdir -p "$w"
export PYTHONPATH=/tmp/site:/tmp/nixl:$PWD
export LD_LIBRARY_PATH=/tmp/carry/c1/libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export PD_SESSIONS_CACHE=/tmp/pdc HF_HUB_OFFLINE=1 VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
COMMON=(--platform cuda --share-gpus)
TINY=(--model tiny-llama --set dtype=bfloat16 --skip-check accuracy --extra-arg=--enforce-eager
      --extra-arg=--gpu-memory-utilization=0.3)
sweep() {  # label, time limit (s), then the sweep's arguments
  local label=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout -s TERM -k 30 "$limit" python3 -m pd_sessions sweep "$@" --results-dir "/tmp/res-$label" \
    > "$w/$label.log" 2>&1
  local rc=$?
  echo "$label: exit $rc after $((SECONDS - t0)) s: $*" | tee -a "$w/rc.txt"
  grep -E "PASS|FAIL|ERROR|SKIP|refused|exit" "$w/$label.log" | tail -40
  mkdir -p "$w/res-$label" && cp -r "/tmp/res-$label/." "$w/res-$label/" 2>/dev/null
}
case $stage in
diag)  # nixl, the transport diagnosis (the first call)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nixl /tmp/carry/c1/*.whl
  timeout -k 10 240 bash "$here/2026-12-05-ucx-diag.sh" /tmp/work/diag > "$w/diag-console.txt" 2>&1
  echo "diag exit $?"; tail -20 "$w/diag-console.txt"
  python3 - <<'PY' | tee /tmp/work/diag/best.txt
import glob, json, re
best = None
for js in sorted(glob.glob("/tmp/work/diag/logs/*-d2048.json")):
    doc = json.load(open(js))
    if "seconds" not in doc:
        continue
    s = sorted(doc["seconds"]); gbs = doc["bytes"] / s[len(s) // 2] / 1e9
    head = open(js[:-5] + ".log").readline()
    env = [e for e in head.split("env:", 1)[1].split() if e.startswith("UCX_")]
    print(f"{js.split('/')[-1]}: {gbs:.2f} GB/s {env}")
    if best is None or gbs > best[0]:
        best = (gbs, env)
print("BEST", best)
open("/tmp/work/diag/best.env", "w").write("".join(e + "\n" for e in best[1]) if best else "")
PY
  ;;
unpack)  # vLLM's tree (the parts carried so far), the import canary
  python3 - <<'PY'
import glob, hashlib, tarfile, time
import pyarrow as pa
t = time.time()
parts = sorted(glob.glob("/tmp/carry/parts/site.part.*"))
h = hashlib.sha256()
with open("/tmp/site.tar.zst", "wb") as f:
    for p in parts:
        b = open(p, "rb").read(); h.update(b); f.write(b)
print(len(parts), "parts, sha256", h.hexdigest())
want = "6d69fb3f4826ccee8f9d38ceb3344767dfb6b8dfd3828db07e862f923aabd1b6"  # site.tar.zst as packed
if h.hexdigest() != want:
    raise SystemExit(f"site.tar.zst: sha256 {h.hexdigest()} is not the packed archive's {want}")
with pa.input_stream("/tmp/site.tar.zst", compression="zstd") as f:
    tarfile.open(fileobj=f, mode="r|").extractall("/tmp")
print(f"unpacked in {time.time() - t:.1f} s")
PY
  python3 -c "import vllm, torch, nixl, mooncake.engine, vllm_router; print('vllm', vllm.__version__, 'torch', torch.__version__)" 2>&1 | tail -3
  python3 -m pd_sessions.canary mooncake nixl > "$w/canary.txt" 2>&1; echo "canary exit $?"; tail -4 "$w/canary.txt"
  ;;
perf-best)  # the perf check with the best UCX setting of the diagnosis
  echo "UCX env: $(tr '\n' ' ' < /tmp/work/diag/best.env)" | tee "$w/env.txt"
  for kv in $(cat /tmp/work/diag/best.env); do export "$kv"; done
  sweep perf-best "${PERF_LIMIT:-300}" perf_single_gpu "${COMMON[@]}" --only nixl-llama1b
  ;;
perf-default)  # the same with UCX's defaults (the condition of 2026-12-01), recording the baseline
  sweep perf-default 330 perf_single_gpu "${COMMON[@]}" --only nixl-llama1b --record-baseline
  cp pd_sessions/configs/perf_baselines.toml "$w/" 2>/dev/null
  ;;
push)  # NIXL push 1x1 with every default check (limit: PUSH_LIMIT s)
  sweep push "${PUSH_LIMIT:-300}" nixl_push_sweep "${COMMON[@]}" "${TINY[@]}" --only 1x1
  ;;
faults)  # the faults sweep (limit: FAULTS_LIMIT s)
  sweep faults "${FAULTS_LIMIT:-540}" faults "${COMMON[@]}" "${TINY[@]}" --mooncake-protocol tcp
  ;;
push-faults)  # NIXL push 1x1 with every default check, and the faults sweep, at the same time
  sweep push 540 nixl_push_sweep "${COMMON[@]}" "${TINY[@]}" --only 1x1 &
  sleep 15
  sweep faults 525 faults "${COMMON[@]}" "${TINY[@]}" --mooncake-protocol tcp &
  wait
  ;;
# The afternoon's second lease (2026-12-05, 16:30-): a fresh machine; .whl/g/c1 carried first
# (nixl, nixl-cu13, tomli-w, pyelftools, the two libraries), then the 7 parts, then `unpack` and
# `bg`; `poll` calls keep the machine held and bring back what is done.
setup)  # nixl and the harness's two missing wheels (the first call)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/nixl /tmp/carry/c1/*.whl
  python3 -c "import nixl, tomli_w; print('nixl and tomli_w import')"
  ;;
baseline)  # five perf_single_gpu nixl-llama1b sweeps, one after the other, and the baseline of them
  cp pd_sessions/configs/perf_baselines.toml "$w/perf_baselines.toml"
  t0=$SECONDS
  timeout -s TERM -k 30 "${BASELINE_LIMIT:-900}" python3 -m pd_sessions perf-baseline --runs 5 --out /tmp/pb \
    --baselines "$w/perf_baselines.toml" -- perf_single_gpu "${COMMON[@]}" --only nixl-llama1b > "$w/baseline.log" 2>&1
  echo "baseline: exit $? after $((SECONDS - t0)) s" | tee -a "$w/rc.txt"
  cp -r /tmp/pb "$w/pb" 2>/dev/null
  ;;
faults2)  # the faults sweep with the KV digest and the strand (the recall injections are in it)
  sweep faults2 "${FAULTS_LIMIT:-600}" faults "${COMMON[@]}" "${TINY[@]}" --mooncake-protocol tcp \
    --check kv_digest,fault_strand,conservation
  ;;
bg)  # baseline, then faults2, in a session of their own: they outlive the call (poll brings them)
  self="$here/$(basename "$0")"
  setsid nohup bash -c "bash '$self' baseline; bash '$self' faults2; touch /tmp/work/bg.done" \
    > /tmp/work/bg.log 2>&1 < /dev/null &
  echo "started in the background: baseline, faults2"
  ;;
poll)  # wait (POLL_S s, or until bg is done), then say where it is
  end=$((SECONDS + ${POLL_S:-300}))
  while [ $SECONDS -lt $end ] && [ ! -e /tmp/work/bg.done ]; do sleep 5; done
  cat /tmp/work/*/rc.txt 2>/dev/null; ls /tmp/pb 2>/dev/null | tr '\n' ' '; echo
  grep -hE "\] \[[0-9]+/[0-9]+\]|PASS|FAIL|NOT RUN|XFAIL|recorded|entry" /tmp/work/baseline/baseline.log \
    /tmp/work/faults2/faults2.log 2>/dev/null | cut -c1-300 | tail -40
  [ -e /tmp/work/bg.done ] && echo "bg done"
  ;;
pack)  # what is there so far, into $OUT (three archives, each under the 16 MiB a file may bring)
  tar -C /tmp/work -czf "$OUT/work.tgz" --exclude=./baseline/pb --exclude='./*/res-*' . 2>/dev/null
  [ -d /tmp/pb ] && tar -C /tmp -czf "$OUT/pb.tgz" --exclude='prefill-*.log' --exclude='decode-*.log' pb
  [ -d /tmp/res-faults2 ] && tar -C /tmp -czf "$OUT/faults2.tgz" res-faults2
  ls -la "$OUT"
  ;;
esac
