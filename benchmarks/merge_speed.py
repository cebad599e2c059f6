"""Weight-matching merge vs a plain linear average, at Pythia-1B or LLaMA-1.1B shape.

Writes two checkpoints, GPT-NeoX (hidden 2048, 16 layers, 8 heads, FFN 8192, partial rotary) or
LLaMA (hidden 2048, 16 layers, 32 heads on 4 KV heads, MLP 5632, vocab 32000), float16
safetensors like the Hub's, where B is a random full symmetry of A plus noise (so assignment
costs look like real ones) or, with ``--kind random``, an independent initialisation, then
times in one run

  * ``hf-lmc merge A B --method average``   (the baseline: stream, lerp, write)
  * ``hf-lmc merge A B --method weight``    (weight matching, then the same)

each in its own process, recording wall time and peak RSS (and the GPU's peak memory where
weight matching ran on one: by default it does when torch sees a GPU). Prints a markdown table.
The runtime's own peak RSS (a process that only imports hf_lmc and, for a GPU merge, starts
CUDA with cuBLAS and cuSOLVER) is measured apart and shown beside, so the memory a merge adds
can be read against one checkpoint.

    python benchmarks/merge_speed.py                 # Pythia-1B shape (needs ~10 GB disk)
    python benchmarks/merge_speed.py --device cpu    # weight matching on the CPU even beside a GPU
    python benchmarks/merge_speed.py --scale 0.25    # hidden, FFN and vocab scaled down
    python benchmarks/merge_speed.py --pair ~/pair   # keep the checkpoints and reuse them next time
    python benchmarks/merge_speed.py --arch llama --kind random   # issue 38's LLaMA pair
    python -m benchmarks.merge_speed --floor --arch llama --sweeps 2 --average 12.5

Each run writes its record (``benchmarks/record.py``) under ``benchmarks/results/`` (or to
``--json FILE``); ``python -m benchmarks.tables`` shows the newest in docs/results.md.

``--floor`` merges nothing: it prints how fast weight matching could be on this machine, its
large matrix products alone (fixed by the shape and the number of sweeps, whatever the code
around them does) timed at this machine's measured matmul rates, so that a merge's wall time can
be read against the floor its arithmetic sets (``--average S``: as a ratio to a plain average's
time). Per sweep and layer: the residual statistics (float32, every tensor's d x d product with
B's layer maps applied), B's attention weights rotated by the residual map (float32), B's MLP
weights rotated (bfloat16), the F x F unit similarity and the head similarities (bfloat16); once:
the embedding and head statistics, and B rotated at export (float32). Solves, reads and writes
come on top.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers as tf

try:  # run as a module (python -m benchmarks.merge_speed) or as a script
    from benchmarks.record import new_record, settings_of, started, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, started, write

# Peak RSS from VmHWM: ru_maxrss survives fork + exec, so a child would report its parent's peak.
CHILD = """
import json, re, resource, sys, time
import torch
from hf_lmc.cli import main
start = time.perf_counter()
rc = main(json.loads(sys.argv[1]))
wall = time.perf_counter() - start
try:
    rss_kb = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
except OSError:
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
gpu = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else None
print(json.dumps({"rc": rc, "wall": wall, "rss_kb": rss_kb, "gpu_bytes": gpu}))
"""

# The runtime's own peak RSS (torch, transformers, hf_lmc imported; on a GPU also CUDA's context and
# the cuBLAS / cuSOLVER libraries a weight merge loads): what any merge pays before it reads a tensor.
RUNTIME = """
import json, re, sys
import torch
import hf_lmc.cli
device = sys.argv[1]
if device != "cpu":
    x = torch.randn(256, 256, device=device, dtype=torch.float64)
    torch.linalg.svd(x @ x.T); torch.linalg.eigh(x @ x.T); torch.cuda.synchronize()
print(json.dumps({"rss_kb": int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))}))
"""


def pythia_1b_config(scale: float) -> tf.GPTNeoXConfig:
    hidden = int(2048 * scale) // 64 * 64
    return tf.GPTNeoXConfig(
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 256),
        num_hidden_layers=16,
        intermediate_size=4 * hidden,
        vocab_size=int(50304 * scale) // 64 * 64,
        rotary_pct=0.25,
        max_position_embeddings=2048,
        dtype="float16",
    )


def llama_config(scale: float) -> tf.LlamaConfig:
    """The LLaMA shape of issue 38 (TinyLlama-1.1B's): hidden 2048, 16 layers, 32 heads on 4 KV heads, MLP 5632."""
    hidden = int(2048 * scale) // 64 * 64
    return tf.LlamaConfig(
        hidden_size=hidden,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 512),
        num_hidden_layers=16,
        intermediate_size=int(5632 * scale) // 64 * 64,
        vocab_size=int(32000 * scale) // 64 * 64,
        max_position_embeddings=2048,
        dtype="float16",
    )


ARCHS = {
    "pythia": (pythia_1b_config, tf.GPTNeoXForCausalLM, "Pythia-1B"),
    "llama": (llama_config, tf.LlamaForCausalLM, "LLaMA-1.1B"),
}


def _fresh(model_class, config, seed: int, folder: Path) -> None:
    torch.manual_seed(seed)
    with torch.device("cpu"):
        model = model_class(config)
    model.half().save_pretrained(folder)


def write_pair(
    folder: Path, config, noise: float, seed: int = 0, *, model_class=tf.GPTNeoXForCausalLM, kind: str = "symmetry"
) -> tuple[Path, Path]:
    """A = fresh init (saved float16); B = random symmetry of A + relative noise, streamed
    (``kind="symmetry"``), or a second fresh init from another seed (``kind="random"``)."""
    import hf_lmc
    from hf_lmc.io.export import save_canonical
    from hf_lmc.utils.devices import compute_device

    a, b = folder / "a", folder / "b"
    _fresh(model_class, config, seed, a)
    if kind == "random":
        _fresh(model_class, config, seed + 1, b)
        return a, b
    device = compute_device()  # B's ~4 TFLOP of rotations: a GPU's seconds, or the CPU's minutes
    canonical = hf_lmc.canonicalize(a, dtype=torch.float32, device=device)
    transform = hf_lmc.random_symmetry(canonical.spec, seed=seed + 1, dtype=torch.float32).to(device=device)
    generator = torch.Generator(device).manual_seed(seed + 2)

    def perturb(_, t):
        return t + noise * t.std() * torch.randn(t.shape, generator=generator, device=device)

    save_canonical(transform.apply(canonical).map_tensors(perturb), b, dtype=torch.float16, shard_size="2GB")
    return a, b


def measure(args: list[str], child: str = CHILD) -> dict:
    out = subprocess.run([sys.executable, "-c", child, *args], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    """The processor's model name, as /proc/cpuinfo gives it (AMX or AVX-512 change the products' speed)."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            line = next(line for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown processor"
    return line.split(":", 1)[1].strip()


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def rate(dtype: torch.dtype, m: int = 2048, k: int = 5632, n: int = 2048, repeats: int = 3) -> float:
    """Measured GFLOP/s of an (m, k) @ (k, n) product in ``dtype`` (the best of ``repeats``)."""
    x, y = torch.randn(m, k).to(dtype), torch.randn(k, n).to(dtype)
    x @ y  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        x @ y
        best = min(best, time.perf_counter() - start)
    return 2 * m * k * n / best / 1e9


def parts(config, sweeps: int) -> list[tuple[str, float, str]]:
    """(part, GFLOP, dtype) of weight matching's large products for ``config``."""
    d, layers, ffn = config.hidden_size, config.num_hidden_layers, config.intermediate_size
    heads = config.num_attention_heads
    head_dim = d // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    gated = config.model_type == "llama"  # SwiGLU: gate, up, down; GPT-NeoX: up, down
    attention_rows = 2 * heads * head_dim + 2 * kv * head_dim  # q, o; k, v
    mlp_rows = (3 if gated else 2) * ffn
    vocab_rows = 2 * config.vocab_size  # untied embedding and head
    gflop = 2e-9 * d * d
    return [
        ("residual statistics, every sweep", sweeps * layers * gflop * (attention_rows + mlp_rows), "float32"),
        ("B's attention rotated, every sweep", sweeps * layers * gflop * attention_rows, "float32"),
        ("B's MLP rotated, every sweep", sweeps * layers * gflop * mlp_rows, "bfloat16"),
        ("MLP unit similarities, every sweep", sweeps * layers * 2e-9 * ffn * ffn * (mlp_rows // ffn) * d, "bfloat16"),
        (
            "head similarities, every sweep",
            sweeps * layers * 2e-9 * d * (2 * (heads * head_dim) ** 2 + 2 * (kv * head_dim) ** 2),
            "bfloat16",
        ),
        ("embedding and head statistics", gflop * vocab_rows, "float32"),
        ("B rotated at export", gflop * (layers * (attention_rows + mlp_rows) + vocab_rows), "float32"),
    ]


def floor(args, config, arch_name: str) -> None:
    """``--floor``: weight matching's large products at the measured matmul rates, and the record."""
    record = new_record("merge_speed_floor", settings_of(args))
    rates = {"float32": rate(torch.float32), "bfloat16": rate(torch.bfloat16)}
    print(
        f"{arch_name} shape, {args.sweeps} sweep(s), {torch.get_num_threads()} threads; "
        f"measured matmul rates: float32 {rates['float32']:.0f}, bfloat16 {rates['bfloat16']:.0f} GFLOP/s\n"
    )
    print("| part | GFLOP | dtype | seconds at the measured rate |")
    print("|---|---|---|---|")
    record["rates_gflops"], record["parts"] = rates, []
    for part, gflop, dtype in parts(config, args.sweeps):
        seconds = gflop / rates[dtype]
        record["parts"].append({"part": part, "gflop": gflop, "dtype": dtype, "seconds": seconds})
        print(f"| {part} | {gflop:.0f} | {dtype} | {seconds:.1f} |")
    total = sum(part["seconds"] for part in record["parts"])
    ratio = f" = {total / args.average:.1f}× the average's {args.average:.1f} s" if args.average else ""
    print(f"| **all products** | | | **{total:.1f}**{ratio} |")
    record["seconds"] = total
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="scale hidden size, FFN and vocab (default: 1 = Pythia-1B)"
    )
    parser.add_argument("--noise", type=float, default=0.1, help="relative noise added to B (default: 0.1)")
    parser.add_argument(
        "--workdir", type=Path, default=None, help="where to write the checkpoints (default: a temp dir)"
    )
    parser.add_argument(
        "--pair", type=Path, default=None, help="keep the pair in DIR/a, DIR/b and reuse it on later runs"
    )
    parser.add_argument(
        "--device", default=None, help="hf-lmc merge --device for weight matching (default: a GPU when torch sees one)"
    )
    parser.add_argument(
        "--arch", choices=list(ARCHS), default="pythia", help="the shape: Pythia-1B or LLaMA-1.1B (default: pythia)"
    )
    parser.add_argument(
        "--kind",
        choices=("symmetry", "random"),
        default="symmetry",
        help="B as a random symmetry of A plus noise, or an independent random initialisation (default: symmetry)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="merge nothing: print the floor weight matching's matrix products set"
    )
    parser.add_argument("--sweeps", type=int, default=2, help="--floor: weight-matching sweeps (default: 2)")
    parser.add_argument(
        "--average", type=float, default=None, help="--floor: a plain average's wall time here (s), for a ratio"
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/merge_speed-<date>.json)",
    )
    args = parser.parse_args()

    make_config, model_class, arch_name = ARCHS[args.arch]
    config = make_config(args.scale)
    if args.floor:
        floor(args, config, arch_name)
        return
    record = new_record("merge_speed", settings_of(args), date=started())
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        tmp = Path(tmp)
        start = time.perf_counter()
        home = args.pair or tmp
        if args.pair and (home / "a" / "config.json").is_file() and (home / "b" / "config.json").is_file():
            a, b = home / "a", home / "b"
        else:
            home.mkdir(parents=True, exist_ok=True)
            a, b = write_pair(home, config, args.noise, model_class=model_class, kind=args.kind)
        size = folder_bytes(a)
        print(
            f"pair ready in {time.perf_counter() - start:.0f} s; one checkpoint = {size / 1e9:.2f} GB", file=sys.stderr
        )
        rows = {}
        for method in ("average", "weight"):
            device_flag = ["--device", args.device] if args.device and method == "weight" else []
            rows[method] = measure(
                [
                    json.dumps(
                        [
                            "merge",
                            str(a),
                            str(b),
                            "-o",
                            str(tmp / method),
                            "--method",
                            method,
                            "--shard-size",
                            "1GB",
                            *device_flag,
                        ]
                    )
                ]
            )
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        runtime = {"average": measure(["cpu"], RUNTIME)["rss_kb"], "weight": measure([device], RUNTIME)["rss_kb"]}
        base = rows["average"]["wall"]
        params = sum(p.numel() for p in model_class(config).parameters()) if args.scale < 0.5 else None
        heads = f"{config.num_attention_heads} heads" + (
            f" / {config.num_key_value_heads} KV" if args.arch == "llama" else ""
        )
        shape = f"hidden {config.hidden_size}, {config.num_hidden_layers} layers, {heads}, FFN {config.intermediate_size}, vocab {config.vocab_size}"
        pair_kind = (
            "B a random symmetry of A plus noise"
            if args.kind == "symmetry"
            else "A and B independent random initialisations"
        )
        cores = len(os.sched_getaffinity(0))
        gpu = (
            f", weight matching on {torch.cuda.get_device_name()}"
            if device.startswith("cuda")
            else ", weight matching on the CPU"
        )
        print(
            f"\n{arch_name}-shaped pair ({shape}{f', {params / 1e6:.0f}M params' if params else ''}; {pair_kind}), float16, {cores} CPU cores ({cpu_name()}){gpu}\n"
        )
        print(
            "| merge | wall time (s) | × average | peak RSS (GB) | RSS / one checkpoint | runtime RSS (GB) | RSS less runtime / one checkpoint | GPU peak (GB) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        record.update(shape=shape, params=params, pair_kind=pair_kind, checkpoint_bytes=size, device=device)
        record["merges"] = {}
        for method, row in rows.items():
            rss, own, gpu_bytes = row["rss_kb"] * 1024, runtime[method] * 1024, row.get("gpu_bytes")
            record["merges"][method] = {
                "seconds": row["wall"],
                "ratio_to_average": row["wall"] / base,
                "peak_rss_bytes": rss,
                "runtime_rss_bytes": own,
                "gpu_peak_bytes": gpu_bytes,
            }
            gpu_peak = f"{gpu_bytes / 1e9:.2f}" if gpu_bytes is not None else "—"
            print(
                f"| {method} | {row['wall']:.1f} | {row['wall'] / base:.2f} | {rss / 1e9:.2f} | {rss / size:.2f} | {own / 1e9:.2f} "
                f"| {(rss - own) / size:.2f} | {gpu_peak} |"
            )

    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
