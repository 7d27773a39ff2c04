"""The run config: the "torrent file" of a training run.

Every volunteer of a run loads the same YAML; its canonical hash names the run
(``run_id = f"{name}-{hash[:8]}"``) and prefixes every DHT key and RPC namespace,
so volunteers with a different config never mix.

Only fields that change what is trained enter the hash: the bootstrap peers and
the timeouts are local, operational choices and can differ between volunteers.

The sections are strict models (config_base.py); the ``model`` section is in model_config.py, the
``averaging`` section and its parts in averaging_config.py, both exported from here as well.
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from swarm.run.averaging_config import (  # noqa: F401  (re-exported: the run config's names live here)
    EDGE_MODES, AveragingConfig, ExchangeConfig, GraphConfig, InfluenceConfig,
)
from swarm.run.config_base import CrossFieldError, Strict
from swarm.run.model_config import ModelConfig  # noqa: F401  (re-exported)

RUN_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,47}$"
HASH_EXCLUDED_FIELDS = frozenset({"bootstrap_peers", "timeouts"})
_HASH_MEMO = "_config_hash_memo"  # RunConfig.config_hash: (id of the object it was computed for, the hash)
# Fields added after runs existed count in the run id only when set: a run that does not use them keeps
# its id, so clients before and after them still train together.
HASH_WHEN_SET = {("training", "end_at_target"): False, ("training", "sample_budget"): 0,
                 ("training", "in_flight_max"): 16, ("training", "wire_codec"): None, ("training", "wire_rank"): 8,
                 ("averaging", "pull_budget"): 0.0,
                 # model.kind llama and the token sources (swarm/run/llama.py, swarm/run/tokens.py)
                 ("model", "n_kv_heads"): None, ("model", "ffn_dim"): None, ("model", "multiple_of"): 64,
                 ("model", "rope_theta"): 10000.0, ("model", "rms_norm_eps"): 1e-5,
                 ("model", "tie_embeddings"): False, ("model", "mixed_precision"): "none",
                 ("model", "activation_checkpointing"): False,
                 ("data", "tokenizer"): None, ("data", "tokenizer_sha256"): None, ("data", "token_dtype"): "uint16",
                 ("integrity", "spot_share"): 0.03,
                 # runs before identity work had none; the default asks for it, so every run's id changed with it
                 # (clients before it would be invisible to clients after it: a new id says so instead)
                 ("integrity", "identity_bits"): 0,
                 # a backward's computation changed with it (a referee recomputes it so): clients before it, whose
                 # referees would recompute a stashed backward their way, are another run
                 ("training", "weight_stashing"): False, ("training", "weight_prediction"): 0.0}
# Fields removed after runs existed still enter the run id at the value every run had (the direction check's,
# removed with it: no shipped config set them), so clients before and after the removal still train together.
HASH_REMOVED = {("integrity", "ascent_cosine"): -0.25, ("integrity", "ascent_min_updates"): 64}
DEFAULT_IDENTITY_BITS = 8
DEFAULT_WIRE_RANK = HASH_WHEN_SET[("training", "wire_rank")]
WIRE_CODECS = ("float32", "float16", "int8", "lowrank")  # swarm/pipeline/transport/codecs.py, swarm/pipeline/transport/wire.py


class DataConfig(Strict):
    source: Literal["digits", "text", "npz", "tokens", "text_files"] = "digits"
    path: str | None = Field(None, description="an .npz file with arrays X and y, or a text file / folder; tokens: "
                             "a folder with train.bin and val.bin (test.bin optional); text_files: a folder of "
                             ".txt / .jsonl files")
    test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    validation_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="share of the data set held out of "
                                       "training (never the test split) to compare copies on: best-model exchange")
    split_seed: int = 0
    shards: int = Field(8, ge=1, le=4096)
    partition: Literal["iid", "label_skewed"] = "iid"
    classes_per_shard: int = Field(8, ge=1)
    max_text_bytes: int = Field(2_000_000, ge=1024, description="cap on the text corpus read for charlm")
    sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="text: the sha256 of the corpus "
                               "bytes read, so the run id identifies the data (a volunteer whose file differs "
                               "is refused)")
    tokenizer: str | None = Field(None, description="llama: a tokenizer.json (a byte-level BPE, `volunteer "
                                  "tokenizer train`); unset: the one shipped with the client (swarm/run/corpus/)")
    tokenizer_sha256: str | None = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="llama: the sha256 of "
                                         "the tokenizer file, so the run id names the tokenizer")
    token_dtype: Literal["uint16", "uint32"] = Field("uint16", description="tokens: the dtype of the .bin files "
                                                     "(uint16 for vocabularies up to 65536)")

    @model_validator(mode="after")
    def _token_sources_have_a_path(self) -> "DataConfig":
        if self.source in ("tokens", "text_files") and self.path is None:
            what = "train.bin and val.bin" if self.source == "tokens" else ".txt or .jsonl files"
            raise CrossFieldError(("path", "source"), f"data.source {self.source} reads a folder: set data.path to "
                                  f"a folder of {what}")
        return self

    @model_validator(mode="after")
    def _splits_leave_training_data(self) -> "DataConfig":
        if self.test_fraction + self.validation_fraction >= 0.9:
            raise CrossFieldError(("test_fraction", "validation_fraction"),
                                  f"test_fraction ({self.test_fraction}) + validation_fraction "
                                  f"({self.validation_fraction}) leave less than 10 % of the data to train on")
        return self


class OptimizerConfig(Strict):
    """Every stage server steps its copy with this. The default is the robust choice for asynchronous
    updates: Adam at 1e-3 converged with stale gradients where SGD with momentum 0.9 at 0.05 diverged
    (in simulation, and in real swarms on a busy CPU: benchmarks/staleness.py); stale steps are scaled
    down either way (``staleness``)."""

    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: float = Field(0.001, gt=0.0)
    momentum: float = Field(0.9, ge=0.0, lt=1.0, description="sgd only")
    weight_decay: float = Field(0.0, ge=0.0)
    staleness: Literal["none", "divide", "momentum", "divide_momentum"] = Field(
        "divide_momentum", description="divide: the step of a gradient tau updates stale (tau > "
        "staleness_tolerance) is scaled by staleness_tolerance / tau (Zhang et al. 2016); momentum: SGD's momentum "
        "gives up the share of its horizon the mean staleness takes (Mitliagkas et al. 2016); divide_momentum: "
        "both; none: every step in full, with the run's momentum (swarm/pipeline/stage/staleness.py)")
    staleness_tolerance: int = Field(1, ge=1, le=100_000, description="gradients at most this many updates stale "
                                     "take the full step")


class TrainingConfig(Strict):
    batch_size: int = Field(32, ge=1, le=65536)
    in_flight: Annotated[int, Field(ge=1, le=256)] | Literal["auto"] = Field(
        4, description="micro-batches in flight per driver; auto: enough to cover the measured round trip x "
        "throughput, up to in_flight_max (swarm/pipeline/control/depth.py)")
    in_flight_max: int = Field(16, ge=1, le=256, description="in_flight auto: at most this many (memory and "
                               "staleness bound; a stage also serves one driver at most "
                               "integrity.max_in_flight_per_requester at once)")
    wire_dtype: Literal["float32", "float16"] = Field("float32", description="older name of wire_codec for its "
                                                      "float codecs; kept so that older configs keep their run id")
    wire_codec: Literal["float32", "float16", "int8", "lowrank"] | None = Field(
        None, description="how activations and gradients cross stage boundaries: float32, float16, int8 (blockwise "
        "absmax, ~1/4 of float32's bytes) or lowrank (rank-wire_rank int8 factors per micro-batch); unset: wire_dtype")
    wire_rank: int = Field(DEFAULT_WIRE_RANK, ge=1, le=4096, description="lowrank: the rank of the factors sent "
                           "per micro-batch")
    max_payload_mb: float = Field(256.0, gt=0.0, description="largest tensor payload a stage accepts")
    eval_every_s: float = Field(10.0, gt=0.0)
    target_accuracy: float = Field(0.95, gt=0.0, le=1.0, description="classifiers: the demo stops at this test "
                                   "accuracy")
    target_bits_per_byte: float = Field(2.5, gt=0.0, description="language models: the demo stops once the test "
                                        "loss is this many bits per byte or fewer")
    end_at_target: bool = Field(False, description="the run is complete once a published test evaluation reaches "
                                "target_accuracy (classifiers) or target_bits_per_byte (language models): every "
                                "volunteer pauses, takes no more work and says so (swarm/dht/completion.py)")
    sample_budget: int = Field(0, ge=0, description="the run is complete once a layer0 copy has trained this many "
                               "samples; 0: no budget")
    weight_stashing: bool = Field(True, description="a stage's backward computes with the weights its forward ran "
                                  "with (PipeDream's weight stashing): the gradient of the weights that made the "
                                  "activations; false: the input gradient with the weights of the backward's time")
    weight_prediction: float = Field(0.0, ge=0.0, le=4.0, description="a forward computes with its stage's weights "
                                     "extrapolated along the last update by this many times the stage's staleness "
                                     "(swarm/integrity/prediction.py); 0: off; needs weight_stashing")
    @model_validator(mode="after")
    def _prediction_stashes(self) -> TrainingConfig:
        if self.weight_prediction and not self.weight_stashing:
            raise CrossFieldError(("weight_prediction", "weight_stashing"), "training.weight_prediction needs "
                                  "training.weight_stashing (the backward computes with the predicted weights): "
                                  "set weight_stashing: true or weight_prediction: 0")
        return self

    @field_validator("in_flight", mode="before")
    @classmethod
    def _in_flight(cls, value: object) -> object:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 256):
            return value
        raise ValueError("in_flight is a whole number from 1 to 256 or 'auto'; write e.g. 4, or "
                         "auto to let the driver cover the measured round trip")

    @model_validator(mode="before")
    @classmethod
    def _one_codec(cls, data: object) -> object:
        """wire_codec float32/float16 is stored as wire_dtype (one run id for both spellings); wire_dtype
        float16 with a framed wire_codec is a contradiction the user resolves."""
        if not isinstance(data, dict) or data.get("wire_codec") is None:
            return data
        codec, dtype = data["wire_codec"], data.get("wire_dtype", "float32")
        if codec in ("float32", "float16"):
            if dtype not in (codec, "float32"):  # the shipped configs spell out the default
                raise CrossFieldError(("wire_codec", "wire_dtype"), f"training.wire_codec ({codec}) and "
                                      f"training.wire_dtype ({dtype}) disagree: remove training.wire_dtype "
                                      "(wire_codec replaces it)")
            return {**data, "wire_dtype": codec, "wire_codec": None}
        if dtype != "float32":
            raise CrossFieldError(("wire_codec", "wire_dtype"), f"training.wire_codec ({codec}) and "
                                  f"training.wire_dtype ({dtype}) disagree: remove training.wire_dtype "
                                  "(wire_codec replaces it)")
        return data

    @property
    def codec(self) -> str:
        """The codec in effect: wire_codec, or wire_dtype for configs that predate it."""
        return self.wire_codec or self.wire_dtype


class IntegrityConfig(Strict):
    """The run's immune system (swarm/integrity/): how far one peer can move a copy, and when a copy is
    sick. Every bound is a pure function of these numbers, unit-tested in tests/test_integrity_*.py."""

    # bounded influence: what one update may do to a copy
    clip_multiplier: float = Field(3.0, gt=1.0, le=1000.0, description="an update's gradient norm is clipped "
                                   "to this many times the median norm of the recently accepted updates")
    clip_history: int = Field(64, ge=8, le=100_000, description="accepted update norms the clip bound is taken from")
    max_step_ratio: float = Field(0.05, gt=0.0, le=1.0, description="one update moves each parameter tensor by at "
                                  "most this fraction of its norm")
    # who may ask, and how much: fair share, strikes and bans (swarm/integrity/requesters.py)
    fair_share_slack: float = Field(2.0, ge=1.0, le=100.0, description="a driver may apply at most this many times "
                                    "the mean number of updates of the other drivers at this stage (per window)")
    fair_share_window_s: float = Field(10.0, gt=0.0, le=3600.0, description="the window the fair share is counted in")
    fair_share_burst: int = Field(32, ge=1, le=100_000, description="updates per window any driver may always apply")
    probation_updates: int = Field(64, ge=0, le=100_000, description="a driver's first updates at a stage, while "
                                   "others have trained it longer, are held to probation_share (0: no probation)")
    probation_share: float = Field(0.25, gt=0.0, le=100.0, description="a driver on probation may apply at most this "
                                   "many times the established drivers' mean number of updates (per window)")
    max_in_flight_per_requester: int = Field(16, ge=1, le=4096, description="requests of one driver computed or "
                                             "queued at a stage at once; more are answered busy")
    ban_strikes: float = Field(10.0, gt=0.0, description="a driver is banned when its decaying strike score (one per "
                               "rejected or heavily clipped request) reaches this")
    strike_half_life_s: float = Field(30.0, gt=0.0, description="strikes decay with this half-life")
    ban_s: float = Field(60.0, ge=0.0, description="first ban; each further ban of the same driver doubles it")
    max_ban_s: float = Field(3600.0, ge=0.0, description="cap on a ban")
    # health and healing: when a copy is sick, and how it recovers
    snapshot_every_steps: int = Field(200, ge=1, description="a healthy copy keeps a last-good snapshot this often")
    loss_explode_ratio: float = Field(4.0, gt=1.0, description="sick when the loss EMA exceeds this many times "
                                      "its healthy baseline")
    heal_lr_scale: float = Field(0.3, gt=0.0, le=1.0, description="after healing, the step size is scaled by this")
    heal_steps: int = Field(200, ge=0, description="for this many updates after healing")
    # spot validation by replication (swarm/integrity/spot.py)
    spot_share: float = Field(0.03, ge=0.0, le=1.0, description="the share of hops a driver also sends to a second "
                              "peer of the swarm (forwards and gradients) and of stage-0 outputs a layer1 peer has "
                              "recomputed by other layer0 peers, to compare; each check costs one more computation")
    # identities that cost something (swarm/integrity/identity_work.py)
    identity_bits: int = Field(DEFAULT_IDENTITY_BITS, ge=0, le=20, description="leading zero bits of the proof of "
                               "work each peer id publishes: 2^bits scrypt evaluations (1 MiB, ~5 ms each) to find, "
                               "once per identity (8: about a second of one core); readers ignore the records of "
                               "peers without it. 0: none")


class TimeoutsConfig(Strict):
    heartbeat_s: float = Field(5.0, gt=0.0, le=600.0)
    record_ttl_heartbeats: float = Field(3.0, ge=1.5, le=20.0)
    others_every_heartbeats: int = Field(5, ge=1, le=100, description="a peer that drives nothing reads the "
                                         "other swarms' records every this many heartbeats (its own every one)")
    dht_start_s: float = Field(60.0, gt=0.0)
    rpc_s: float = Field(30.0, gt=0.0)
    join_s: float = Field(60.0, gt=0.0, description="how long to look for the swarm before giving up")
    # the driver's hops (swarm/pipeline/control/routing.py, swarm/pipeline/control/hops.py): a peer that never answers is routed around in seconds
    hop_timeout_factor: float = Field(4.0, ge=1.0, le=100.0, description="a hop times out after this many times "
                                      "the swarm's measured p95 service time of that op (at most rpc_s)")
    hop_timeout_floor_s: float = Field(1.0, gt=0.0, description="no hop times out sooner than this")
    first_contact_s: float = Field(5.0, gt=0.0, description="timeout of a hop to a peer never measured "
                                   "(at most rpc_s); each timeout in a row doubles the next one, up to rpc_s")
    hedge_factor: float = Field(2.5, ge=1.0, le=100.0, description="ops that apply no update (forward, infer, "
                                "evaluate) are sent to a second peer after this many times the expected time")
    reply_max_abs: float = Field(1e6, gt=0.0, description="a reply tensor with a larger absolute value is a "
                                 "bad reply (that peer's failure), never used")
    reject_backoff_max_s: float = Field(30.0, gt=0.0, description="cap of the driver's exponential backoff while "
                                        "the next stage rejects our micro-batches")

    @property
    def record_ttl_s(self) -> float:
        return self.heartbeat_s * self.record_ttl_heartbeats


# the fair share of label-skewed runs where the config leaves it unset (RunConfig._skewed_runs_balance_their_drivers)
SKEWED_FAIR_SHARE = {"fair_share_slack": 1.1, "fair_share_burst": 8, "fair_share_window_s": 5.0}


class RunConfig(Strict):
    name: str = Field(pattern=RUN_NAME_PATTERN)
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    training: TrainingConfig = TrainingConfig()
    averaging: AveragingConfig = AveragingConfig()
    integrity: IntegrityConfig = IntegrityConfig()
    timeouts: TimeoutsConfig = TimeoutsConfig()
    bootstrap_peers: list[str] = Field(default_factory=list)

    @field_validator("bootstrap_peers")
    @classmethod
    def _maddrs_are_peer_addresses(cls, peers: list[str]) -> list[str]:
        from swarm.dht.maddrs import PEER_MADDR_SHAPE, peer_maddr_problem

        for maddr in peers:
            problem = peer_maddr_problem(maddr)
            if problem:
                raise ValueError(f"{maddr!r} is not a peer address: {problem}. A peer address has the shape "
                                 f"{PEER_MADDR_SHAPE}; `volunteer bootstrap` prints the one to pass")
        return peers

    @model_validator(mode="before")
    @classmethod
    def _skewed_runs_balance_their_drivers(cls, values: Any) -> Any:
        """On label-skewed shards the fair share is also what keeps the classes balanced: the stages after stage 0
        learn every driver's classes, each at the rate its driver applies updates. With the IID defaults (2x the
        other drivers' mean per 10 s, 32 free per window) a driver that a busy machine starved for a few seconds
        let the other one's classes take over the shared stages (measured: the worst chain 0.70 of one process at
        30k samples with 16 busy processes, SGD + momentum, 2 per swarm; the same run on IID shards 0.98).
        ``SKEWED_FAIR_SHARE`` is the default for the fields a label-skewed config leaves unset (0.95 in the same
        run, at half the samples per second: a starved driver's classes wait for it)."""
        if not isinstance(values, dict):
            return values
        data = values.get("data")
        partition = data.get("partition") if isinstance(data, dict) else getattr(data, "partition", None)
        integrity = values.get("integrity", {})
        if partition == "label_skewed" and isinstance(integrity, dict):
            values = {**values, "integrity": {**SKEWED_FAIR_SHARE, **integrity}}
        return values

    @model_validator(mode="after")
    def _shards_fit_classes(self) -> "RunConfig":
        if self.data.partition == "label_skewed" and self.data.classes_per_shard > self.model.num_classes:
            raise CrossFieldError(
                ("data.classes_per_shard", "data.partition", "model.num_classes"),
                f"data.classes_per_shard ({self.data.classes_per_shard}) exceeds model.num_classes "
                f"({self.model.num_classes})"
            )
        return self

    @model_validator(mode="after")
    def _llama_names_its_tokens(self) -> "RunConfig":
        model, data = self.model, self.data
        token_sources = ("text", "tokens", "text_files")
        if model.kind == "llama" and data.source not in token_sources:
            raise CrossFieldError(("data.source", "model.kind"), f"model.kind llama trains on text: set data.source "
                                  f"to one of {', '.join(token_sources)} (now {data.source})")
        if model.kind == "llama" and data.tokenizer_sha256 is None:
            raise CrossFieldError(("data.tokenizer_sha256", "data.tokenizer"), "model.kind llama: set "
                                  "data.tokenizer_sha256 to the sha256 of the tokenizer file (`sha256sum "
                                  "tokenizer.json`; `volunteer tokenizer train` prints it), so the run id names it")
        if data.source in ("tokens", "text_files") and model.kind != "llama":
            raise CrossFieldError(("data.source", "model.kind"), f"data.source {data.source} holds BPE tokens: "
                                  f"set model.kind llama (now {model.kind})")
        return self

    @model_validator(mode="after")
    def _exchange_has_validation_data(self) -> "RunConfig":
        if self.averaging.exchange.every_samples > 0 and self.data.validation_fraction <= 0:
            raise CrossFieldError(
                ("averaging.exchange.every_samples", "data.validation_fraction"),
                "best-model exchange compares copies on the validation split: set data.validation_fraction "
                "above 0 (e.g. 0.1) or averaging.exchange.every_samples to 0"
            )
        return self

    @model_validator(mode="after")
    def _edge_modes_are_the_optimizer(self) -> "RunConfig":
        mode, opt = self.averaging.mode, self.optimizer
        if mode in EDGE_MODES and (opt.name != "sgd" or opt.momentum != 0.0):
            raise CrossFieldError(
                ("averaging.mode", "optimizer.name", "optimizer.momentum"),
                f"averaging.mode {mode} is the optimizer itself (its local step uses optimizer.lr as the step "
                f"size): set optimizer.name: sgd and optimizer.momentum: 0 (now {opt.name}, momentum {opt.momentum})"
            )
        return self

    # ----- identity
    def canonical(self) -> dict:
        """The fields that define what is trained, as plain JSON-able data."""
        data = self.model_dump(mode="json", exclude=set(HASH_EXCLUDED_FIELDS))
        for (section, name), default in HASH_WHEN_SET.items():
            if data.get(section, {}).get(name) == default:
                del data[section][name]
        return data

    @property
    def config_hash(self) -> str:
        """Of the canonical fields, and of the removed ones at the value every run had (HASH_REMOVED): not part of
        ``canonical()``, which is published as a config others load, and a config that sets them is refused.

        Computed once per object (the model is frozen): a pushed micro-batch read ``run_id`` for every receipt of its
        trail, 0.04-0.14 ms each. The memo names the object it was made for, so the copy ``model_copy(update=...)``
        makes (it copies ``__dict__``, the memo with it) computes its own."""
        memo = self.__dict__.get(_HASH_MEMO)
        if memo is not None and memo[0] == id(self):
            return memo[1]
        data = self.canonical()
        for (section, name), value in HASH_REMOVED.items():
            data.setdefault(section, {})[name] = value
        blob = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
        digest = hashlib.sha256(blob).hexdigest()
        self.__dict__[_HASH_MEMO] = (id(self), digest)
        return digest

    @property
    def run_id(self) -> str:
        return f"{self.name}-{self.config_hash[:8]}"

    @property
    def swarm_names(self) -> list[str]:
        return [f"layer{k}" for k in range(self.model.stages)]


def config_differences(mine: dict, theirs: dict, prefix: str = "") -> list[str]:
    """Human-readable field differences between two canonical configs (for 'different run' errors)."""
    out: list[str] = []
    for key in sorted(set(mine) | set(theirs)):
        path = f"{prefix}{key}"
        a, b = mine.get(key, "<missing>"), theirs.get(key, "<missing>")
        if isinstance(a, dict) and isinstance(b, dict):
            out.extend(config_differences(a, b, prefix=f"{path}."))
        elif a != b:
            out.append(f"{path}: ours {a!r}, theirs {b!r}")
    return out
