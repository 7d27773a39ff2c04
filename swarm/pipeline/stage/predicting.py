"""A stage worker's weight prediction (``training.weight_prediction``; swarm/integrity/prediction.py): the weights a
training forward computes with, extrapolated along the stage's last update by its recent staleness, registered for
the weights door so that a referee can rebuild them from two versions the stage shows."""

from __future__ import annotations

import torch

from swarm.integrity.prediction import PREDICT_MAX, Derivation, Derivations, predict
from swarm.integrity.weights import weights_digest


class Predicting:
    """Mixed into StageWorker: needs ``run``, ``is_last``, ``module``, ``ring``, ``stats``, ``staleness``,
    ``committed`` and ``_custom_rule``; ``_init_prediction`` from its constructor."""

    def _init_prediction(self) -> None:
        self.derivations = Derivations()  # what this stage's predicted weights were made from, for referees
        self._stepped: tuple[int, bytes] | None = None  # (the version an optimizer step made, the digest before it)
        self._prediction: tuple[tuple, bytes, dict[str, torch.Tensor]] | None = None  # the latest, reused per version
        self.predicted = 0  # forwards that computed with predicted weights
        self.predicted_ahead = 0  # updates ahead the latest training forward looked (0: it was not predicted)

    def _note_step(self, base_digest: bytes) -> None:
        """An optimizer step took the weights from ``base_digest`` to the version now (called right after it)."""
        self._stepped = (self.stats.param_version, base_digest)

    def _predicted(self) -> tuple[bytes, dict[str, torch.Tensor], int] | None:
        """(digest, tensors, updates ahead) of the weights this training forward computes with where they are
        predicted: the run asks for it, this is no last stage (its staleness is 0), no edge mode's rule makes the
        steps (their update includes a pull), the run's factor times the stage's recent staleness rounds to 1 or more,
        and the weights changed last by an optimizer step whose base the ring still keeps. None otherwise: the
        version now, as without."""
        self.predicted_ahead = 0
        if not self.run.training.weight_prediction or self.is_last or self._custom_rule:
            return None
        stepped = self._stepped
        tau = min(PREDICT_MAX, int(round(self.run.training.weight_prediction * self.staleness.mean())))
        if stepped is None or stepped[0] != self.stats.param_version or tau < 1:
            return None
        version, digest = self.committed
        key = (version, digest, tau)
        if self._prediction is not None and self._prediction[0] == key:
            self.predicted += 1
            self.predicted_ahead = tau
            return self._prediction[1], self._prediction[2], tau
        prev = self.ring.get(stepped[1])
        if prev is None or prev.tensors is None:
            return None
        with torch.no_grad():
            tensors = predict({name: t.detach() for name, t in self.module.state_dict().items()}, prev.tensors, tau)
        predicted = weights_digest(tensors)
        self.derivations.note(predicted, Derivation(digest, stepped[1], tau))
        self._prediction = (key, predicted, tensors)
        self.predicted += 1
        self.predicted_ahead = tau
        return predicted, tensors, tau
