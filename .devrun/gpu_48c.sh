#!/usr/bin/env bash
# needs 2 GPUs (one host), <= 150 s. Issue 48, session 6: ZeRO's bucket reduce-scatters and ZeRO-3's unit gathers now
# go through deepspeed_c.comm, whose common path is a call prebuilt per (group, op, async_op) (comm/direct.py);
# the CPU runs covered gloo only. 1) correctness over NCCL: test_comm_collectives' nccl-2 case (sum/avg reduce-scatter,
# flat/stacked/strided gathers, coalesced gathers, forced fallbacks, refusals, bad shapes), ZeRO-3's unit gather
# (coalesced and logged) and ZeRO-3 vs stage-0 parity over NCCL (NCCL AVG reduce-scatter inside the collective).
# 2) host us per call, ours vs torch.distributed vs the bare process group, interleaved, ratio to ours.
# Run from the repo root after `source scripts/device_setup.sh`.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
echo "== correctness (NCCL, 2 GPUs) $(date +%T)"
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_comm_collectives.py -k nccl 2>&1 | tail -2
DSC_TEST_BACKEND=nccl timeout 35 python3 -m pytest -q -p no:cacheprovider tests/distributed/test_zero3_unit_gather.py \
  2>&1 | tail -2
DSC_TEST_BACKEND=nccl timeout 35 python3 -m pytest -q -p no:cacheprovider -x tests/distributed/test_zero3_parity.py \
  -k "w2-tied-gas2-clip" 2>&1 | tail -2
T=$(( 145 - SECONDS )); [ $T -gt 40 ] && T=40
echo "== host us per call (NCCL, 2 GPUs, limit ${T}s) $(date +%T)"
timeout $T python3 benchmarks/comm_call_overhead.py --backend nccl --numel 1048576 --calls 200 --reps 7 2>&1 \
  | grep -vE "INFO|WARNING|UserWarning|^\s*$" | tail -12
echo "== done ${SECONDS} s"
