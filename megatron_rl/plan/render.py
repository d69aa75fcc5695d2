"""Human and machine views of a plan and its report (used by ``tools/check_plan.py``).

Per-component ``gpus`` credits a ``|`` group's GPUs to its largest member and 0
to the others, so the column sums to ``total_gpus``.
"""

from __future__ import annotations

from megatron_rl.plan.allocation import Allocation, Component
from megatron_rl.plan.validate import Cluster, PlanReport


def _dims_text(c: Component) -> str:
    return f"attn:{c.dims}|ffn:{c.ffn}" if c.ffn else str(c.dims)


def component_rows(plan: Allocation) -> list[dict]:
    rows = []
    for g in plan.groups:
        owner = g.owner
        for c in g.members:
            rows.append({
                "backend": c.backend,
                "name": c.name,
                "role": c.role,
                "dims": c.dims.as_dict(),
                "ffn_dims": c.ffn.as_dict() if c.ffn else None,
                "spec": c.spec(),
                "world_size": c.world_size,
                "gpus": g.gpus if c is owner else 0,
                "colocated_with": [m.label for m in g.members if m is not c],
            })
    return rows


def report_dict(plan: Allocation, report: PlanReport, cluster: Cluster | None = None) -> dict:
    """The JSON object ``check_plan --json`` prints."""
    return {
        "valid": report.ok,
        "allocation": plan.to_string(),
        "total_gpus": plan.total_gpus,
        "has_rollout": plan.has_rollout,
        "has_training": plan.has_training,
        "policies": [a.label for a in plan.actors],
        "multi_policy": plan.is_multi_policy,
        "weight_update": plan.weight_update,
        "cluster": None if cluster is None else {
            "n_nodes": cluster.n_nodes, "gpus_per_node": cluster.gpus_per_node,
            "total_gpus": cluster.total_gpus},
        "components": component_rows(plan),
        "placement": [list(r) for r in report.placement],
        "errors": list(report.errors),
        "warnings": list(report.warnings),
        "info": list(report.info),
    }


def format_table(plan: Allocation, report: PlanReport, cluster: Cluster | None = None) -> str:
    """A fixed-width table of components, then demand, placement and findings."""
    header = ("backend", "name", "role", "dims", "world", "gpus", "colocated-with")
    rows = [(r["backend"], r["name"] or "-", r["role"], _dims_text(c), str(r["world_size"]),
             str(r["gpus"]), ", ".join(r["colocated_with"]) or "-")
            for r, c in zip(component_rows(plan), plan.components)]
    widths = [max(len(x) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [f"allocation: {plan.to_string()}", fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*row).rstrip() for row in rows]
    lines.append("")
    demand = f"total GPU demand: {plan.total_gpus}"
    if cluster is not None:
        demand += f" of {cluster.total_gpus} ({cluster.n_nodes} node(s) x {cluster.gpus_per_node})"
    lines.append(demand)
    lines.append(f"weight update: {plan.weight_update or '-'}")
    for g, (start, end) in zip(plan.groups, report.placement):
        lines.append(f"  GPUs {start}-{end - 1}: {g.spec()}")
    for title, items in (("error", report.errors), ("warning", report.warnings), ("info", report.info)):
        lines += [f"{title}: {item}" for item in items]
    lines.append("VALID" if report.ok else "INVALID")
    return "\n".join(lines)
