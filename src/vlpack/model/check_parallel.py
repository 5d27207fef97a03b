"""`vlpack check --cp N` on k·N processes: k data-parallel replicas of a context-parallel group.

Each replica checks its own row (the samples in another order, `check_data.load_samples`), so
a collective that runs over the wrong group (keys and values gathered over the world instead
of the context group) hands a rank rows of another replica's sample and fails the check; with
one replica the two groups coincide and such a bug goes unseen. The replicas' reports are
merged on every rank: the check passes only if every replica passes."""

from __future__ import annotations


def merge_replicas(report: dict, reports: list[dict]) -> dict:
    """`report` of this process merged with every process's `reports` (this one's included;
    train/check.py gathers them): `passed` only if all passed, each failure prefixed with its
    replica (once per replica), `replicas` listing each replica's samples, result and largest
    logit difference."""
    first = {}
    for r in reports:
        first.setdefault(r["replica"], r)
    failures = [f"replica {k}: {f}" for k, r in sorted(first.items()) for f in r["failures"]]
    replicas = [dict(replica=k, passed=r["passed"], sample_keys=r["sample_keys"],
                     max_logit_diff=r["max_logit_diff"]) for k, r in sorted(first.items())]
    return {**report, "failures": failures, "passed": not failures, "replicas": replicas}


def format_replicas(r: dict) -> list[str]:
    """The report's lines for its data-parallel replicas (none for a single replica)."""
    return [f"data-parallel replica {x['replica']}: {'passed' if x['passed'] else 'FAILED'}, "
            f"max |dlogit| {x['max_logit_diff']:.2e}, samples " + ", ".join(x["sample_keys"])
            for x in r.get("replicas", ())]
