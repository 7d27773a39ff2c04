"""A reply is checked like a request: the driver uses nothing a stranger sends unchecked (swarm/pipeline/transport/replies.py)."""

from __future__ import annotations

import pytest
import torch

from swarm.pipeline.transport.replies import BadReply, check_reply
from swarm.run.runconfig import RunConfig
from swarm.pipeline.stage.stage_rpc import refusal_error

MODEL = RunConfig.model_validate({"name": "replies", "model": {"stages": 3, "hidden_dim": 16}}).model
MAX_ABS = 1e6


def _check(op, tensors, meta, k=1, batch=4):
    return check_reply(MODEL, k, op, batch, tensors, meta, MAX_ABS)


def test_good_replies_pass_and_come_back_in_the_spec_dtype():
    (out,), _ = _check("forward", [torch.zeros(4, 16, dtype=torch.float16)], {"ok": True})
    assert out.dtype == torch.float32
    _check("forward_backward", [torch.zeros(4, 16)], {"ok": True, "loss": 2.3}, k=2)
    _check("backward", [torch.zeros(4, 16)], {"ok": True})
    _check("evaluate", [], {"ok": True, "loss_sum": 9.0, "correct": 3, "count": 4}, k=2)


@pytest.mark.parametrize(("op", "tensors", "meta", "expected"), [
    ("forward_backward", [], {"ok": True, "loss": 1.0}, "0 tensor(s), expected 1"),
    ("forward", [torch.zeros(4, 16), torch.zeros(4, 16)], {"ok": True}, "2 tensor(s)"),
    ("forward", [torch.zeros(3, 16)], {"ok": True}, "shape (3, 16)"),
    ("forward", [torch.zeros(4, 7)], {"ok": True}, "shape (4, 7)"),
    ("forward", [torch.zeros(4, 16, dtype=torch.int64)], {"ok": True}, "dtype"),
    ("forward", [torch.full((4, 16), float("nan"))], {"ok": True}, "NaN"),
    ("backward", [torch.full((4, 16), 3e38)], {"ok": True}, "exceeds the bound"),
    ("forward_backward", [torch.zeros(4, 16)], {"ok": True}, "loss None"),
    ("forward_backward", [torch.zeros(4, 16)], {"ok": True, "loss": "low"}, "loss 'low'"),
    ("forward_backward", [torch.zeros(4, 16)], {"ok": True, "loss": float("inf")}, "loss inf"),
    ("forward_backward", [torch.zeros(4, 16)], {"ok": True, "loss": True}, "loss True"),
    ("evaluate", [], {"ok": True, "loss_sum": 1.0, "correct": 9, "count": 4}, "correct 9"),
    ("evaluate", [], {"ok": True, "loss_sum": 1.0, "correct": 1, "count": 400}, "count 400"),
    ("evaluate", [], {"ok": True, "loss_sum": -1.0, "correct": 1, "count": 4}, "loss_sum -1.0"),
    ("evaluate", [torch.zeros(4, 10)], {"ok": True, "loss_sum": 1.0, "correct": 1, "count": 4}, "1 tensor(s)"),
])
def test_bad_replies_are_refused_with_a_reason(op, tensors, meta, expected):
    k = 2 if op in ("forward_backward", "evaluate") else 1
    with pytest.raises(BadReply, match=expected.replace("(", r"\(").replace(")", r"\)")):
        _check(op, tensors, meta, k=k)


def test_a_refusal_keeps_only_a_usable_retry_after():
    assert refusal_error({"ok": False, "code": "busy", "retry_after_s": 2.5}).retry_after_s == 2.5
    for bad in (float("nan"), -1, "soon", True, 1e300):
        assert refusal_error({"ok": False, "code": "busy", "retry_after_s": bad}).retry_after_s is None
    odd = refusal_error({"ok": "yes", "code": ["x"] * 9, "error": "e" * 10_000})
    assert odd.code == "error" and len(str(odd)) < 400
    # a stranger's text reaches the log, the terminal and the dashboard: no escape sequence or control character
    escaped = refusal_error({"ok": False, "code": "busy\x1b", "error": "wait\x1b[2J\r\nfake line\x07"})
    assert escaped.code == "error" and all(c.isprintable() for c in str(escaped)) and "wait" in str(escaped)
