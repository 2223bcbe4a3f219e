"""The training losses against their definitions."""

import math

import torch

from ppd.losses import cross_entropy_loss, distillation_loss, position_weights, topk_kl


def test_topk_kl_with_the_whole_vocabulary_is_the_full_kl():
    torch.manual_seed(0)
    teacher, student = torch.randn(2, 3, 40) * 2, torch.randn(2, 3, 40)
    log_p = torch.log_softmax(teacher, -1)
    full = (log_p.exp() * (log_p - torch.log_softmax(student, -1))).sum(-1)
    values, ids = log_p.topk(40)
    torch.testing.assert_close(topk_kl(student, ids, values), full)


def test_topk_kl_is_the_kl_of_top_k_plus_one_tail_bucket():
    torch.manual_seed(1)
    teacher, student = torch.randn(1, 2, 30), torch.randn(1, 2, 30)
    log_p, log_q = torch.log_softmax(teacher, -1), torch.log_softmax(student, -1)
    values, ids = log_p.topk(4)
    got = topk_kl(student, ids, values)
    for n in range(2):
        top = set(ids[0, n].tolist())
        p = [log_p[0, n, i].exp() for i in ids[0, n]]
        q = [log_q[0, n, i].exp() for i in ids[0, n]]
        p_tail = sum(log_p[0, n, i].exp() for i in range(30) if i not in top)
        q_tail = sum(log_q[0, n, i].exp() for i in range(30) if i not in top)
        expected = sum(a * math.log(a / b) for a, b in zip(p, q)) + p_tail * math.log(p_tail / q_tail)
        assert abs(got[0, n].item() - float(expected)) < 1e-5


def test_kl_is_zero_for_the_teacher_itself_and_gradients_are_finite():
    torch.manual_seed(2)
    teacher = torch.randn(3, 3, 50)
    values, ids = torch.log_softmax(teacher, -1).topk(10)
    assert topk_kl(teacher, ids, values).abs().max() < 1e-5
    student = torch.randn(3, 3, 50, requires_grad=True)
    distillation_loss(student, ids, values).backward()
    assert torch.isfinite(student.grad).all() and student.grad.abs().sum() > 0


def test_position_weights_and_cross_entropy():
    torch.testing.assert_close(position_weights(3, 0.8), torch.tensor([1.0, 0.8, 0.64]) / 3)
    logits = torch.zeros(1, 2, 5)
    logits[0, 0, 1] = 10.0  # confident and right for the first token, uniform for the second
    targets = torch.tensor([[1, 3]])
    first = -torch.log_softmax(logits[0, 0], -1)[1]
    expected = (first + 0.5 * math.log(5)) / 2
    torch.testing.assert_close(cross_entropy_loss(logits, targets, decay=0.5), expected)
