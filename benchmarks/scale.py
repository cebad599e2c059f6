"""Memory and time per dual-matching step for 1B, 7B and 70B pairs on 1, 8 and 64 GPUs, computed.

Nothing here runs a model: the tables of docs/scale.md are computed from the shapes and from
what the H100 measured at Pythia-1.4B's shape (docs/decisions.md#d-scale-model: a dual step with layer
checkpointing under bfloat16 autocast, 4 x 512 tokens, float32 endpoints, one GPU: 197 ms of GPU
work, 14.81 GB peak allocated). The model, term by term:

Memory per GPU (bytes; ``b`` is the endpoints' dtype size, ``N`` the processes):

* endpoint layers: ``2 L P b / N`` sharded (FSDP2), ``2 L P b`` whole, 0 when offloaded to the CPU;
* embeddings and heads: ``2 x 2 V d b``, whole on every GPU (the store keeps them whole);
* layers in flight: sharded, ``2 (2 + b + 2) P`` (per endpoint: the layer gathered in bfloat16
  under ``--mixed-precision bf16``, its copy in the endpoints' dtype, the prefetched next); plus,
  always, the layer being built: ``3 P x 4`` (T_A(A), T_B(B) and their mix, float32; the sharded
  build's 1/N of those rows and the all-gathered merged layer are given the same term);
* transforms and Adam: ``2 (d^2 + L (K hd^2 + F)) x 16`` (dual: two transforms; residual map,
  per-KV-head OV maps, MLP scales; float32 parameter, gradient and two moments);
* activations (Korthikanti et al. 2022, full recomputation): ``L T d x 2`` at the layer
  boundaries, one layer recomputed ``T d (34 + 5 a s / d)``, and the loss. The loss takes the
  head a slice of ``r = min(T, 2^27 / 4V)`` positions at a time (``hf_lmc.evaluation.head_loss``):
  ``r V x 12`` (ensemble: the slice's logits, the target and one endpoint's, or the
  log-normaliser's temporary, in float32) or ``r V x 8`` (labels), plus the gradients it
  computes in its forward, ``T d x 4`` and ``V d x 4``, and for the ensemble objective the
  endpoints' last hidden states, ``2 T d x 4``. Before the slices (the code the calibration
  step ran) the loss held the whole logits: ``T V x 10``, and ``T V x 8`` more for the
  ensemble's target and its product with the log-probabilities, beside the same gradients.

Time per step and GPU: FLOPs over the throughput the 1.4B measurement implies. Per layer and
step: building the interpolated weights applies each endpoint's maps, ``2 (d + hd) P`` per
endpoint, and the layer computes ``2 T P``; checkpointed, a step builds three times (forward,
recomputation, backward: the endpoints are frozen, so only the maps' gradient is formed) and
computes four times (forward, recomputation, backward at twice the forward). The embedding and
head add the same with ``P = 2 V d`` (built) and ``V d`` (computed). The ensemble objective
adds a gradient-free forward of each endpoint, as it is (no build): ``2 x 2 T (L P + V d)``.
The weight build does not depend on the tokens. On one GPU it is all built ("unsharded build");
under N > 1 processes (``--shard-endpoints``) the build is sharded: each process computes 1/N
of the rows of every moved tensor, the embeddings' and heads' included, so its build is the
unsharded one over N ("build" in "build + tokens"). The token compute per GPU is unchanged.

Traffic per GPU and step (bytes), none on one GPU:

* endpoint gathers (unchanged by the sharded build): ``2 x 2 x (N - 1) / N x L P x 2`` (both
  endpoints, forward and recomputation, in bfloat16; the ensemble objective's endpoint forwards
  gather every layer once more, ``2 x 3`` in all; offloaded shards also cross from the host,
  ``4 L P b / N``, or ``6 L P b / N``, counted at the same bandwidth);
* merged weights, float32: each layer is assembled by one all-gather of its rows per build
  (forward, recomputation) and its gradient reduce-scattered in backward,
  ``3 x (N - 1) / N x L P x 4``; the token table is built at the batch's tokens, never
  gathered; the head either gathered and its gradient reduce-scattered, ``2 x (N - 1) / N x V d
  x 4``, or kept at each process's vocabulary rows with the last hidden states gathered instead
  (the point's and both endpoints') and their gradient reduce-scattered, ``4 x (N - 1) x T d x
  4``, whichever is fewer bytes (as the interpolant chooses);

all at an assumed 300 GB/s per GPU within a node (NVLink, N <= 8) and 50 GB/s across nodes
(400 Gb/s InfiniBand per GPU). The predicted step assumes full overlap of traffic and compute:
``max(build + tokens, traffic time)``; "gathers" marks a row the traffic bounds. The merged
layer's all-gather is on the critical path (the layer waits for it), so the last column gives
the step with the merged all-gathers exposed and the rest of the traffic (endpoint gathers,
prefetched; reduce-scatters) overlapped: ``all-gather time + max(build + tokens, rest's time)``.

    python benchmarks/scale.py            # the tables of docs/scale.md
    python benchmarks/scale.py --tokens 8192
    python benchmarks/scale.py --objective labels

The model is checked against the measurement it is calibrated on (printed first; that step
trained toward the labels, so the calibration always models ``labels``): it is a projection, to
be replaced by measurements at 7B and 70B when GPUs are lent.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from hf_lmc.config.options import OBJECTIVES, LearnOptions
from hf_lmc.evaluation.head_loss import SLICE_BYTES

try:  # run as a module (python -m benchmarks.scale) or as a script
    from benchmarks.record import new_record, settings_of, write
except ImportError:  # pragma: no cover - script form
    from record import new_record, settings_of, write

GB = 1e9
MEASURED = {
    "shape": "pythia-1.4b",
    "tokens": 2048,
    "seq": 512,
    "gpu_seconds": 0.197,
    "peak_gb": 14.81,
    "endpoint_bytes": 4,
    "objective": "labels",
}
INTRA_NODE, INTER_NODE = 300 * GB, 50 * GB  # assumed all-gather bandwidth per GPU (bytes/s)
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Shape:
    name: str
    d: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    gated: bool  # SwiGLU: three MLP matrices

    @property
    def head_dim(self) -> int:
        return self.d // self.heads

    @property
    def layer_params(self) -> int:
        attention = 2 * self.d * self.d + 2 * self.d * self.kv_heads * self.head_dim
        return attention + (3 if self.gated else 2) * self.d * self.ffn

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + 2 * self.vocab * self.d


SHAPES = {
    "pythia-1.4b": Shape("Pythia-1.4B", 2048, 24, 16, 16, 8192, 50304, False),
    "llama-1b": Shape("LLaMA-3.2-1B", 2048, 16, 32, 8, 8192, 128256, True),
    "llama-7b": Shape("LLaMA-2-7B", 4096, 32, 32, 32, 11008, 32000, True),
    "llama-70b": Shape("LLaMA-2-70B", 8192, 80, 64, 8, 28672, 32000, True),
}


def loss_bytes(s: Shape, tokens: int, objective: str, sliced: bool = True) -> float:
    """What the loss holds at its peak: one slice of the head's logits and its targets, and the
    gradients with respect to the hidden states and the head; or, ``sliced=False``, the whole
    logits as the loss held them before ``hf_lmc.evaluation.head_loss`` (the calibration step)."""
    ensemble = objective == "ensemble"
    gradients = (tokens * s.d + s.vocab * s.d) * 4  # with respect to the hidden states and the head, float32
    if not sliced:
        return tokens * s.vocab * (10 + (8 if ensemble else 0)) + gradients
    rows = min(tokens, max(1, SLICE_BYTES // (4 * s.vocab)))
    return rows * s.vocab * (12 if ensemble else 8) + gradients + (2 * tokens * s.d * 4 if ensemble else 0)


def memory(
    s: Shape, n: int, tokens: int, seq: int, b: int, offload: bool, objective: str, sliced: bool = True
) -> dict[str, float]:
    """Bytes per GPU, by term."""
    p = s.layer_params
    sharded = n > 1
    layers = 0 if offload else 2 * s.layers * p * b / (n if sharded else 1)
    transforms = 2 * (s.d**2 + s.layers * (s.kv_heads * s.head_dim**2 + s.ffn)) * 16
    loss = loss_bytes(s, tokens, objective, sliced)
    activations = s.layers * tokens * s.d * 2 + tokens * s.d * (34 + 5 * s.heads * seq / s.d) + loss
    return {
        "endpoint layers": layers,
        "embeddings, heads": 4 * s.vocab * s.d * b,
        "in flight": (2 * (2 + 2 + b) * p if sharded or offload else 0) + 3 * p * 4,
        "transforms, Adam": transforms,
        "activations": activations,
    }


def forwards(objective: str) -> int:
    """Forward passes' worth of token compute in one checkpointed step: forward, recomputation,
    backward at twice the forward; the ensemble objective adds one gradient-free forward per endpoint."""
    return 4 + (2 if objective == "ensemble" else 0)


def flops(s: Shape, tokens: int, objective: str) -> tuple[float, float]:
    """(weight build, token compute) FLOPs of one checkpointed dual step."""
    build = 3 * 2 * 2 * (s.d + s.head_dim) * (s.layers * s.layer_params + 2 * s.vocab * s.d)
    compute = forwards(objective) * 2 * tokens * (s.layers * s.layer_params + s.vocab * s.d)
    return build, compute


def throughput() -> float:
    """FLOP/s achieved by the measured step."""
    build, compute = flops(SHAPES[MEASURED["shape"]], MEASURED["tokens"], MEASURED["objective"])
    return (build + compute) / MEASURED["gpu_seconds"]


def times(s: Shape, n: int, tokens: int, b: int, offload: bool, objective: str) -> dict[str, float]:
    """Seconds and bytes of one step per GPU: the build (sharded over ``n`` > 1 processes), the
    tokens, the traffic by kind, and the predicted step, overlapped and with the merged all-gathers exposed."""
    build, compute = flops(s, tokens, objective)
    rate = throughput()
    lp = s.layers * s.layer_params
    share = (n - 1) / n  # of a collective's bytes that cross to or from one GPU
    gathers = 2 * (
        3 if objective == "ensemble" else 2
    )  # per endpoint: forward, recomputation (and the target's forward)
    endpoint = gathers * share * lp * 2  # gathered in bf16; 0 on one GPU
    if offload:  # host-to-device copies of every layer, each time it is gathered
        endpoint += gathers * lp * b / n
    # float32: a layer per build (forward, recomputation), and the gradients' reduce-scatters; the
    # token table is built at the batch's tokens, never gathered
    merged_gather = share * 2 * lp * 4
    merged = merged_gather + share * lp * 4
    # the head: gathered and its gradient reduce-scattered, or kept at each process's vocabulary
    # rows with every process's last hidden states gathered instead (the point's, and the ensemble
    # target's endpoints'), and their gradient reduce-scattered; the interpolant takes the cheaper
    positions = (2 + 2) * share * n * tokens * s.d * 4
    merged += min(2 * share * s.vocab * s.d * 4, positions)
    bandwidth = INTRA_NODE if n <= GPUS_PER_NODE else INTER_NODE
    # --shard-endpoints (n > 1): each process builds 1/n of every tensor's rows; n = 1 builds it all
    t_build, t_tokens = build / n / rate, compute / rate
    t_traffic = (endpoint + merged) / bandwidth
    t_gather = merged_gather / bandwidth
    return {
        "unsharded_build_s": build / rate,
        "build_s": t_build,
        "tokens_s": t_tokens,
        "endpoint_gathers_gb": endpoint / GB,
        "merged_gb": merged / GB,
        "traffic_s": t_traffic,
        "step_s": max(t_build + t_tokens, t_traffic),
        "step_exposed_s": t_gather + max(t_build + t_tokens, t_traffic - t_gather),
    }


def row(s: Shape, n: int, tokens: int, seq: int, b: int, offload: bool, objective: str) -> str:
    terms = memory(s, n, tokens, seq, b, offload, objective)
    total = sum(terms.values()) / GB
    t = times(s, n, tokens, b, offload, objective)
    compute = t["build_s"] + t["tokens_s"]
    fits = "yes" if total <= 80 else "no"
    dtype = "fp32" if b == 4 else "bf16"
    larger = "build" if t["build_s"] > t["tokens_s"] else "tokens"
    bound = " (gathers)" if t["traffic_s"] > compute else ""
    return (
        f"| {s.name} | {n} | {dtype}{', offloaded' if offload else ''} | {terms['endpoint layers'] / GB:.1f} | "
        f"{terms['embeddings, heads'] / GB:.1f} | {(terms['in flight'] + terms['transforms, Adam'] + terms['activations']) / GB:.1f} | "
        f"**{total:.1f}** | {fits} | {t['unsharded_build_s']:.2f} | "
        f"{t['build_s']:.2f} + {t['tokens_s']:.2f} = {compute:.2f} | "
        f"{t['endpoint_gathers_gb']:.0f} + {t['merged_gb']:.0f} GB, {t['traffic_s']:.2f} s | {larger} | "
        f"{t['step_s']:.2f}{bound} | {t['step_exposed_s']:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per GPU and step (default: 4 x 1024)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length")
    parser.add_argument(
        "--objective",
        default=LearnOptions().objective,
        choices=OBJECTIVES,
        help="what the step trains toward (default: the library's, %(default)s)",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        metavar="FILE",
        help="write the run's record to FILE (default: benchmarks/results/scale-<date>.json)",
    )
    args = parser.parse_args()

    m = SHAPES[MEASURED["shape"]]
    check = (
        sum(
            memory(
                m,
                1,
                MEASURED["tokens"],
                MEASURED["seq"],
                MEASURED["endpoint_bytes"],
                False,
                MEASURED["objective"],
                sliced=False,
            ).values()
        )
        / GB
    )
    print(
        f"Calibration: {MEASURED['shape']}, {MEASURED['tokens']} tokens, fp32 endpoints, one H100: "
        f"{throughput() / 1e12:.0f} TFLOP/s achieved ({MEASURED['gpu_seconds'] * 1e3:.0f} ms of GPU work); "
        f"memory model {check:.2f} GB against {MEASURED['peak_gb']} GB measured ({check / MEASURED['peak_gb'] - 1:+.0%}).\n"
    )
    print(
        f"{args.tokens} tokens per GPU and step (sequences of {args.seq}); dual matching, objective {args.objective}, "
        "layer checkpointing, bf16 autocast.\n"
    )
    print(
        "| pair | GPUs | endpoints | endpoint layers (GB) | embeddings, heads (GB) | step working set (GB) "
        "| total per GPU (GB) | fits 80 GB | unsharded build (s) | step (s): build + tokens "
        "| gathers per GPU and step: endpoints + merged | larger: build or tokens "
        "| predicted step (s): max(build + tokens, gathers) | merged all-gathers exposed (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    record = new_record("scale", settings_of(args))
    record.update(calibration_gb=check, measured=MEASURED, rows=[], steps=[], summary=[])
    for key in ("llama-1b", "llama-7b", "llama-70b"):
        s = SHAPES[key]
        for n in (1, 8, 64):
            for b, offload in ((4, False), (4, True), (2, False), (2, True)):
                if offload and n == 1:
                    continue  # offload needs the FSDP2 shards of a launch of 2 or more processes
                record["rows"].append(row(s, n, args.tokens, args.seq, b, offload, args.objective))
                t = times(s, n, args.tokens, b, offload, args.objective)
                record["steps"].append(dict(pair=s.name, gpus=n, endpoint_bytes=b, offload=offload, **t))
                print(record["rows"][-1])
    print("\nSharded build, endpoints kept on the GPUs (fp32 or bf16: the same times):")
    for key in ("llama-1b", "llama-7b", "llama-70b"):
        s = SHAPES[key]
        for n in (8, 64):
            t = times(s, n, args.tokens, 2, False, args.objective)
            compute = t["build_s"] + t["tokens_s"]
            bound = (
                "the gathers"
                if t["traffic_s"] > compute
                else "the build"
                if t["build_s"] > t["tokens_s"]
                else "the tokens"
            )
            record["summary"].append(
                f"{s.name}, {n} GPUs: build {t['build_s']:.2f} s (unsharded {t['unsharded_build_s']:.2f}), "
                f"tokens {t['tokens_s']:.2f} s, traffic {t['traffic_s']:.2f} s; step {t['step_s']:.2f} s "
                f"({t['step_exposed_s']:.2f} with the merged all-gathers exposed), bound by {bound}"
            )
            print(f"- {record['summary'][-1]}")
    print(f"\nwritten to {write(record, args.json)}", file=sys.stderr)


if __name__ == "__main__":
    main()
