"""A small Prodigy-style optimizer for the tests: like prodigy-plus-schedule-free it keeps its
running D estimates as *tensors in param_groups* (``running_d_numerator``, ``running_d_denom``),
created on the parameters' device, which ``Optimizer.load_state_dict`` copies verbatim and never
moves."""

from __future__ import annotations

import torch


class ProdigyStyle(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1.0, betas=(0.9, 0.99), eps: float = 1e-8, d0: float = 1e-6):
        defaults = dict(lr=lr, betas=betas, eps=eps, d=d0, running_d_numerator=None, running_d_denom=None)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            beta1, beta2 = group["betas"]
            if group["running_d_numerator"] is None:
                dev = params[0].device
                group["running_d_numerator"] = torch.zeros(1, device=dev)
                group["running_d_denom"] = torch.zeros(1, device=dev)
            d = group["d"]
            num, den = group["running_d_numerator"], group["running_d_denom"]
            for p in params:
                st = self.state[p]
                if not st:
                    st["p0"] = p.detach().clone()
                    st["exp_avg"] = torch.zeros_like(p)
                    st["s"] = torch.zeros_like(p)
                st["exp_avg"].mul_(beta1).add_(p.grad, alpha=d * (1 - beta1))
                st["s"].mul_(beta2).add_(p.grad, alpha=d * (1 - beta2))
                # out-of-place on purpose: mixing devices here is what fails on a resumed run
                num.copy_(num * beta2 + (p.grad * (st["p0"] - p)).sum() * d)
                den.copy_(den * beta2 + st["s"].abs().sum())
            d_hat = num / den.clamp_min(group["eps"])
            for p in params:
                st = self.state[p]
                p.sub_(st["exp_avg"] * (group["lr"] * torch.maximum(d_hat, torch.full_like(d_hat, d))))
