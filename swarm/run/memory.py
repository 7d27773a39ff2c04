"""The accelerator memory one stage of a run needs, computed from the run config alone (``volunteer doctor``).

A stage server holds, per parameter: the float32 weight (4 bytes), its gradient (4), the optimizer's state
(Adam/AdamW: 8; SGD with momentum: 4) and the step guard's copy of weights and optimizer state
(swarm/integrity/guard.py: an update that would go non-finite is undone from it; Adam's state is copied one step in
50 and freed after, counted here since a peak is what must fit). Per micro-batch in flight
(a forward's graph waits in the activation cache for its backward; the last stage runs forward and backward
at once, so one) it holds the tensors autograd saved: counted per token and per decoder layer for llama from
what each op keeps (llama.py), in bf16 where autocast computes in bf16, plus under bf16 autocast the bf16
copies of the weights each forward makes. The last stage adds its final norm and, since its head and loss are one
step (swarm/run/fused_loss.py), the gradients that step computes (the hidden states' and the head weight's) and one
chunk of logits, where it held all of them and their log-softmax (2 x 4 bytes x vocabulary per token). The counts
were checked against the tensors torch actually saves (tests/test_memory.py); a GPU adds its CUDA context and
the allocator's slack, which ``CUDA_OVERHEAD_BYTES`` stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from swarm.run.fused_loss import CHUNK_BYTES
from swarm.run.runconfig import ModelConfig, RunConfig

FLOAT32_BYTES, BF16_BYTES, INT64_BYTES = 4, 2, 8
CUDA_OVERHEAD_BYTES = 1 << 30  # the CUDA context and the caching allocator's fragmentation, roughly
OPTIMIZER_STATE_FLOATS = {"adam": 2, "adamw": 2, "sgd": 1}  # sgd: its momentum buffer (none at momentum 0)


@dataclass(frozen=True, slots=True)
class StageMemory:
    index: int
    params: int
    weights_bytes: int  # float32 weights and their gradients
    optimizer_bytes: int  # the optimizer's state
    guard_bytes: int  # the step guard's copy of weights and optimizer state
    activation_bytes: int  # of one micro-batch
    micro_batches: int  # held at once
    overhead_bytes: int  # CUDA context and allocator slack (0 on a CPU)
    stash_bytes: int = 0  # weight stashing: the float32 weights the older micro-batches' forwards ran with

    @property
    def total_bytes(self) -> int:
        return (self.weights_bytes + self.optimizer_bytes + self.guard_bytes
                + self.activation_bytes * self.micro_batches + self.overhead_bytes + self.stash_bytes)


def lanes_cap(run: RunConfig) -> int:
    """Lanes a driver runs, so the micro-batches it keeps in flight: ``in_flight``, or with ``auto`` the most it may
    use (``in_flight_max``, and no more than a stage serves one driver at once). The driver's (control/driver.py)
    and what a stage's memory is sized for."""
    training = run.training
    return int(training.in_flight) if training.in_flight != "auto" else \
        max(1, min(training.in_flight_max, run.integrity.max_in_flight_per_requester))


def layer_params(model: ModelConfig) -> int:
    head_dim = model.d_model // model.n_heads
    attention = 2 * model.d_model * model.n_heads * head_dim + 2 * model.d_model * model.kv_heads * head_dim
    return attention + 3 * model.d_model * model.llama_ffn_dim + 2 * model.d_model


def stage_params(model: ModelConfig, index: int) -> int:
    """Parameters of llama stage ``index``, from the config alone (equal to the built module's count)."""
    count = model.blocks_per_stage * layer_params(model)
    if index == 0:
        count += model.vocab_size * model.d_model
    if index == model.stages - 1:
        count += model.d_model + model.vocab_size * model.d_model
    return count


def activation_bytes(model: ModelConfig, index: int, batch: int, bf16: bool) -> int:
    """Bytes autograd keeps for one micro-batch of ``batch`` sequences through llama stage ``index``."""
    width, ffn, tokens = model.d_model, model.llama_ffn_dim, batch * model.seq_len
    if model.activation_checkpointing:
        per_layer = FLOAT32_BYTES * width  # each block keeps only its input; one block's worth is rebuilt at a time
        recompute = _layer_bytes(width, ffn, bf16)
    else:
        per_layer, recompute = _layer_bytes(width, ffn, bf16), 0
    per_token = model.blocks_per_stage * per_layer + recompute + FLOAT32_BYTES * width  # + the output kept
    if index == 0:
        per_token += INT64_BYTES  # the token ids
    fused = 0
    if index == model.stages - 1:  # final norm and the hidden states' gradient; the head weight's and one chunk
        per_token += 4 * FLOAT32_BYTES * width
        fused = FLOAT32_BYTES * model.vocab_size * width + min(CHUNK_BYTES, tokens * FLOAT32_BYTES * model.vocab_size)
    weight_casts = BF16_BYTES * (stage_params(model, index) - (model.vocab_size * width if index == 0 else 0)) \
        if bf16 else 0
    return tokens * per_token + weight_casts + fused


def _layer_bytes(width: int, ffn: int, bf16: bool) -> int:
    """Per token, one decoder layer: the two RMSNorms keep their float32 input and normalised input; the
    projections keep their inputs (under autocast, one bf16 cast per projection), attention its q, k, v (k and v
    repeated to every head) and output, o_proj its input, SwiGLU its gate, up, silu and product."""
    norms = 2 * 2 * FLOAT32_BYTES * width
    if bf16:
        return norms + BF16_BYTES * (5 * width + 4 * width + width + 4 * ffn)
    return norms + FLOAT32_BYTES * (2 * width + 4 * width + width + 4 * ffn)


def stage_memory(run: RunConfig, index: int, cuda: bool = True) -> StageMemory:
    """What stage ``index`` needs on a CUDA device (``cuda=False``: on the CPU, float32, no CUDA overhead)."""
    model = run.model
    if model.kind != "llama":
        raise ValueError(f"the memory estimate covers model.kind llama (this run's is {model.kind})")
    params = stage_params(model, index)
    floats = OPTIMIZER_STATE_FLOATS[run.optimizer.name]
    if run.optimizer.name == "sgd" and run.optimizer.momentum == 0:
        floats = 0
    optimizer = FLOAT32_BYTES * floats * params
    in_flight = lanes_cap(run)
    bf16 = cuda and model.mixed_precision == "bf16"
    from swarm.integrity.weights import STASHED_VERSIONS_MAX

    last = index == model.stages - 1
    # stashing: every forward awaiting its backward but the newest holds an older version; weight prediction: every
    # one holds its own predicted copy (swarm/pipeline/stage/predicting.py), the newest too
    stashed = 0 if last or not run.training.weight_stashing else \
        min(in_flight, STASHED_VERSIONS_MAX) - (0 if run.training.weight_prediction else 1)
    return StageMemory(
        index=index, params=params, weights_bytes=2 * FLOAT32_BYTES * params, optimizer_bytes=optimizer,
        guard_bytes=FLOAT32_BYTES * params + optimizer,
        activation_bytes=activation_bytes(model, index, run.training.batch_size, bf16),
        micro_batches=1 if last else in_flight,
        overhead_bytes=CUDA_OVERHEAD_BYTES if cuda else 0, stash_bytes=FLOAT32_BYTES * params * stashed,
    )


# ----- host memory (every run kind): what a stage server keeps beside its live copy


@dataclass(frozen=True, slots=True)
class HostMemory:
    """Host bytes a stage server holds for stage ``index``, by what the code keeps (tests/test_memory.py measures the
    tensors a trained stage actually holds against it). On a GPU the live copy and the guard's live on the device
    (``stage_memory``); the referee's ring is host memory wherever the stage computes, and a node keeps healing's
    snapshots in files (``disk_bytes``: swarm/integrity/snapshots.py)."""

    index: int
    params: int
    live_bytes: int  # float32 weights, gradients and the optimizer's state (on the GPU for a CUDA stage)
    guard_bytes: int  # the step guard's one-tensor scratch (and SGD's momentum); its copy of the weights is the ring's
    guard_peak_bytes: int  # + Adam's state, copied 1 step in 50 (swarm/integrity/guard.py) and freed after
    snapshot_bytes: int  # healing: the last good snapshot with optimizer state, the one before it as weights only
    # (bfloat16: swarm/integrity/heal.py SNAPSHOT_DTYPE), where they are kept in memory (0 on a node: on disk)
    ring_bytes: int  # committed (exact) versions a referee may ask for (swarm/integrity/weights.py), at their bound
    ring_bytes_gpu: int  # the same beside a GPU, whose current version is a host copy too (one more)
    disk_bytes: int = 0  # healing's two snapshot files on a node (swarm/integrity/snapshots.py), each with its moments
    ring_max_bytes: int = 0  # the ring grown as far as referees asking for dropped versions take it (RING_COPIES_MAX),
    # with the versions referees pinned for their audits over it (PIN_MAX, for 20 s at most)
    ring_max_bytes_gpu: int = 0  # the same beside a GPU (one copy more)
    stash_max_bytes: int = 0  # weight stashing: versions forwards' graphs hold past the ring's bound, at most
    # (STASHED_VERSIONS_MAX: the ring's copies are those versions while it keeps them); with weight prediction the
    # graphs' predicted copies (never the ring's) and the predictor's latest
    predict_bytes: int = 0  # weight prediction: the predicted copies forwards in flight hold whenever they are (one
    # each, up to in_flight; part of stash_max_bytes)

    @property
    def total_bytes(self) -> int:
        return self.live_bytes + self.guard_bytes + self.snapshot_bytes + self.ring_bytes

    def ring_max(self, gpu: bool) -> int:
        return self.ring_max_bytes_gpu if gpu else self.ring_max_bytes

    @property
    def fixed_bytes(self) -> int:
        """What does not grow with the stage: the ring's floor (RING_MIN_BYTES) beyond its RING_COPIES copies."""
        from swarm.integrity.weights import RING_MIN_BYTES

        return max(0, RING_MIN_BYTES - self.ring_copies_bytes) if self.ring_bytes == RING_MIN_BYTES else 0

    @property
    def ring_copies_bytes(self) -> int:
        from swarm.integrity.weights import RING_COPIES

        return int(RING_COPIES * FLOAT32_BYTES * self.params * _commit_share())

    @property
    def per_param(self) -> float:
        """Bytes per stage parameter beyond ``fixed_bytes``."""
        return (self.total_bytes - self.fixed_bytes) / self.params if self.params else 0.0


def host_memory(run: RunConfig, index: int, snapshots_on_disk: bool = True) -> HostMemory:
    """What stage ``index`` of ``run`` keeps on a CPU volunteer (healing, receipts and the ring on): the live copy and
    the guard's in float32, committed versions as computed with (float32), and healing's snapshots in bfloat16, in
    files where a node keeps them (``snapshots_on_disk``: a volunteer; False: in memory, a stage built in-process
    without a folder for them)."""
    from swarm.integrity.weights import PIN_MAX, RING_COPIES, RING_COPIES_MAX, RING_MIN_BYTES, STASHED_VERSIONS_MAX

    params, largest = _param_counts(run.model, index)
    floats = OPTIMIZER_STATE_FLOATS[run.optimizer.name]
    if run.optimizer.name == "sgd" and run.optimizer.momentum == 0:
        floats = 0
    weights = FLOAT32_BYTES * params
    optimizer = floats * weights
    adam = run.optimizer.name in ("adam", "adamw")
    # the guard's pre-step copy of the weights is the ring's latest version (the weights the update op committed
    # and computed with: swarm/integrity/guard.py ``kept``), so it keeps its scratch (and SGD's momentum) only
    guard = FLOAT32_BYTES * largest + (0 if adam else optimizer)
    stashing = run.training.weight_stashing and index < run.model.stages - 1
    predicting = stashing and bool(run.training.weight_prediction)
    return HostMemory(
        index=index, params=params, live_bytes=2 * weights + optimizer, guard_bytes=guard,
        guard_peak_bytes=guard + (optimizer if adam else 0),
        snapshot_bytes=0 if snapshots_on_disk else (2 * weights + optimizer) // 2,
        ring_bytes=max(RING_MIN_BYTES, int(RING_COPIES * weights * _commit_share())),
        ring_bytes_gpu=max(RING_MIN_BYTES, int((RING_COPIES + 1) * weights * _commit_share())),
        disk_bytes=(weights + optimizer) if snapshots_on_disk else 0,
        ring_max_bytes=max(RING_MIN_BYTES, int(RING_COPIES_MAX * weights * _commit_share())) + PIN_MAX * weights,
        ring_max_bytes_gpu=max(RING_MIN_BYTES, int((RING_COPIES_MAX + 1) * weights * _commit_share())) +
        PIN_MAX * weights,
        stash_max_bytes=(STASHED_VERSIONS_MAX + predicting) * weights if stashing else 0,
        predict_bytes=min(lanes_cap(run), STASHED_VERSIONS_MAX) * weights if predicting else 0,
    )


def _param_counts(model: ModelConfig, index: int) -> tuple[int, int]:
    """(parameters of stage ``index``, of its largest tensor)."""
    if model.kind == "llama":
        width = model.d_model
        largest = max(model.vocab_size * width if index in (0, model.stages - 1) else 0,
                      model.llama_ffn_dim * width, width * width)
        return stage_params(model, index), largest
    from swarm.run.models import build_stage  # an MLP: small, built in milliseconds

    tensors = [p.numel() for p in build_stage(model, index).parameters()]
    return sum(tensors), max(tensors, default=0)


def held_bytes(worker: Any, healer: Any = None) -> int:
    """Bytes of the distinct tensor storages a stage server (a StageWorker, its Healer) keeps beside its activations:
    the live copy and its gradients, the optimizer's state, the guard's buffers, healing's snapshots, the referee's
    ring. What ``host_memory`` estimates (tests/test_memory.py, benchmarks/footprint.py)."""
    import torch

    params = list(worker.module.parameters())
    tensors = [*params, *(p.grad for p in params if p.grad is not None)]
    tensors += [v for state in worker.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    guard = worker.guard
    tensors += [*guard._param_buffers, *guard._state_buffers, *guard._scratch.values()]
    for snapshot in (() if healer is None else (healer._snapshot, healer._previous)):
        if snapshot is not None:  # in memory until its file is written (swarm/integrity/snapshots.py), or for good
            tensors += snapshot.tensors()
    tensors += [t for version in worker.ring._versions.values() for t in (version.tensors or {}).values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _commit_share() -> float:
    """A committed version's bytes over its float32 weights' (1: committed exactly, swarm/integrity/weights.py)."""
    from swarm.integrity.weights import COMMIT_DTYPE

    return 1.0 if COMMIT_DTYPE is None else COMMIT_DTYPE.itemsize / FLOAT32_BYTES
