"""Bound search cost at scale: one pass + one collective vs the per-step loop vs one loss evaluation.

    python benchmarks/bench_bound_search.py [--tokens 2000000] [--repeats 5] [--threads N]

The per-step loop is what the official recipe does: every search step re-evaluates the
contribution over all tokens and syncs to the host (`.item()`) to test the condition; with a
process group it also all-reduces every step. Ours buckets every token once, all-reduces one
vector, and walks the path on the host. The balance applied to DPPO's thresholds and CISPO's cap
(`algorithms.balance`) is timed against BAPO's own search and against each loss's forward. All
numbers come from this one run, on this machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from megatron_bapo.algorithms import (  # noqa: E402
    BapoConfig,
    CispoConfig,
    DppoConfig,
    balance_metric,
    cispo_loss,
    dppo_loss,
    policy_loss,
    search_clip_bounds,
)
from megatron_bapo.algorithms.balance import search_cispo, search_dppo  # noqa: E402


def per_step_loop(ratio, adv, mask, cfg: BapoConfig, group=None):
    """The baseline: one full pass and one host sync (and collective) per search step, paper order.

    Each pass evaluates the configured contribution the direct way: for `surrogate` exactly as the
    official recipe's `_compute_effective_advantage` does (min/max/where over all tokens).
    """
    maskb = mask.bool()
    if cfg.contribution == "gradient":
        pos_base = maskb & (adv > 0)
        neg_base = maskb & (adv < 0)
        if cfg.dual_clip is not None:
            neg_base = neg_base & (ratio <= cfg.dual_clip)
        contrib = adv.abs() * ratio

    def sums_at(c_low, c_high):
        if cfg.contribution == "gradient":
            p = torch.where(pos_base & (ratio <= c_high), contrib, 0.0).sum(dtype=torch.float64)
            n = torch.where(neg_base & (ratio >= c_low), contrib, 0.0).sum(dtype=torch.float64)
            return torch.stack([p, n])
        effective = torch.where(adv >= 0, torch.minimum(ratio, ratio.new_tensor(c_high)), torch.maximum(ratio, ratio.new_tensor(c_low)))
        effective_adv = effective * adv * mask
        return torch.stack([effective_adv.clamp(min=0).sum(dtype=torch.float64), (-effective_adv.clamp(max=0)).sum(dtype=torch.float64)])

    def rho(c_low, c_high):
        sums = sums_at(c_low, c_high)
        if group is not None:
            torch.distributed.all_reduce(sums, group=group)
        p, n = sums.tolist()  # host sync, every step
        return balance_metric(p, n, cfg.metric)

    j = k = steps = 0
    while rho(cfg.low_start + j * cfg.low_step, cfg.high_start + k * cfg.high_step) < cfg.rho0 and j + 1 <= cfg.num_low_steps:
        if k + 1 <= cfg.num_high_steps:
            k += 1
        else:
            j += 1
        steps += 1
    return cfg.low_start + j * cfg.low_step, cfg.high_start + k * cfg.high_step, steps


def paired_times(fns, rounds):
    """Time every function once per round, interleaved, so all see the same machine load.

    Returns per-function lists of seconds. Ratios are taken per round and then the median, which is
    robust to a noisy machine (shared CPUs make back-to-back blocks of repeats drift by 2x).
    """
    for fn in fns:
        fn()  # warm-up
    times = [[] for _ in fns]
    for _ in range(rounds):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            times[i].append(time.perf_counter() - t0)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2_000_000)
    parser.add_argument("--repeats", type=int, default=9, help="paired rounds")
    parser.add_argument("--rho0", type=float, default=0.6, help="high enough that the search walks far")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    g = torch.Generator().manual_seed(0)
    n = args.tokens
    behavior = -torch.rand(n, generator=g) * 4
    logp = behavior + torch.randn(n, generator=g) * 0.4
    ratio = torch.exp(logp - behavior)
    adv = torch.randn(n, generator=g) - 0.3  # negative-heavy: the search has to move
    mask = (torch.rand(n, generator=g) < 0.95).float()
    print(f"tokens={n:,}  threads={torch.get_num_threads()}")
    for contribution in ("gradient", "surrogate"):
        cfg = BapoConfig(rho0=args.rho0, contribution=contribution, metric="share")
        ours = search_clip_bounds(ratio, adv, mask, cfg)
        low, high, steps = per_step_loop(ratio, adv, mask, cfg)
        assert abs(low - ours.c_low) < 1e-12 and abs(high - ours.c_high) < 1e-12 and steps == ours.num_steps

        t_ours, t_loop, t_loss = paired_times(
            [lambda: search_clip_bounds(ratio, adv, mask, cfg), lambda: per_step_loop(ratio, adv, mask, cfg),
             lambda: policy_loss(logp, behavior, adv, mask, ours.c_low, ours.c_high)],
            args.repeats,
        )
        med = statistics.median
        speedup = med([lo / o for lo, o in zip(t_loop, t_ours)])
        vs_loss = med([o / ls for o, ls in zip(t_ours, t_loss)])
        print(f"\n[{contribution}] search steps={ours.num_steps}  bounds=({ours.c_low:.2f}, {ours.c_high:.2f})  "
              f"rho {ours.rho_initial:.3f} -> {ours.rho:.3f}")
        print(f"  one-pass search      {med(t_ours) * 1e3:9.1f} ms")
        print(f"  per-step loop        {med(t_loop) * 1e3:9.1f} ms   ({ours.num_steps + 1} passes + host syncs)")
        print(f"  policy_loss (fwd)    {med(t_loss) * 1e3:9.1f} ms")
        print(f"  speedup vs loop      {speedup:9.1f}x   (median of {args.repeats} paired rounds; target >= 20x)")
        print(f"  cost vs one loss     {vs_loss:9.2f}x   (target <= 3x)")

    cfg = BapoConfig(rho0=args.rho0)
    dppo, cispo = DppoConfig(), CispoConfig()
    for name, search, loss in (
        ("dppo", lambda: search_dppo(logp, behavior, adv, mask, dppo, cfg),
         lambda: dppo_loss(logp, behavior, adv, mask, dppo)),
        ("cispo", lambda: search_cispo(logp, behavior, adv, mask, cispo, cfg),
         lambda: cispo_loss(logp, behavior, adv, mask, cispo)),
    ):
        res = search()
        t_search, t_bapo, t_loss = paired_times([search, lambda: search_clip_bounds(ratio, adv, mask, cfg), loss],
                                                args.repeats)
        med = statistics.median
        print(f"\n[{name} balance] search steps={res.num_steps}  parameters=({res.c_low:.3f}, {res.c_high:.3f})  "
              f"rho {res.rho_initial:.3f} -> {res.rho:.3f}")
        print(f"  one-pass search      {med(t_search) * 1e3:9.1f} ms")
        print(f"  vs BAPO's search     {med([a / b for a, b in zip(t_search, t_bapo)]):9.2f}x")
        print(f"  vs one {name} loss   {med([a / b for a, b in zip(t_search, t_loss)]):9.2f}x")


if __name__ == "__main__":
    main()
