"""Faults the sentinel tests inject: a NaN that first appears in the backward."""

import torch


class PoisonGradient(torch.autograd.Function):
    """Identity forward; the backward puts a NaN in the first element of the gradient it
    passes on."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        grad.view(-1)[0] = float("nan")
        return grad
