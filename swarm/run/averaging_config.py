"""The ``averaging`` section of the run config: how a swarm keeps its copies together.

Its parts: ``ExchangeConfig`` (best-model exchange), ``InfluenceConfig`` (what one peer's copy or edge
message may do to ours), ``GraphConfig`` (the peer graph of the edge modes, ``EDGE_MODES``) and
``AveragingConfig``, the section itself. runconfig.py puts it in ``RunConfig`` and exports every name
here too.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from swarm.run.config_base import Strict


class ExchangeConfig(Strict):
    """Best-model exchange (NetTorrent): every ``every_samples`` local samples a peer pulls the copies of
    ``candidates`` random online peers of its swarm and scores them, and its own, on the run's
    validation split (swarm/averaging/validation.py); it adopts the best one if its validation loss
    beats ours by ``margin``. Nobody's self-reported loss decides."""

    every_samples: int = Field(0, ge=0, description="best-model exchange period; 0 disables it")
    margin: float = Field(0.02, ge=0.0, lt=1.0, description="relative validation-loss improvement needed to adopt")
    factor: float = Field(1.0, gt=0.0, le=1.0, description="1.0 replaces our weights")
    candidates: int = Field(2, ge=1, le=64, description="copies of other peers pulled and scored per exchange")
    validation_samples: int = Field(256, ge=1, le=1_000_000, description="validation samples (sequences for text) "
                                    "each copy is scored on: at most the validation split")


class InfluenceConfig(Strict):
    """What one peer's copy (a Dpwa pull, a best-model adoption) or edge message can do to ours
    (swarm/integrity/mixing.py). Distances are ``||theirs - ours||`` over the floating tensors; for ECL
    messages ``ours`` is the edge's dual. Ratios are fractions of our copy's norm."""

    max_step_ratio: float = Field(0.1, gt=0.0, le=1.0, description="one pull, adoption or edge message moves our "
                                  "copy (or an edge's dual) by at most this fraction of its norm")
    max_distance_ratio: float = Field(0.5, gt=0.0, description="a copy or message this far from ours (fraction of "
                                      "our norm) is no honest swarm peer's: rejected, its sender banned for ban_s")
    clip_multiplier: float = Field(3.0, gt=1.0, le=1000.0, description="a difference is clipped to this many times "
                                   "the median of the recently accepted ones (centered clipping)")
    outlier_multiplier: float = Field(10.0, gt=1.0, le=1e6, description="a difference this many times the median "
                                      "of the accepted ones is rejected, its sender banned for ban_s")
    history: int = Field(32, ge=4, le=100_000, description="accepted differences the median is taken over")
    min_history: int = Field(8, ge=1, le=100_000, description="until this many were accepted, only the ratio "
                             "limits apply (no clip or outlier test from the history)")
    floor_ratio: float = Field(0.01, ge=0.0, le=1.0, description="the median counts as at least this fraction of "
                               "our norm, so identical copies do not make every later difference an outlier")
    window_s: float = Field(60.0, gt=0.0, description="the period the per-peer budget and fair share are counted over")
    max_drift_ratio: float = Field(0.0, ge=0.0, description="all pulls or messages of one peer within window_s move "
                                   "our copy by at most this many times its norm together; 0 (the default) turns "
                                   "this off: honest steps go back and forth, and their sum grows with the pull "
                                   "rate (measured: an honest PDMM edge spent a 0.25 budget within the minute)")
    fair_share_slack: float = Field(2.0, ge=1.0, description="a peer is pulled at most this many times its fair share "
                                    "of the pulls within window_s (it is skipped meanwhile)")

    @model_validator(mode="after")
    def _history_holds_the_minimum(self) -> "InfluenceConfig":
        if self.min_history > self.history:
            raise ValueError(f"averaging.influence.min_history ({self.min_history}) must not exceed history "
                             f"({self.history}): the median would never be used")
        return self


EDGE_MODES = frozenset({"dsgd", "pdmm_isvr", "admm_isvr"})  # averaging over a peer graph (swarm/averaging/edges.py)


class GraphConfig(Strict):
    """The peer graph of the edge modes (dsgd, pdmm_isvr, admm_isvr): built by every peer from the
    swarm's online records, so the peers of a swarm agree on it without talking."""

    kind: Literal["ring", "double_ring", "random"] = Field("ring", description="who exchanges with whom")
    period_steps: int = Field(8, ge=1, le=100_000, description="K: each edge exchanges once every K local steps, "
                                                                "at its own offset")
    seed: int = Field(0, description="seeds the random graph")
    eta_scale: float = Field(1.0, gt=0.0, le=1000.0, description="pdmm/admm: the constraint strength is "
                                                                  "common_eta(mu, graph) times this")
    mixing: Literal["metropolis", "uniform"] = Field("metropolis", description="dsgd: mixing weights")


class AveragingConfig(Strict):
    mode: Literal["none", "dpwa", "allreduce", "dsgd", "pdmm_isvr", "admm_isvr"] = "dpwa"
    fetch_probability: float = Field(0.1, ge=0.0, le=1.0, description="chance of starting a pull per step")
    pull_budget: float = Field(0.0, ge=0.0, le=0.9, description="dpwa: besides fetch_probability's draws, pull "
                               "whenever pulls took less than this share of the time (the next one starts once "
                               "the last one's duration x (1/pull_budget - 1) has passed): a small layer near "
                               "its peers averages after nearly every step, a large one on a slow link is left "
                               "to fetch_probability; 0: off")
    interpolation: Literal["constant", "clock", "loss"] = "clock"
    constant_factor: float = Field(0.5, ge=0.0, le=1.0)
    divergence_threshold: float = Field(0.0, ge=0.0, description="0 disables the divergence rule")
    timeout_s: float = Field(10.0, gt=0.0)
    wire_dtype: Literal["float32", "float16"] = "float32"
    max_norm_ratio: float = Field(10.0, gt=1.0, description="reject peer params whose total norm is this many "
                                                              "times larger (or smaller) than ours")
    ban_s: float = Field(300.0, ge=0.0, description="no pulls from a peer that served bad parameters for this long")
    sync_timeout_s: float = Field(60.0, gt=0.0, description="a newcomer's whole download of its layer")
    max_state_mb: float = Field(4096.0, gt=0.0, description="largest layer (with optimizer state) a pull accepts")
    allreduce_every_s: float = Field(30.0, gt=0.0, description="mode allreduce: period of the group rounds")
    graph: GraphConfig = GraphConfig()
    exchange: ExchangeConfig = ExchangeConfig()
    influence: InfluenceConfig = InfluenceConfig()
