"""Cost of one dual-matching step vs one training step of the base model, at Pythia-160M shape.

Builds two GPT-NeoX models of Pythia-160M's shape (hidden 768, 12 layers, 12 heads, FFN 3072,
vocab 50304, partial rotary; float32, random weights: cost does not depend on the values) and
measures, each in its own process (wall time of the second of two steps, peak RSS):

  * ``base``: one forward + backward of model A on the batch (its weights trainable);
  * ``dual``: one :class:`hf_lmc.DualMatcher` step on the same batch (both transforms trained:
    residual Cayley map, per-head GL maps; ``--permutations ste`` adds straight-through MLP and
    head permutations), with each
    layer's interpolated weights rebuilt inside gradient checkpointing;
  * ``dual, no checkpointing``: the same with every layer's weights alive until backward;
  * ``dual, half the layers checkpointed`` (``checkpoint_layers=0.5``): between the two;
  * ``dual, the batch's targets kept``: a step on a batch whose ensemble targets (the endpoints'
    outputs) an earlier pass kept (``target_cache``), as every pass after a run's first is
    where the budget holds its batches;
  * with ``--one-sided``: a :class:`hf_lmc.LearnedMatcher` step (only B's transform), in the own
    frame and with ``frame="both"``, which takes dual matching's steps (docs/learned-matching.md) at this cost;
  * with ``--processes 2``: the dual step under DDP in 2 processes (one thread each, the batch
    per process), with the endpoints whole in each process and sharded across them
    (``shard_endpoints=True``); memory is per process (the larger of the two).

Targets (issue 5): dual time <= 3x base; dual memory <= 2x the two endpoints' weights plus the
base model's activations (activations = base peak - base weights - their gradients; a step's
memory = its peak RSS less the runtime's, i.e. RSS once torch, transformers and hf_lmc are imported).

    python benchmarks/learned_step.py                   # batch 4 x 512 tokens
    python benchmarks/learned_step.py --batch 8 --seq 512
    python benchmarks/learned_step.py --processes 2    # adds the 2-process rows (torchrun, gloo)
    python benchmarks/learned_step.py --one-sided      # adds one-sided steps, own frame and frame="both"
    python benchmarks/learned_step.py --device cuda --one-sided --shape 1.4b --autocast bf16
    python benchmarks/learned_step.py --device cuda --shape 1.4b --autocast bf16 --offload  # + endpoints in CPU memory
    python benchmarks/learned_step.py --objective labels   # as the step records before 2026-11-28 measured

The matching steps train toward the library's default objective (``ensemble``: a gradient-free
forward of each endpoint in every step) unless ``--objective`` says otherwise.

On ``--device cuda`` every step runs in one process (the allocator's statistics reset between
them): time is the mean of 5 synchronised steps after 2 warm-up steps (and of 5 more back to
back, synchronised once at the end, as a training loop runs: the host queues a step while the
GPU works on the last), and memory is the peak
the caching allocator held during a step (``torch.cuda.max_memory_allocated``: endpoints,
transforms, activations), with no runtime to subtract. ``--shape 1.4b`` is Pythia-1.4B's shape
(hidden 2048, 24 layers, 16 heads, FFN 8192). ``--autocast bf16`` runs every step, the base one
too, under bfloat16 autocast (float32 weights), as ``fit(mixed_precision="bf16")`` does.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from hf_lmc.config.options import OBJECTIVES, LearnOptions

try:  # run as a module (python -m benchmarks.learned_step) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write

CHILD = r"""
import json, re, sys, time
import torch, transformers as tf
from hf_lmc import DualMatcher, LearnedMatcher

mode, batch, seq, permutations = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
checkpoint_layers, objective = json.loads(sys.argv[5]), sys.argv[6]
def rss():
    return int(re.search(r"VmRSS:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
def hwm():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
runtime = rss()  # torch, transformers and hf_lmc imported: not part of any step's memory
config = tf.GPTNeoXConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                          vocab_size=50304, rotary_pct=0.25, max_position_embeddings=2048)
torch.manual_seed(0)
ids = torch.randint(0, config.vocab_size, (batch, seq))
model_a = tf.GPTNeoXForCausalLM(config).eval()
weights = sum(p.numel() * p.element_size() for p in model_a.parameters())
if mode == "base":
    step = lambda: model_a(input_ids=ids, labels=ids, use_cache=False).loss.backward()
elif mode.startswith("ddp"):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)  # first: sharding needs the process group
    model_b = tf.GPTNeoXForCausalLM(config).eval()
    matcher = DualMatcher(model_a, model_b, init="identity", permutations=permutations, shard_endpoints=(mode == "ddp-sharded"),
                          objective=objective)
    del model_a, model_b
    model = accelerator.prepare(matcher)
    params = [p for p in matcher.parameters() if p.requires_grad]
    def step():
        accelerator.backward(model({"input_ids": ids}))
        for p in params:
            p.grad = None
else:
    model_b = tf.GPTNeoXForCausalLM(config).eval()
    cls, frame = (LearnedMatcher, mode.removeprefix("learned-")) if mode.startswith("learned") else (DualMatcher, "own")
    matcher = cls(model_a, model_b, init="identity", permutations=permutations, frame=frame, checkpoint_layers=checkpoint_layers,
                  objective=objective)
    del model_a, model_b
    if mode == "dual-kept":  # a later pass over the fitting data: the batch's targets kept by the first
        from hf_lmc.learned.targets import TargetCache
        matcher.targets = TargetCache(2**40)
        matcher.targets.batch = 0
    params = [p for p in matcher.parameters() if p.requires_grad]
    def step():
        matcher({"input_ids": ids}).backward()
        for p in params:
            p.grad = None
import ctypes, gc; gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand set-up's freed copies back, so the step's peak is its own
open("/proc/self/clear_refs", "w").write("5")  # reset the peak: set-up (both HF models + canonical copies) is not a step
before = rss()
times = []
for _ in range(2):
    start = time.perf_counter()
    step()
    times.append(time.perf_counter() - start)
row = {"wall": times[-1], "peak": hwm(), "before": before, "weights": weights, "runtime": runtime}
if mode.startswith("ddp"):
    rows = [None] * accelerator.num_processes
    torch.distributed.all_gather_object(rows, row)
    row = max(rows, key=lambda r: r["peak"] - r["runtime"]) | {"wall": max(r["wall"] for r in rows)}
    if not accelerator.is_main_process:
        sys.exit(0)
print(json.dumps(row))
"""


CHECKPOINTING = {"dual-no-checkpointing": False, "dual-half": 0.5}  # checkpoint_layers per mode (default True)
SHAPES = {  # Pythia's GPT-NeoX shapes: (hidden, layers, heads)
    "160m": (768, 12, 12),
    "1.4b": (2048, 24, 16),
}
LABELS = {
    "base": "base model fwd+bwd",
    "dual": "dual (layer checkpointing)",
    "dual-no-checkpointing": "dual, no checkpointing",
    "dual-half": "dual, half the layers checkpointed",
    "dual-kept": "dual, the batch's targets kept (a later pass, `target_cache`)",
    "learned-own": "one-sided (layer checkpointing)",
    "learned-both": 'one-sided, `frame="both"` (layer checkpointing)',
    "dual-offloaded": "dual, endpoint layers offloaded to CPU memory (FSDP2)",
    "ddp": "dual, 2 processes (per process)",
    "ddp-sharded": "dual, 2 processes, sharded endpoints (per process)",
}


def on_cuda(
    modes: tuple[str, ...],
    shape: str,
    batch: int,
    seq: int,
    permutations: str,
    autocast: str,
    objective: str,
    device: str = "cuda",
) -> dict[str, dict]:
    """Every mode in this process on the GPU: mean time of 5 synchronised steps, peak allocated memory.

    (``device="cpu"`` runs the same code without the allocator's statistics: a dry run.)"""
    import gc
    import time

    import torch
    import transformers as tf

    from hf_lmc import DualMatcher, EndpointSharding, LearnedMatcher
    from hf_lmc.learned.targets import TargetCache

    hidden, layers, heads = SHAPES[shape]
    config = tf.GPTNeoXConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * hidden,
        vocab_size=50304,
        rotary_pct=0.25,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    cuda = device == "cuda"
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=device)
    with torch.device(device):  # random init on the GPU (fast), then the matchers canonicalise on the CPU
        model_a, model_b = (tf.GPTNeoXForCausalLM(config).eval().cpu() for _ in range(2))
    weights = sum(p.numel() * p.element_size() for p in model_a.parameters())
    dtype = {"none": None, "bf16": torch.bfloat16}[autocast]
    rows = {}
    for mode in modes:
        if mode == "base":
            module = model_a.to(device)
            run_step = lambda module=module: module(input_ids=ids, labels=ids, use_cache=False).loss.backward()
            params = list(module.parameters())
        else:
            cls, frame = (
                (LearnedMatcher, mode.removeprefix("learned-")) if mode.startswith("learned") else (DualMatcher, "own")
            )
            sharding = EndpointSharding(offload=True) if mode == "dual-offloaded" else False
            module = cls(
                model_a,
                model_b,
                init="identity",
                permutations=permutations,
                frame=frame,
                checkpoint_layers=CHECKPOINTING.get(mode, True),
                shard_endpoints=sharding,
                objective=objective,
            ).to(device)
            if mode == "dual-kept":  # a later pass over the fitting data: the batch's targets kept by the first
                module.targets = TargetCache(2**40)
                module.targets.batch = 0
            run_step = lambda module=module: module({"input_ids": ids}).backward()
            params = [p for p in module.parameters() if p.requires_grad]

        def step(run_step=run_step, params=params):  # this mode's, bound now (the loop rebinds the names)
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                run_step()
            for p in params:
                p.grad = None

        for _ in range(2):
            step()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() if cuda else 0
        times = []  # each step synchronised: a slow one shows (the mean is of all five)
        for _ in range(5):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() if cuda else 0
        start = time.perf_counter()  # back to back, as in a training loop that does not wait for each step
        for _ in range(5):
            step()
        if cuda:
            torch.cuda.synchronize()
        pipelined = (time.perf_counter() - start) / 5
        rows[mode] = {
            "wall": sum(times) / len(times),
            "pipelined": pipelined,
            "peak": peak,
            "before": before,
            "weights": weights,
            "runtime": 0,
        }
        steps = " ".join(f"{t:.3g}" for t in times)
        print(
            f"{mode}: {rows[mode]['wall']:.3g} s per step ({steps}), {pipelined:.3g} s back to back, peak {peak / 1e9:.2f} GB",
            file=sys.stderr,
            flush=True,
        )
        if mode == "base":
            model_a.cpu()
        del module, run_step, params, step
        gc.collect()  # a matcher is a reference cycle (its layers call back into it): freed only by the collector
        if cuda:
            torch.cuda.empty_cache()
    return rows


def run(mode: str, batch: int, seq: int, permutations: str, objective: str) -> dict:
    child_args = [mode, str(batch), str(seq), permutations, json.dumps(CHECKPOINTING.get(mode, True)), objective]
    if mode.startswith("ddp"):  # torchrun cannot take -c: the child goes through a temporary file
        import os
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
            f.write(CHILD)
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", f.name]
        env = os.environ | {"ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": "1"}
        try:
            out = subprocess.run([*launch, *child_args], capture_output=True, text=True, env=env, check=False)
        finally:
            os.unlink(f.name)
    else:
        out = subprocess.run([sys.executable, "-c", CHILD, *child_args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=4, help="sequences per batch (default: 4)")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence (default: 512)")
    parser.add_argument(
        "--permutations",
        default="fixed",
        choices=["fixed", "ste", "sinkhorn"],
        help="how the dual step's MLP and head permutations train (default: fixed)",
    )
    parser.add_argument(
        "--processes", type=int, default=1, choices=(1, 2), help="2: add the DDP rows, endpoints whole and sharded"
    )
    parser.add_argument(
        "--one-sided", action="store_true", help="add one-sided steps (LearnedMatcher), own frame and frame='both'"
    )
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the steps run (default: cpu)")
    parser.add_argument("--shape", default="160m", choices=list(SHAPES), help="Pythia shape (default: 160m)")
    parser.add_argument(
        "--autocast", default="none", choices=["none", "bf16"], help="cuda: run the steps under bf16 autocast"
    )
    parser.add_argument(
        "--objective",
        default=LearnOptions().objective,
        choices=OBJECTIVES,
        help="what the matching steps train toward (default: the library's, %(default)s; records before 2026-11-28: labels)",
    )
    parser.add_argument(
        "--offload",
        action="store_true",
        help="cuda: add a dual step with the endpoint layers in CPU memory (FSDP2's CPU offload)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/learned_step-<date>.json)",
    )
    args = parser.parse_args()
    if args.device == "cpu" and (args.shape != "160m" or args.autocast != "none"):
        parser.error("--shape and --autocast apply to --device cuda")
    if args.offload and args.device != "cuda":
        parser.error("--offload applies to --device cuda")
    if args.device == "cuda" and args.processes != 1:
        parser.error("--processes 2 is the CPU (gloo) measurement")
    modes = ("base", "dual", "dual-kept", "dual-no-checkpointing", "dual-half") + (
        ("learned-own", "learned-both") if args.one_sided else ()
    )
    modes += ("ddp", "ddp-sharded") if args.processes == 2 else ()
    modes += ("dual-offloaded",) if args.offload else ()
    if args.device == "cuda":
        import torch

        rows = on_cuda(modes, args.shape, args.batch, args.seq, args.permutations, args.autocast, args.objective)
        where = f"{torch.cuda.get_device_name()}, torch {torch.__version__}, autocast {args.autocast}, objective {args.objective}"
        memory_label = "peak allocated (GB)"
    else:
        rows = {mode: run(mode, args.batch, args.seq, args.permutations, args.objective) for mode in modes}
        import torch

        where = f"{torch.get_num_threads()} CPU thread(s) per step process, objective {args.objective}"
        memory_label = "peak RSS (GB)"
    record = new_record("learned_step", settings_of(args))
    base = rows["base"]
    weights = base["weights"]
    activations = base["peak"] - base["before"] - weights  # the step's growth, less the weight gradients
    budget = 2 * (2 * weights) + activations
    for row in rows.values():
        row["memory"] = row["peak"] - row["runtime"]  # peak less the interpreter + libraries (CPU)
    print(
        f"\nPythia-{args.shape} shape, float32 weights, permutations {args.permutations}, batch {args.batch} x {args.seq} tokens, {where}; "
        f"one model's weights {weights / 1e9:.2f} GB, base activations {activations / 1e9:.2f} GB, "
        f"memory budget (2 x both endpoints + activations) {budget / 1e9:.2f} GB\n"
    )
    pipelined = "pipelined" in base  # on a device: also 5 steps back to back, one synchronisation at the end
    extra = " back to back (s) | × base |" if pipelined else ""
    print(f"| step | time (s) | × base |{extra} {memory_label} | memory less runtime (GB) | vs budget |")
    print("|---|---|---|" + ("---|---|" if pipelined else "") + "---|---|---|")
    for mode, row in rows.items():
        budget_cell = f"{row['memory'] / budget:.2f}" if mode != "base" else "—"
        cells = f" {row['pipelined']:.3g} | {row['pipelined'] / base['pipelined']:.2f} |" if pipelined else ""
        print(
            f"| {LABELS[mode]} | {row['wall']:.3g} | {row['wall'] / base['wall']:.2f} |{cells} {row['peak'] / 1e9:.2f} | "
            f"{row['memory'] / 1e9:.2f} | {budget_cell} |"
        )
    record.update(
        where=where,
        weights_bytes=weights,
        activations_bytes=activations,
        budget_bytes=budget,
        steps={
            LABELS[mode]: {
                **row,
                "ratio_to_base": row["wall"] / base["wall"],
                "memory_over_budget": row["memory"] / budget,
            }
            for mode, row in rows.items()
        },
    )
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
