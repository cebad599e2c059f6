#!/bin/bash
# The GPU checks, each in its own process with its own log and time limit, all inside one deadline
# (a lent machine's minutes are few). With no arguments every check runs, most wanted first;
# arguments name the checks to run, in that order:
#
#   bash benchmarks/gpu_check.sh                                    # all (about 12 minutes on an H100)
#   DEADLINE=540 bash benchmarks/gpu_check.sh step_1.4b_offload merge_llama_random
#
# The checks:
#   cuda_tests            tests/test_cuda.py (skipped on machines without CUDA)
#   step_1.4b_offload     a dual step at Pythia-1.4B shape, bf16 autocast, with the endpoint layers
#                         offloaded to CPU memory (FSDP2) against the same step without (issue 38)
#   step_160m             learned and dual step costs against a base step, Pythia-160M, 4 x 512
#   step_160m_before      the same step with the hf_lmc of the tree in $BASELINE (default .baseline):
#                         one GPU's step before and after a change, in time and peak memory (issue
#                         59: the shared build at N = 1). Make the tree here and carry it (git
#                         ignores it): git archive 1e3278a hf_lmc | tar -x -C .baseline
#   step_160m_16x512      the same at 16 x 512
#   merge_pythia          weight merge against a plain average, Pythia-1B shape, B a symmetry of A
#   merge_llama_random    the same at the LLaMA-1.1B shape, A and B independent initialisations
#   merge_llama_symmetry  the LLaMA-1.1B shape with B a symmetry of A plus noise
#   merge_llama_profile   cProfile of the LLaMA weight merge on the GPU (after merge_llama_random)
#   head_solves           one layer's per-head solves on 1 / 4 / 16 threads
#   step_1.4b_bf16        the 1.4B bf16 step without offload, in a process of its own
# Run only when named (they outlast the default run's deadline; issue 78):
#   paper_members         the paper tier's 12 members at the paper's full budget (up to 20000 steps,
#                         stopped where the validation loss stops improving), trained on the GPU, six
#                         processes at a time (the models are small), into the zoo cache
#   paper_tier            the paper tier measured on those members (suite --resume: what the records
#                         lack at today's code), its records copied to $OUT/paper-records/ to commit
#
# Logs go to ${OUT:-gpu-check}/NAME.log and each benchmark's record to NAME.json beside it (copy
# the records into benchmarks/results/ and run python -m benchmarks.tables to show them in
# docs/results.md); each check's exit status and time are printed, with the
# tables of its log. DEADLINE (seconds, default 3600) caps the whole run: a check gets the lesser
# of its own limit and what is left, and none starts with under 20 s left.
#
# On this workplace's device machines (image 'cuda': torch 2.11, transformers 5.17) carry the
# wheels the image lacks and put them first on the path (device README: pip download with
# --python-version 3.12 --platform manylinux...):
#   transformers==5.24.0 pydantic==2.13.4 pydantic_core==2.46.4 annotated_types==0.7.0 typing_inspection==0.4.2
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site WHEELS/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -u
out=${OUT:-gpu-check}
deadline=$((SECONDS + ${DEADLINE:-3600}))
pairs=${PAIRS:-/tmp/hf-lmc-pairs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1

declare -A LIMIT=(
    [cuda_tests]=120 [step_1.4b_offload]=240 [step_160m]=90 [step_160m_before]=90 [step_160m_16x512]=90 [merge_pythia]=180
    [merge_llama_random]=240 [merge_llama_symmetry]=240 [merge_llama_profile]=150 [head_solves]=60 [step_1.4b_bf16]=150
    [paper_members]=600 [paper_tier]=600
)
ALL=(cuda_tests step_1.4b_offload step_160m step_160m_before step_160m_16x512 merge_pythia merge_llama_random merge_llama_symmetry
     merge_llama_profile head_solves step_1.4b_bf16)

command_of() {  # the command line of one check
    local record="--json $out/$1.json"  # each benchmark's record (benchmarks/record.py), beside its log
    case $1 in
        cuda_tests) echo python3 -m pytest -q -p no:warnings tests/test_cuda.py ;;
        step_1.4b_offload) echo python3 benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16 --offload "$record" ;;
        step_160m) echo python3 benchmarks/learned_step.py --device cuda "$record" ;;
        step_160m_before)  # this tree's benchmark (unchanged since 1e3278a), run in the baseline tree
            # so that its hf_lmc is the one imported (the benchmark's child runs with python -c: the
            # working directory comes first on its path)
            local tree=${BASELINE:-.baseline}
            [[ -d $tree/hf_lmc ]] || { echo "bash -c 'echo no hf_lmc under $tree >&2; exit 2'"; return; }
            echo "bash -c 'cd $tree && exec python3 $PWD/benchmarks/learned_step.py --device cuda --json $(realpath -m "$out/$1.json")'" ;;
        step_160m_16x512) echo python3 benchmarks/learned_step.py --device cuda --batch 16 "$record" ;;
        merge_pythia) echo python3 benchmarks/merge_speed.py --pair "$pairs/pythia" "$record" ;;
        merge_llama_random) echo python3 benchmarks/merge_speed.py --arch llama --kind random --pair "$pairs/llama-random" "$record" ;;
        merge_llama_symmetry) echo python3 benchmarks/merge_speed.py --arch llama --pair "$pairs/llama-symmetry" "$record" ;;
        merge_llama_profile)  # the pair merge_llama_random wrote
            echo "bash -c 'python3 -m cProfile -s cumtime -m hf_lmc merge $pairs/llama-random/a $pairs/llama-random/b"\
                 "-o /tmp/profiled --method weight --device \${PROFILE_DEVICE:-cuda} --quiet | head -80'" ;;
        head_solves) echo python3 benchmarks/head_solves.py --threads 1 4 16 "$record" ;;
        step_1.4b_bf16) echo python3 benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16 "$record" ;;
        paper_members)  # one process per pair, all on the one GPU
            echo "bash -c 'for pair in paper-gpt2-{a,b,c} paper-vit-{a,b,c}; do python3 -m benchmarks.suite --tier paper"\
                 "--pairs \$pair --train-only --device cuda & done; wait'" ;;
        paper_tier)  # each pair's record is written as it finishes: a run cut off keeps what it measured
            echo "bash -c 'python3 -m benchmarks.suite --tier paper --device cuda --resume;"\
                 "mkdir -p $out/paper-records && cp benchmarks/results/suite-*-paper-*.json $out/paper-records/'" ;;
        *) return 1 ;;
    esac
}

run() {  # run NAME: one check, its log, its exit status and time
    local name=$1 start=$SECONDS left=$((deadline - SECONDS)) cmd
    if ! cmd=$(command_of "$name"); then
        echo "$name: no such check (${ALL[*]})"
        return
    fi
    if ((left < 20)); then
        echo "$name: skipped, $left s left"
        return
    fi
    local limit=$((LIMIT[$name] < left ? LIMIT[$name] : left))
    eval timeout "$limit" "$cmd" > "$out/$name.log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s (limit $limit s)"
    grep -E "^\||passed|failed|Error|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ " "$out/$name.log" | head -40
}

for name in "${@:-${ALL[@]}}"; do
    run "$name"
done
