"""Replicated evaluations (swarm/integrity/evaluations.py): what is published when last-stage copies disagree, and
that disagreement alone penalises nobody (issue 28: skewed copies differ honestly)."""

from __future__ import annotations

import pytest

from swarm.integrity.evaluations import Figures, consensus


def test_one_replica_is_published_unvalidated():
    verdict = consensus([Figures("a", 0.9, 0.3)])
    assert (verdict.accuracy, verdict.validated, verdict.replicas) == (0.9, False, 1)


def test_two_that_agree_publish_their_mean_validated():
    verdict = consensus([Figures("a", 0.90, 0.30), Figures("b", 0.92, 0.28)])
    assert verdict.validated and verdict.accuracy == pytest.approx(0.91) and verdict.loss == pytest.approx(0.29)


def test_two_that_disagree_publish_the_worse_so_a_boast_never_lands():
    verdict = consensus([Figures("liar", 1.0, 0.0), Figures("honest", 0.90, 0.3)])
    assert not verdict.validated and verdict.accuracy == 0.90


def test_three_publish_the_median_and_name_the_far_one():
    verdict = consensus([Figures("liar", 1.0, 0.0), Figures("b", 0.90, 0.3), Figures("c", 0.91, 0.29)])
    assert verdict.accuracy == 0.91 and verdict.validated and verdict.outliers == ("liar",)


def test_skewed_copies_far_apart_publish_the_median_not_validated():
    """Three honest last-stage copies of a label-skewed run early on: nobody agrees with the median; the median is
    published, not validated, and the driver penalises none of them (swarm/pipeline/control/driver_eval.py logs it)."""
    verdict = consensus([Figures("a", 0.45, 1.9), Figures("b", 0.70, 1.0), Figures("c", 0.95, 0.2)])
    assert verdict.accuracy == 0.70 and not verdict.validated and set(verdict.outliers) == {"a", "c"}


def test_language_model_figures_agree_by_relative_loss():
    verdict = consensus([Figures("a", None, 2.0), Figures("b", None, 2.1)])
    assert verdict.validated and verdict.loss == pytest.approx(2.05)
    assert not consensus([Figures("a", None, 2.0), Figures("b", None, 3.0)]).validated


def test_no_figure_is_an_error():
    with pytest.raises(ValueError):
        consensus([])
