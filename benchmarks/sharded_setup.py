"""Per-process memory of a multi-process dual-matching run, endpoints whole or sharded (FSDP2).

Writes two GPT-NeoX checkpoints of Pythia-160M's shape (random weights: memory and time do not
depend on the values) and, under ``torchrun`` with N gloo processes (one thread each), builds a
:class:`hf_lmc.DualMatcher` from the two folders as ``hf-lmc merge`` does (weight matching's
start, computed by the main process and sent to the others), then runs two training steps on a
batch of 2 x 128 tokens per process, with glibc's allocator set as ``hf-lmc`` sets it (large
blocks served by ``mmap``, so freed tensors leave RSS at once). Per process (the largest of the N):

  * set-up peak: the peak RSS while the matcher is built, less the runtime's (RSS once torch,
    transformers and hf_lmc are imported), on the main process (which also runs weight
    matching) and on the largest of the others;
  * endpoints held: the bytes of the two endpoints this process keeps after set-up
    (``EndpointStore.local_numel``), against the two whole models;
  * step peak: the peak RSS during the second step, less the RSS before the steps;
  * step time: the second step's wall time (the slowest process).

    python benchmarks/sharded_setup.py                        # 1, 2 and 4 processes, whole and sharded
    python benchmarks/sharded_setup.py --processes 2 --shape 70m

Issue 38 items 2 and 5: no process holds both whole models; the endpoints held per process are
1/N of the layers plus the embeddings and heads (which stay whole).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

try:  # run as a module (python -m benchmarks.sharded_setup) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write

SHAPES = {"70m": (512, 6, 8), "160m": (768, 12, 12)}  # Pythia's GPT-NeoX shapes: (hidden, layers, heads)

CHILD = r"""
import ctypes, json, re, sys, time
ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # as hf-lmc's command line sets it: freed tensors go back to the OS at once
import torch
from accelerate import Accelerator
from hf_lmc import DualMatcher

def rss(field="VmRSS"):
    return int(re.search(field + r":\s+(\d+)", open("/proc/self/status").read()).group(1)) * 1024
runtime = rss()
folder_a, folder_b, sharded = sys.argv[1], sys.argv[2], sys.argv[3] == "sharded"
accelerator = Accelerator(cpu=True)  # first: sharding needs the process group
open("/proc/self/clear_refs", "w").write("5")
matcher = DualMatcher(folder_a, folder_b, shard_endpoints=sharded)
setup_peak = rss("VmHWM") - runtime
held = sum(s.local_numel() for s in matcher.interpolant.endpoints) * 4
model = accelerator.prepare(matcher)
params = [p for p in matcher.parameters() if p.requires_grad]
ids = torch.randint(0, matcher.interpolant.config.vocab_size, (2, 128), generator=torch.Generator().manual_seed(accelerator.process_index))
def step():
    accelerator.backward(model({"input_ids": ids}))
    for p in params:
        p.grad = None
step()
open("/proc/self/clear_refs", "w").write("5")
before = rss()
start = time.perf_counter()
step()
row = {"setup_peak": setup_peak, "held": held, "step_peak": rss("VmHWM") - before, "wall": time.perf_counter() - start}
rows = [None] * accelerator.num_processes
if accelerator.num_processes > 1:
    torch.distributed.all_gather_object(rows, row)
else:
    rows = [row]
if accelerator.is_main_process:
    others = rows[1:] or rows
    summary = {k: max(r[k] for r in rows) for k in row} | {"setup_main": rows[0]["setup_peak"], "setup_others": max(r["setup_peak"] for r in others)}
    print("RESULT " + json.dumps(summary))
accelerator.wait_for_everyone()
"""


def write_pair(folder: Path, shape: str) -> tuple[Path, Path, int]:
    """Two random checkpoints of ``shape`` (written once) and one model's bytes."""
    import torch
    import transformers as tf

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
    paths = []
    for seed in (0, 1):
        path = folder / f"{shape}-{seed}"
        if not (path / "config.json").exists():
            torch.manual_seed(seed)
            tf.GPTNeoXForCausalLM(config).save_pretrained(path)
        paths.append(path)
    model = tf.GPTNeoXForCausalLM(config)
    return paths[0], paths[1], sum(p.numel() * 4 for p in model.parameters())


def run(processes: int, mode: str, a: Path, b: Path) -> dict:
    launch = (
        [sys.executable]
        if processes == 1
        else [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
    )
    root = str(Path(__file__).resolve().parent.parent)
    env = os.environ | {"OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true", "TQDM_DISABLE": "1", "PYTHONPATH": root}
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(CHILD)
    done = subprocess.run([*launch, f.name, str(a), str(b), mode], env=env, capture_output=True, text=True, check=False)
    Path(f.name).unlink()
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"{processes} processes, {mode}: exit {done.returncode}\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="160m")
    parser.add_argument(
        "--pair",
        type=Path,
        default=Path(tempfile.gettempdir()) / "hf_lmc_sharded_setup",
        help="where the checkpoints are written (kept)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/sharded_setup-<date>.json)",
    )
    args = parser.parse_args()
    args.pair.mkdir(parents=True, exist_ok=True)
    a, b, model_bytes = write_pair(args.pair, args.shape)
    gb = 1 << 30
    print(
        f"Pythia-{args.shape} shape, float32: one model {model_bytes / gb:.2f} GiB, both {2 * model_bytes / gb:.2f} GiB\n"
    )
    print(
        "| processes | endpoints | set-up peak, main (GiB) | set-up peak, others (GiB) | endpoints held (GiB) | step peak (GiB) | step (s) |"
    )
    print("|---|---|---|---|---|---|---|")
    record = new_record("sharded_setup", settings_of(args))
    record.update(model_bytes=model_bytes, runs=[])
    for processes in args.processes:
        for mode in ("whole", "sharded") if processes > 1 else ("whole",):
            r = run(processes, mode, a, b)
            record["runs"].append({"processes": processes, "endpoints": mode, **r})
            others = f"{r['setup_others'] / gb:.2f}" if processes > 1 else "—"
            print(
                f"| {processes} | {mode} | {r['setup_main'] / gb:.2f} | {others} | {r['held'] / gb:.2f} | {r['step_peak'] / gb:.2f} | {r['wall']:.1f} |",
                flush=True,
            )
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
