"""Window estimators of JAGG compared on the trained digits test bed (issue 19, deliverable 2).

For W in {3, 4, 8} (disjoint full windows of the 8 first, trained steps: ``configs/digits.yaml`` with
``sampling.trained_steps: 8``), on fresh rollouts of the shipped model (theta = theta_old, the first
update's gradient) and per GRPO group (8 samples): the exact window gradient sum_k J_k^T g_k against
each estimator's, cosine and relative error. Estimators:

* ``t`` (the paper's, the default): alpha_k linear in t;
* ``sigma``: alpha linear in the SDE's sigma(t) = sqrt(t / (1 - t)) (t = 1 uses t_1, as the SDE does);
* ``logsnr``: alpha linear in log((1 - t) / t) (same convention at t = 1);
* ``z_fit``: alpha_k of the point of the latent chord z_a -> z_b nearest z_k, per sample;
* ``v_fit``: alpha_k fitted by least squares to the recorded velocities, v_k ~ (1 - alpha) v_a + alpha v_b,
  per sample; ``v_fit_window``: one alpha_k per window step, pooled over the group's samples;
* ``v_fit2``: free coefficients v_k ~ c_a v_a + c_b v_b (least squares, pooled per window step);
* ``nearest``: each interior step's g_k goes to its nearer anchor in t (alpha rounded);
* ``quad3`` / ``pwl3``: three anchors (first, middle, last: 3 passes), Lagrange-quadratic or piecewise-
  linear weights in t (W >= 4; ``pwl3`` is two chained windows); ``halves`` (W = 8): two disjoint windows of
  4 (4 passes), so the 8-step errors of disjoint W = 4, chained and W = 8 compare on one gradient;
* oracles, fitted on the very gradients they are scored on (bounds, not estimators): ``oracle_alpha`` the
  best alpha_k per step (anchors' columns J_j^T g_k transported, least squares), ``oracle_free`` the best
  free pair (c_a,k, c_b,k).

The unbiased control variate (JAGG + B/p (exact - JAGG), B ~ Bernoulli(p)) needs no run: its mean
squared error is exactly (1 - p)/p ||exact - JAGG||^2, reported from the ``t`` rows.

    OMP_NUM_THREADS=1 python benchmarks/estimators.py --seeds 0 1 --prompts 16
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
WINDOWS = (3, 4, 8)
TWO_ANCHOR = ("t", "sigma", "logsnr", "z_fit", "v_fit", "v_fit_window", "v_fit2", "nearest")


def sde_sigma(t: torch.Tensor, t1: float) -> torch.Tensor:
    t = torch.where(t >= 1, torch.full_like(t, t1), t)
    return torch.sqrt(t / (1 - t))


def two_anchor_weights(name: str, times, lat, vel, steps) -> tuple[torch.Tensor, torch.Tensor]:
    """(w_a, w_b) of shape [W, B]: weight of g_k (step k of the window, sample i) on anchor a and b."""
    t = times.double()[steps]
    B = vel.shape[1]
    if name in ("t", "sigma", "logsnr", "nearest"):
        if name == "sigma":
            s = sde_sigma(t, float(times[1]))
        elif name == "logsnr":
            s = torch.log((1 - torch.where(t >= 1, torch.full_like(t, float(times[1])), t)) / t)
        else:
            s = t
        alpha = (s[0] - s) / (s[0] - s[-1])
        if name == "nearest":
            alpha = (alpha > 0.5).double()
        alpha = alpha[:, None].expand(-1, B)
        return 1 - alpha, alpha
    x = (lat if name == "z_fit" else vel)[steps].double().flatten(2)  # [W, B, D]
    d = x[-1] - x[0]  # [B, D]
    off = x - x[0]
    if name in ("z_fit", "v_fit"):
        alpha = (off * d).sum(-1) / (d * d).sum(-1)
        return 1 - alpha, alpha
    if name == "v_fit_window":
        alpha = (off * d).sum((-1, -2)) / (d * d).sum((-1, -2))
        alpha = alpha[:, None].expand(-1, B)
        return 1 - alpha, alpha
    if name == "v_fit2":  # v_k ~ c_a v_a + c_b v_b, pooled over samples
        va, vb = x[0].flatten(), x[-1].flatten()
        A = torch.stack([va, vb], 1)
        coef = torch.linalg.lstsq(A, x.flatten(1).T).solution  # [2, W]
        return coef[0][:, None].expand(-1, B), coef[1][:, None].expand(-1, B)
    raise ValueError(name)


def three_anchor_weights(name: str, times, steps) -> dict[int, torch.Tensor]:
    """{anchor index in the window: weights [W]} for the first, middle and last step."""
    t = times.double()[steps]
    W = len(steps)
    m = W // 2
    idx = (0, m, W - 1)
    if name == "quad3":
        out = {}
        for j in idx:
            others = [i for i in idx if i != j]
            out[j] = torch.prod(torch.stack([(t - t[i]) / (t[j] - t[i]) for i in others]), 0)
        return out
    if name == "halves":  # two disjoint 2-anchor windows [0..m-1] and [m..W-1]: 4 passes, what disjoint W/2 does
        out = {j: torch.zeros(W, dtype=torch.float64) for j in (0, m - 1, m, W - 1)}
        for lo, hi in ((0, m - 1), (m, W - 1)):
            for k in range(lo, hi + 1):
                a = (t[lo] - t[k]) / (t[lo] - t[hi])
                out[lo][k], out[hi][k] = 1 - a, a
        return out
    # piecewise linear: [0..m] and [m..W-1]
    w0, wm, wl = torch.zeros(W, dtype=torch.float64), torch.zeros(W, dtype=torch.float64), torch.zeros(W, dtype=torch.float64)
    for k in range(W):
        if k <= m:
            a = (t[0] - t[k]) / (t[0] - t[m])
            w0[k], wm[k] = 1 - a, a
        else:
            a = (t[m] - t[k]) / (t[m] - t[-1])
            wm[k], wl[k] = 1 - a, a
    return {0: w0, m: wm, W - 1: wl}


def agreement(approx: torch.Tensor, exact: torch.Tensor) -> tuple[float, float]:
    return (float(approx @ exact / (approx.norm() * exact.norm()).clamp_min(1e-300)),
            float((approx - exact).norm() / exact.norm().clamp_min(1e-300)))


def group_rows(module, mb, cond, loss, trained, seed, group, sums: dict) -> list[dict]:
    """Rows of one GRPO group; ``sums[(W, first step, estimator)]`` accumulates (approx, exact) over groups."""
    params = list(module.policy.lora_parameters())
    n = mb.latents.shape[1]
    v, g = {}, {}
    for k in trained:  # forward with grad per trained step (theta = theta_old: equals the recorded velocity)
        v[k] = module.policy.velocity(mb.latents[k], mb.times[k].expand(n), cond)
        leaf = mb.velocities[k].detach().requires_grad_(True)
        (g[k],) = torch.autograd.grad(loss(k, leaf), leaf)

    def grad_of(upstream: dict[int, torch.Tensor]) -> torch.Tensor:
        obj = sum((v[k] * u.to(v[k].dtype)).sum() for k, u in upstream.items())
        grads = torch.autograd.grad(obj, params, retain_graph=True, allow_unused=True)
        return torch.cat([(gr if gr is not None else torch.zeros_like(p)).flatten().double()
                          for gr, p in zip(grads, params)])

    per_step = {k: grad_of({k: g[k]}) for k in trained}
    rows = []
    for W in WINDOWS:
        for start in range(0, len(trained) - W + 1, W):
            steps = trained[start : start + W]
            exact = sum(per_step[k] for k in steps)
            base = {"seed": seed, "group": group, "W": W, "steps": steps}

            def add(name, approx, passes, extra=None):
                cos, rel = agreement(approx, exact)
                key = (W, steps[0], name)
                prev = sums.get(key, (0, 0, []))
                sums[key] = (prev[0] + approx, prev[1] + exact, prev[2] + [exact])
                rows.append(dict(base, estimator=name, cosine=cos, rel_error=rel, passes=passes, **(extra or {})))

            for name in TWO_ANCHOR:
                wa, wb = two_anchor_weights(name, mb.times, mb.latents, mb.velocities, steps)
                shape = (-1,) + (1,) * (g[steps[0]].dim() - 1)
                ua = sum(wa[i].view(shape).to(g[k].dtype) * g[k] for i, k in enumerate(steps))
                ub = sum(wb[i].view(shape).to(g[k].dtype) * g[k] for i, k in enumerate(steps))
                alpha_interior = wb[1:-1].mean(1).tolist() if W > 2 else []
                add(name, grad_of({steps[0]: ua, steps[-1]: ub}), 2, {"alpha": alpha_interior})
            if W >= 4:
                for name in ("quad3", "pwl3"):
                    up = {steps[j]: sum(float(w[i]) * g[k] for i, k in enumerate(steps))
                          for j, w in three_anchor_weights(name, mb.times, steps).items()}
                    add(name, grad_of(up), 3)
            if W == 8:
                up = {steps[j]: sum(float(w[i]) * g[k] for i, k in enumerate(steps))
                      for j, w in three_anchor_weights("halves", mb.times, steps).items()}
                add("halves", grad_of(up), 4)
            # oracles: columns J_j^T g_k for anchors j in {a, b} and every k of the window
            a, b = steps[0], steps[-1]
            Ta = torch.stack([grad_of({a: g[k]}) for k in steps], 1)  # [D, W]
            Tb = torch.stack([grad_of({b: g[k]}) for k in steps], 1)
            inner = list(range(1, W - 1))
            if inner:
                fixed = Ta[:, 0] + Tb[:, -1] + Ta[:, inner].sum(1)  # alpha = 0 on the interior, anchors own
                D = Tb[:, inner] - Ta[:, inner]
                alpha = torch.linalg.lstsq(D, (exact - fixed)[:, None]).solution[:, 0]
                add("oracle_alpha", fixed + D @ alpha, 2, {"alpha": alpha.tolist()})
                A = torch.cat([Ta[:, inner], Tb[:, inner]], 1)
                coef = torch.linalg.lstsq(A, (exact - Ta[:, 0] - Tb[:, -1])[:, None]).solution[:, 0]
                add("oracle_free", Ta[:, 0] + Tb[:, -1] + A @ coef, 2)
    return rows


def run(args) -> list[dict]:
    from jagg_lightning.data import read_prompts
    from jagg_lightning.testbed.evaluate import module_from_config
    from jagg_lightning.utils.batching import batch_slice

    torch.set_num_threads(1)
    cfg = yaml.safe_load(Path(args.config).read_text())
    cfg["model"]["sampling"]["trained_steps"] = 8
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(cfg, f)
    prompts = read_prompts(ROOT / cfg["data"]["prompts_file"])
    rows, batch_rows = [], []
    for seed in args.seeds:
        module, _ = module_from_config(f.name, seed, jagg_frac=0.0)
        trained = list(module.trained_steps)
        assert len(trained) == 8, trained
        gen = torch.Generator().manual_seed(seed)
        pick = torch.randperm(len(prompts), generator=gen)[: args.prompts].tolist()
        traj, cond, _, rewards, _ = module.sampler.rollout_and_score([prompts[i] for i in pick], pick, 20_000 + seed,
                                                                     reward=module.reward_fn)
        adv = module.updater.advantages(rewards)
        K = module.sampling.group_size
        sums = {}
        for grp in range(len(pick)):
            index = torch.arange(grp * K, (grp + 1) * K)
            if adv[index].abs().max() == 0:
                continue
            mb = traj.select(index)
            loss = module.updater.step_loss_fn(mb, adv[index], None, 1.0 / len(trained), [])
            rows += group_rows(module, mb, batch_slice(cond, index), loss, trained, seed, grp, sums)
        for (W, first, name), (approx, exact, parts) in sums.items():
            # the whole rollout's window gradient (every group summed, as the update makes it); sampling noise
            # of that gradient: two halves of the groups, ||h1 - h2|| / ||h1 + h2||
            cos, rel = agreement(approx, exact)
            h1, h2 = sum(parts[0::2]), sum(parts[1::2])
            batch_rows.append({"seed": seed, "W": W, "first": first, "estimator": name, "cosine": cos, "rel_error": rel,
                               "groups": len(parts), "noise_rel": float((h1 - h2).norm() / (h1 + h2).norm())})
        print(f"seed {seed}: {len(rows)} rows", flush=True)
    Path(f.name).unlink()
    return rows, batch_rows


def summarise(rows: list[dict]) -> dict:
    out = {}
    for W in WINDOWS:
        for name in dict.fromkeys(r["estimator"] for r in rows if r["W"] == W):
            sel = [r for r in rows if r["W"] == W and r["estimator"] == name]
            rel = [r["rel_error"] for r in sel]
            base = {(r["seed"], r["group"], tuple(r["steps"])): r["rel_error"] for r in rows
                    if r["W"] == W and r["estimator"] == "t"}
            diff = [r["rel_error"] - base[(r["seed"], r["group"], tuple(r["steps"]))] for r in sel]
            m = sum(diff) / len(diff)
            sd = math.sqrt(sum((d - m) ** 2 for d in diff) / max(1, len(diff) - 1))
            out[f"W={W} {name}"] = {
                "W": W, "estimator": name, "n": len(sel), "passes": sel[0]["passes"],
                "cosine_mean": sum(r["cosine"] for r in sel) / len(sel),
                "rel_error_mean": sum(rel) / len(rel), "rel_error_rms": math.sqrt(sum(x * x for x in rel) / len(rel)),
                "minus_t_mean": m, "minus_t_se": sd / math.sqrt(len(diff)),
                "wins_vs_t": sum(d < 0 for d in diff) / len(diff),
                "alpha_mean": ([sum(x) / len(sel) for x in zip(*[r["alpha"] for r in sel])] if sel[0].get("alpha") else None),
            }
    return out


def summarise_batch(batch_rows: list[dict]) -> dict:
    out = {}
    for r in batch_rows:
        out.setdefault(f"W={r['W']} {r['estimator']}", []).append(r)
    return {k: {"n": len(v), "rel_error_mean": sum(r["rel_error"] for r in v) / len(v),
                "cosine_mean": sum(r["cosine"] for r in v) / len(v),
                "noise_rel_mean": sum(r["noise_rel"] for r in v) / len(v)} for k, v in out.items()}


def table(summary: dict) -> str:
    lines = ["| W | estimator | anchor passes | windows | cosine | rel. error mean (rms) | − paper's (± s.e., paired) "
             "| better than paper's in | mean interior alpha |", "|---|---|---|---|---|---|---|---|---|"]
    for key, s in summary.items():
        if key == "batch":
            continue
        alpha = ", ".join(f"{a:.2f}" for a in s["alpha_mean"]) if s["alpha_mean"] else ""
        lines.append(f"| {s['W']} | {s['estimator']} | {s['passes']} of {s['W']} | {s['n']} | {s['cosine_mean']:.3f} | "
                     f"{s['rel_error_mean']:.3f} ({s['rel_error_rms']:.3f}) | {s['minus_t_mean']:+.3f} ± "
                     f"{s['minus_t_se']:.3f} | {100 * s['wins_vs_t']:.0f} % | {alpha} |")
    lines += ["", "Unbiased control variate (paper's estimator + B/p (exact - JAGG)): rms relative error "
              "sqrt((1 - p)/p) x the paper's rms, expected passes 2 + p (W - 2):", "",
              "| W | p | expected passes | rms rel. error (unbiased) | paper's rms rel. error (biased) |", "|---|---|---|---|---|"]
    for W in WINDOWS:
        s = summary.get(f"W={W} t")
        if s:
            for p in (0.1, 0.25, 0.5):
                lines.append(f"| {W} | {p} | {2 + p * (W - 2):.2f} | {math.sqrt((1 - p) / p) * s['rel_error_rms']:.3f} | "
                             f"{s['rel_error_rms']:.3f} |")
    lines += ["", "The whole rollout's window gradient (every group summed), against its own sampling noise "
              "(||h1 - h2|| / ||h1 + h2||, the groups split in two halves):", "",
              "| W, estimator | windows | cosine | rel. error | sampling noise |", "|---|---|---|---|---|"]
    for k, v in summary.get("batch", {}).items():
        lines.append(f"| {k} | {v['n']} | {v['cosine_mean']:.3f} | {v['rel_error_mean']:.3f} | {v['noise_rel_mean']:.3f} |")
    return "\n".join(lines)


FIELDS = ("seed", "group", "W", "steps", "estimator", "passes", "cosine", "rel_error", "alpha")


def compact(row: dict) -> list:
    """A row as a list in FIELDS order, floats to 5 significant digits (keeps the JSON small)."""
    def r(x):
        return float(f"{x:.5g}") if isinstance(x, float) else [r(y) for y in x] if isinstance(x, list) else x
    return [r(row.get(k)) for k in FIELDS]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs" / "digits.yaml"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--prompts", type=int, default=16, help="GRPO groups per seed")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    p.add_argument("--replot", default=None)
    args = p.parse_args(argv)
    t0 = time.process_time()
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        rows, batch_rows = [dict(zip(FIELDS, r)) for r in saved["rows"]], saved["batch_rows"]
    else:
        rows, batch_rows = run(args)
    summary = summarise(rows)
    summary["batch"] = summarise_batch(batch_rows)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "estimators.json").write_text(json.dumps({"args": vars(args), "row_fields": FIELDS, "rows": [compact(r) for r in rows],
                                                                "batch_rows": batch_rows,
                                                                "summary": summary,
                                                                "cpu_s": time.process_time() - t0}) + "\n")
    print(table(summary))
    return summary


if __name__ == "__main__":
    main()
