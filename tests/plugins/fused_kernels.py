"""Fused residual add + RMSNorm kernels (issue 37), fn(x, residual, weight, eps): a correct one that
returns the pair, a correct vLLM-style one that works in place, and one fault each that only fusion
makes. Pure torch, written the way such kernels are (the statistic in float32, one cast at the end)."""

import torch


def _norm(s32, weight, eps, dtype):
    return (weight.float() * (s32 * torch.rsqrt(s32.pow(2).mean(-1, keepdim=True) + eps))).to(dtype)


def returns_pair(x, residual, weight, eps):
    s = x.float() + residual.float()
    return _norm(s, weight, eps, x.dtype), s.to(x.dtype)


def in_place(x, residual, weight, eps):
    """vLLM's convention: residual <- x + residual, x <- N(residual) w; returns nothing."""
    s = x.float() + residual.float()
    residual.copy_(s)
    x.copy_(_norm(s, weight, eps, x.dtype))


def bf16_sum(x, residual, weight, eps):
    """x + residual formed in bfloat16 before the float32 statistic."""
    s = (x.bfloat16() + residual.bfloat16()).float()
    return _norm(s, weight, eps, x.dtype), s.to(x.dtype)


def stale_residual(x, residual, weight, eps):
    """The sum is normalised but never written back: the residual output is the input."""
    s = x.float() + residual.float()
    return _norm(s, weight, eps, x.dtype), residual


def aliased(x, residual, weight, eps):
    """In place, the normed value written into x before x is read for the residual."""
    s = x.float() + residual.float()
    x.copy_(_norm(s, weight, eps, x.dtype))
    residual.add_(x)


def half_sum(x, residual, weight, eps):
    """The sum at float16 before any upcast: past 65504 it is inf, and so is the norm."""
    s = x + residual
    return _norm(s.float(), weight, eps, x.dtype), s


def eps_1e6(x, residual, weight, eps):
    """eps hard-coded in the serving glue (llama.cpp #2373)."""
    return returns_pair(x, residual, weight, 1e-6)


def scribbles_on_its_gain(x, residual, weight, eps):
    """Correct, then zeroes the gain it was handed: a later call must not see the zeros."""
    out = returns_pair(x, residual, weight, eps)
    weight.zero_()
    return out


def returns_a_string(x, residual, weight, eps):
    return "done", "done"


def exits(x, residual, weight, eps):
    import os

    os._exit(3)
