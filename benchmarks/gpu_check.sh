#!/bin/bash
# The GPU checks in one go (about 10 minutes on an H100), most wanted first: the CUDA tests, a
# dual step at Pythia-1.4B shape with the endpoint layers offloaded to CPU memory against the same
# step without (issue 38), a learned step's cost against a base step at Pythia-160M shape (docs/benchmarks.md's 4x512 batch and
# 16x512, each with half the layers checkpointed too: not yet timed on a GPU; each step also timed
# back to back, since fit no longer reads each step's loss back), a weight-matching
# merge against a plain average at Pythia-1B shape, one layer's per-head solves on 1 / 4 / 16
# threads, then the learned step at Pythia-1.4B shape under bf16 autocast in two processes (its
# time varied from process to process, 2026-11-27). Logs go to ${OUT:-gpu-check}/.
#
# On this workplace's device machines (image 'cuda': torch 2.11, transformers 5.17) carry the
# wheels the image lacks and put them first on the path (device README: pip download with
# --python-version 3.12 --platform manylinux...):
#   transformers==5.24.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEELS/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -u
out=${OUT:-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() {  # run NAME SECONDS COMMAND...: one check, its log, its exit status and time
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s"
    grep -E "^\||passed|failed" "$out/$name.log" | tail -8
}
run cuda_tests 120 python3 -m pytest -q -p no:warnings tests/test_cuda.py
run step_1.4b_offload 200 python3 benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16 --offload
run step_160m 90 python3 benchmarks/learned_step.py --device cuda
run step_160m_16x512 90 python3 benchmarks/learned_step.py --device cuda --batch 16
run merge_speed_1b 240 python3 benchmarks/merge_speed.py --pair /tmp/pair
run head_solves 60 python3 benchmarks/head_solves.py --threads 1 4 16
run step_1.4b_bf16 150 python3 benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16
run step_1.4b_bf16_again 150 python3 benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16
