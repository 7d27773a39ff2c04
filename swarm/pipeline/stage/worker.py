"""One peer's copy of one stage: forward, backward with the update, and the statistics it announces (stage_stats.py).

No networking here: the RPC servicer (stage_rpc.py) and the local driver call these methods from a
single compute thread. Design choices:

- Asynchronous SGD (DistBelief): every backward applies its gradient to this copy at once.
- A forward keeps its autograd graph in a bounded, time-limited cache keyed by micro-batch id, so a backward that
  comes back to the same peer reuses the saved activations. With weight stashing (``training.weight_stashing``, on
  by default) the graph holds the weights its forward ran with: the ring's view of that version, which nothing
  writes while held (the update gives the live weights new storage): the backward is the gradient at those weights
  (PipeDream). Without it the graph aliases the live parameters (``p.data``: own version counter), and the input
  gradient is taken with the weights of now through the forward's activations. A backward at another peer (or
  after the cache dropped the entry) recomputes the forward from the input the driver re-sends.
- The update is ``optimizer.step()`` unless averaging replaces it (``set_update_rule``: the edge
  modes DSGD, PDMM-ISVR and ADMM-ISVR are optimizers of their own).
- Averaging (swarm/averaging) changes the copy only between two steps: it runs its changes on the
  compute thread or under ``lock`` (``mix_in``, ``restore``), and it hears of every step through
  ``add_step_hook`` (called on the compute thread, under the lock, right after the update).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

import torch
from torch import nn
from torch.func import functional_call

from swarm.pipeline.stage.activations import ActivationCache, Saved
from swarm.integrity.clip import NormHistory, clip_scale, combined_bound, step_ceiling
from swarm.integrity.guard import StepGuard
from swarm.integrity.health import HealthMonitor, SickCopy
from swarm.integrity.receipts import NO_WEIGHTS
from swarm.integrity.requesters import HEAVY_CLIP_SCALE
from swarm.integrity.weights import WeightsRing
from swarm.run.local import make_optimizer
from swarm.run.models import (EVAL_BATCH_MAX, backward_root, build_stage, eval_batch, fuses_loss, loss_fn,
                               stage_input_spec, stage_loss, target_spec)
from swarm.run.optim_light import step_of
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.predicting import Predicting
from swarm.pipeline.stage.staleness import StalenessWindow, StepSize
from swarm.pipeline.stage.stage_state import StageState
from swarm.pipeline.stage.stage_stats import (  # noqa: F401  (the errors and SIMULATED_STEP_ENV re-exported for callers)
    SIMULATED_STEP_ENV, AbsurdGradient, InputOutOfRange, NeedInput, StageStats, StepInfo, UpdateReport, WorkerState,
    simulated_step_s,
)
from swarm.pipeline.transport.wire import WireError, check_tensor, peak_abs

logger = logging.getLogger(__name__)

EVAL_BATCH = EVAL_BATCH_MAX  # the most a chunk may hold (a language model's is smaller: models.eval_batch)
EMIT_FRACTION = 0.5  # of timeouts.reply_max_abs: the largest value a stage's reply carries


class StageWorker(StageState, Predicting):
    def __init__(self, run: RunConfig, index: int, device: str = "cpu"):
        self.run = run
        self.index = index
        self.device = torch.device(device)
        self.is_first = index == 0
        self.is_last = index == run.model.stages - 1
        self.module: nn.Module = build_stage(run.model, index).to(self.device)
        self.optimizer = make_optimizer(self.module.parameters(), run.optimizer)
        # the one owner of the optimizer's lr: the run's x the heal scale x each update's staleness factor
        self.step_size = StepSize(self.optimizer, run.optimizer.name, run.optimizer.staleness,
                                  run.optimizer.staleness_tolerance)
        self.staleness = StalenessWindow()
        self.input_spec = stage_input_spec(run.model, index)
        self.target_spec = target_spec(run.model)
        self.max_batch = max(run.training.batch_size, EVAL_BATCH)
        self.cache = ActivationCache()
        self.stats = StageStats()
        self.lock = threading.RLock()  # held while computing or updating: snapshots are never half-updated
        self.simulated_step_s = simulated_step_s()
        self._step_hooks: list[Callable[[StepInfo], None]] = []
        self._update: Callable[[], None] = step_of(self.optimizer)  # optimizer.step, minus its dynamo import
        self._custom_rule = False  # an edge mode's rule: guarded for finiteness, its move not step-bounded
        # a sick copy serves nothing (SickCopy) until it heals
        self.health = HealthMonitor(run.integrity, chance_loss=math.log(self._num_outputs()))
        cfg = run.integrity
        self.grad_norms = NormHistory(cfg.clip_history, cfg.clip_multiplier)  # parameter gradients (total norm)
        self.grad_out_rms = NormHistory(cfg.clip_history, cfg.clip_multiplier)  # incoming output gradients
        # updated in place, never replaced: listed once (the module walk cost a digits update ~0.1 ms, five walks)
        self.named_params = list(self.module.named_parameters())
        self.guard = StepGuard(self.module, self.optimizer, cfg.max_step_ratio, kept=self._kept_params)
        self.last_update: UpdateReport | None = None  # of the latest applied update (read by the servicer)
        # drivers new here while established ones train (swarm/integrity/requesters.py): their updates are
        # clipped to the median accepted norm, not a multiple, and do not move the clip history
        self.on_probation: Callable[[str], bool] = lambda owner: False
        # the weights each op computes with, committed: (version, digest) of the latest op's, signed into its receipt,
        # and the recent versions kept for a referee to recompute a hop from (swarm/integrity/weights.py)
        self.ring = WeightsRing.sized_for(self.module, stash=run.training.weight_stashing)
        self.committed: tuple[int, bytes] = (0, NO_WEIGHTS)
        self.forward_weights = NO_WEIGHTS  # a backward's: the digest its saved forward ran with (else = committed's)
        self._init_prediction()  # training.weight_prediction (swarm/pipeline/stage/predicting.py)

    # ----- checks
    def check_input(self, x: torch.Tensor) -> torch.Tensor:
        return check_tensor(x, self.input_spec, f"layer{self.index} input", self.max_batch)

    def check_targets(self, y: torch.Tensor, batch: int) -> torch.Tensor:
        y = check_tensor(y, self.target_spec, "targets", self.max_batch)
        if y.shape[0] != batch:
            raise ValueError(f"targets: batch of {y.shape[0]} does not match the input's {batch}")
        if y.min() < 0 or y.max() >= self._num_outputs():
            raise ValueError("targets: class ids out of range")
        return y

    def check_grad(self, grad: torch.Tensor, batch: int) -> torch.Tensor:
        from swarm.run.models import stage_output_spec

        return check_tensor(grad, stage_output_spec(self.run.model, self.index, batch), "output gradient", self.max_batch)

    def _num_outputs(self) -> int:
        model = self.run.model
        return model.num_classes if model.kind == "mlp" else model.vocab_size

    # ----- compute
    def _graph(self, x: torch.Tensor, y: torch.Tensor | None = None,
               predicted: tuple[bytes, dict[str, torch.Tensor], int] | None = None) -> Saved:
        """The forward with its graph; with targets, the loss (a language model's head fuses it: models.stage_loss).
        With weight stashing the graph holds the ring's view of this version, which nothing writes while held; with
        ``predicted`` (digest, tensors, updates ahead: weight prediction) it computes with and holds those."""
        stash = self.ring.live_view() if predicted is None else predicted[1]
        params = {name: (p if stash is None else stash[name]).data.requires_grad_(True) for name, p in self.named_params}
        inputs = x.to(self.device)
        if inputs.is_floating_point() and not self.is_first:
            inputs.requires_grad_(True)  # the previous stage needs this gradient
        outputs = functional_call(self.module, params, (inputs,)) if y is None else \
            stage_loss(self.run.model, self.module, params, inputs, y.to(self.device))
        return Saved(inputs=inputs, outputs=outputs, params=params, created=time.monotonic(), version=self.stats.served,
                     weights=self.committed[1] if predicted is None else predicted[0], stash=stash)

    def forward(self, mb_id: str, x: torch.Tensor, owner: str = "") -> torch.Tensor:
        """Training forward; keeps the graph for a backward of ``owner`` (the requesting driver) that comes back here."""
        with self.lock, self.stats.busy():
            self._refuse_if_sick()
            self._commit()
            saved = self._graph(x, predicted=self._predicted())
            self.forward_weights = saved.weights  # its receipt names the version and what it computed with
            self._refuse_out_of_bound(self._check_emitted(saved.outputs, "outputs"))
            if self.is_first and not owner:  # our own driver's data: a collapsed copy shows here
                self.health.observe_own_forward(saved.inputs, saved.outputs)
                self._refuse_if_sick()
            self.cache.put((owner, mb_id), saved)
            self._simulate()
            return saved.outputs.detach().cpu()

    @torch.no_grad()
    def infer(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Outputs without a graph; with targets (a last stage that fuses its head and loss), the mean loss."""
        with self.lock, self.stats.busy():
            self._refuse_if_sick()
            self._commit()
            was_training = self.module.training
            self.module.eval()
            try:
                outputs = self.module(*(t.to(self.device) for t in (x, y) if t is not None))
            finally:
                self.module.train(was_training)
            self._refuse_out_of_bound(self._check_emitted(outputs, "outputs"))
            return outputs.cpu()

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, int, int]:
        """Last stage: (sum of losses, correct predictions, count) over a test chunk (logits: models.EVAL_BYTES_MAX)."""
        fused = fuses_loss(self.module)  # its logits are never held whole: no sub-chunks for them
        loss, correct, step = 0.0, 0, eval_batch(self.run.model, wide=not fused)
        for start in range(0, len(y), step):
            part = y[start : start + step]
            if fused:
                loss += float(self.infer(x[start : start + step], part)) * len(part)
                continue
            logits = self.infer(x[start : start + step])
            loss += loss_fn(self.run.model, logits, part).item() * len(part)
            correct += int((logits.argmax(-1) == part).sum().item()) if self.run.model.kind == "mlp" else 0
        return loss, correct, len(y)

    def backward(self, mb_id: str, grad_out: torch.Tensor, x: torch.Tensor | None, loss: float | None,
                 owner: str = "") -> torch.Tensor | None:
        """Apply this micro-batch's update; return the gradient of the input (None for stage 0)."""
        with self.lock, self.stats.busy():
            self._refuse_if_sick()
            junior = bool(owner) and self.on_probation(owner)
            grad_out, out_scale, out_rms = self._clip_grad_out(grad_out, junior)
            saved = self.cache.pop((owner, mb_id), time.monotonic())
            if saved is None:
                if x is None:
                    raise NeedInput(mb_id)
                self._commit()
                saved = self._graph(x)
            self._commit()  # the update's base: the weights of now; with weight stashing the graph computes with the
            self.forward_weights = saved.weights  # forward's weights only, otherwise its input gradient with now's
            backward_root(saved.outputs, grad_out.to(self.device, saved.outputs.dtype)).backward()
            peak = self._check_emitted(saved.inputs.grad, "input gradients")
            self._apply(saved, batch_size=grad_out.shape[0], loss=loss, owner=owner, scale=out_scale, out_rms=out_rms,
                        refuse_absurd=bool(owner),
                        junior=junior)
            self._simulate()
            return None if saved.inputs.grad is None else self._within_reply_bound(saved.inputs.grad.cpu(), peak)

    def forward_backward(self, mb_id: str, x: torch.Tensor, y: torch.Tensor, owner: str = "",
                         source: str = "") -> tuple[float, torch.Tensor | None]:
        """Last stage: loss and input gradient of one micro-batch, with the update applied. ``source``: the peer that
        computed ``x`` (its loss is judged per driver and source: swarm/integrity/health.py)."""
        with self.lock, self.stats.busy():
            self._refuse_if_sick()
            self._commit()
            saved = self._graph(x, y)
            value = float(saved.outputs.item())
            declined = self.health.observe_local_loss(value, owner, source=source)
            self._refuse_if_sick()
            saved.outputs.backward()
            peak = self._check_emitted(saved.inputs.grad, "input gradients")
            if declined:  # its loss and input gradient go back, its update is not learned (swarm/integrity/health.py);
                # the version counts one: a referee's audit takes v -> v+1 as the update of the hop at v (unchanged
                # weights: neither climbing nor descending), and the op is applied (a resend is refused)
                self.stats.param_version += 1
                self.last_update = UpdateReport(clip_scale=1.0, tensors_scaled=0, step_factor=0.0)
            else:
                self._apply(saved, batch_size=x.shape[0], loss=value, owner=owner,
                            junior=bool(owner) and self.on_probation(owner))
            self._simulate(2)
            return value, None if saved.inputs.grad is None else self._within_reply_bound(saved.inputs.grad.cpu(), peak)

    def input_gradient(self, x: torch.Tensor, y: torch.Tensor | None = None,
                       grad_out: torch.Tensor | None = None) -> tuple[float | None, torch.Tensor]:
        """A spot check's recomputation (swarm/pipeline/control/spot_checks.py): the gradient of this copy's input for a
        micro-batch that another peer of our swarm trained on; the last stage's of its loss on targets ``y`` (and
        that loss), another stage's of its outputs given ``grad_out`` (clipped as a backward here would clip it,
        without recording it). Nothing is applied, recorded or learnt from it: a stranger's check moves no
        history, no health signal, no parameter."""
        with self.lock, self.stats.busy():
            self._refuse_if_sick()
            self._commit()
            inputs = x.to(self.device).requires_grad_(True)
            params = {name: p.detach() for name, p in self.named_params}  # the input's gradient only
            loss_value: float | None = None
            if self.is_last:
                if y is None:
                    raise ValueError("the last stage's gradient check needs the targets")
                loss = stage_loss(self.run.model, self.module, params, inputs, y.to(self.device))
                loss_value = float(loss.item())
                (grad_in,) = torch.autograd.grad(loss, inputs)
            else:
                if grad_out is None:
                    raise ValueError("a gradient check needs the output gradient")
                norm = float(grad_out.double().norm())
                rms = norm / math.sqrt(max(grad_out.shape[0], 1))
                scale = clip_scale(rms, self.grad_out_rms.bound(None))
                if scale == 0.0:
                    raise WireError("output gradient: its norm is not finite")
                outputs = functional_call(self.module, params, (inputs,))
                grad_out = grad_out.to(self.device, outputs.dtype) * scale
                (grad_in,) = torch.autograd.grad(backward_root(outputs, grad_out), inputs)
            peak = self._check_emitted(grad_in, "input gradients")
            self._simulate(2 if self.is_last else 1)
            return loss_value, self._within_reply_bound(grad_in.detach().cpu(), peak)

    def _within_reply_bound(self, grad_in: torch.Tensor, peak: float) -> torch.Tensor:
        """What we emit stays within what a driver accepts from us (``timeouts.reply_max_abs``): a gradient we were
        sent by a hostile next stage, before our clip history exists, would otherwise come out of our backward
        larger than the bound, and the driver would blame us, its honest computer, for it."""
        bound = EMIT_FRACTION * self.run.timeouts.reply_max_abs  # peak: grad_in's largest magnitude (_check_emitted)
        return grad_in * (bound / peak) if peak > bound else grad_in

    def _refuse_out_of_bound(self, peak: float) -> None:
        """Activations past what a driver accepts come only from inputs out of range: refuse them (the input's
        author is blamed, swarm/pipeline/stage/stage_rpc.py), rather than emit what the driver would blame us for."""
        bound = EMIT_FRACTION * self.run.timeouts.reply_max_abs  # peak: the outputs' largest magnitude (_check_emitted)
        if peak > bound:
            raise InputOutOfRange(f"layer{self.index}: these inputs make outputs beyond {bound:.3g}: not served")

    def _clip_grad_out(self, grad_out: torch.Tensor, junior: bool = False) -> tuple[torch.Tensor, float, float]:
        """Centered clipping of the incoming output gradient (per-sample RMS, so batch sizes compare)."""
        norm = float(grad_out.norm())
        if not math.isfinite(norm):  # float32 squares overflow past ~1.8e19: only then is double precision needed
            norm = float(grad_out.double().norm())
        rms = norm / math.sqrt(max(grad_out.shape[0], 1))
        scale = clip_scale(rms, self.grad_out_rms.bound(1.0 if junior else None))
        if scale == 0.0:
            raise WireError("output gradient: its norm is not finite")
        return (grad_out * scale if scale < 1.0 else grad_out), scale, rms * scale

    def _apply(self, saved: Saved, batch_size: int, loss: float | None, owner: str = "", scale: float = 1.0,
               out_rms: float | None = None, junior: bool = False, refuse_absurd: bool = False) -> None:
        """Clip the parameter gradient, scale it by its staleness, step under the guard (nothing non-finite is
        ever committed), record it. A forward recomputed here at the backward is 0 updates stale."""
        staleness = max(0, self.stats.served - saved.version)
        params = [param for _, param in self.named_params]
        grads = []
        for name, param in self.named_params:
            grad = saved.params[name].grad
            param.grad = grad if grad is not None else torch.zeros_like(param)
            grads.append(param.grad)
        grad_scale, grad_norm, param_norms = self._clip_param_grads(params, grads, junior)
        if refuse_absurd and min(scale, grad_scale) < HEAVY_CLIP_SCALE:
            # refused where it arrives: applied (clipped to nothing) its input gradient would still leave here large,
            # and the stage before us would blame us, its honest computer, for what our next stage sent
            raise AbsurdGradient(f"layer{self.index}: the output gradient is absurd for this copy (its update would be "
                                 f"clipped to {min(scale, grad_scale):.2g} of its size): not applied")
        factor = 1.0 if self._custom_rule else self.step_size.before_step(staleness, grads, self.staleness.mean())
        result = self.guard.run(self._update, bound_steps=not self._custom_rule, param_norms=param_norms,
                                grad_norm=None if self._custom_rule else grad_norm * grad_scale)
        self.staleness.record(staleness)
        if not junior:  # a newcomer's norms would let it lift the bound it is clipped to
            self.grad_norms.accept(grad_norm * grad_scale, was_clipped=grad_scale < 1.0)
            if out_rms is not None:
                self.grad_out_rms.accept(out_rms, was_clipped=scale < 1.0)
        self.last_update = UpdateReport(clip_scale=min(scale, grad_scale), tensors_scaled=result.tensors_scaled,
                                        staleness=staleness, step_factor=factor)
        self.stats.record_update(batch_size, loss, time.monotonic())
        if not self._custom_rule:
            self._note_step(self.committed[1])  # the update's base: a forward may predict from it (predicting.py)
        info = StepInfo(batch_size=batch_size, loss=loss, forward_at=saved.created, staleness=staleness)
        for hook in self._step_hooks:
            try:
                hook(info)
            except Exception:  # averaging must never break training
                logger.exception("a step hook failed")

    def _clip_param_grads(self, params: list[nn.Parameter], grads: list[torch.Tensor],
                          junior: bool = False) -> tuple[float, float, list[float]]:
        """(scale applied, norm before it, each parameter tensor's norm): clip to the history bound and the
        history-free step ceiling. One fused norm pass over gradients and parameters; the guard reuses the
        parameters' norms for its step bound."""
        norms = torch.stack(torch._foreach_norm(grads + [p.data for p in params])).double()
        grad_norm = float(norms[: len(grads)].norm())
        param_norms = norms[len(grads):]
        param_norm = float(param_norms.norm())
        lr = self.step_size.lr  # the run's lr x the heal scale (a staleness factor only shrinks the step)
        bound = combined_bound(self.grad_norms.bound(1.0 if junior else None),
                               step_ceiling(param_norm, lr, self.run.integrity.max_step_ratio))
        scale = clip_scale(grad_norm, bound)
        if scale == 0.0:
            self.health.observe_param_norm(param_norm)  # a diverged copy overflows on honest input: it is sick
            self._refuse_if_sick()
            raise WireError(f"layer{self.index}: the update's gradient norm is not finite (values out of range): "
                            "not applied")
        if scale < 1.0:
            torch._foreach_mul_(grads, scale)
        return scale, grad_norm, param_norms.tolist()

    def _check_emitted(self, tensor: torch.Tensor | None, what: str) -> float:
        """Nothing non-finite leaves this stage. Whose fault: with finite parameters the request's
        values were out of range (rejected, nothing applied); otherwise this copy is sick. Returns the
        tensor's largest magnitude (the same pass: the reply bounds need it), 0.0 for none."""
        if tensor is None or not tensor.is_floating_point():
            return 0.0
        peak = peak_abs(tensor)
        if math.isfinite(peak):
            return peak
        if all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            from swarm.integrity.heal import param_norm

            self.health.observe_param_norm(param_norm(self.module))  # finite but diverged: sick, not the request
            self._refuse_if_sick()
            raise WireError(f"layer{self.index} {what} would be non-finite: the request's values are out of range")
        self.health.check_tensor(tensor, f"layer{self.index} {what}")  # raises SickCopy
        raise SickCopy(f"layer{self.index} {what} contain non-finite values")

    def _commit(self) -> None:
        """The weights this op computes with, committed (hashed and kept once per version): its receipt signs them."""
        self.committed = self.ring.commit(self.module, self.stats.param_version)
        self.forward_weights = self.committed[1]

    def _refuse_if_sick(self) -> None:
        reason = self.health.sick_reason
        if reason is not None:
            raise SickCopy(reason)

    def _simulate(self, steps: int = 1) -> None:
        if self.simulated_step_s:
            time.sleep(self.simulated_step_s * steps)

    def add_step_hook(self, hook: Callable[[StepInfo], None]) -> None:
        self._step_hooks.append(hook)

    def set_update_rule(self, rule: Callable[[], None] | None) -> None:
        """Replace ``optimizer.step()`` by ``rule`` (None restores it). The rule runs on the compute thread under the
        lock, with every parameter's ``.grad`` set, and updates the parameters in place. The edge modes of averaging
        use this: their update *is* the optimizer (swarm/averaging/edges.py). The gradients it sees are clipped, and a
        step that would leave anything non-finite is undone (swarm/integrity/guard.py), as for the optimizer."""
        with self.lock:
            self._update = rule if rule is not None else step_of(self.optimizer)
            self._custom_rule = rule is not None
