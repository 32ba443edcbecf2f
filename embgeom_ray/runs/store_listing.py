"""What a re-analysis store holds: ``embgeom reanalyze --store STORE --list`` and
``embgeom_ray.store_runs(STORE)``.

Both read ``STORE/runs.parquet`` (:func:`~embgeom_ray.runs.reanalyze.read_index`): every run
reanalyze made or adopted, complete or not. The **latest** run of a model is its complete run
that finished last (by ``finished_at``), whatever its options or corpus: what a user compares
to see where each watched model stands now. A model whose runs all failed has none.
"""

from __future__ import annotations

import shlex

import pandas as pd

from ..errors import OutputError
from ..io_utils import exists, join
from ..storage import check_reachable
from .reanalyze import INDEX, read_index

#: the columns the listing prints, in order
LISTING_COLUMNS = ("latest", "model", "revision", "status", "finished_at", "n_tokens",
                   "anisotropy_last", "isoscore_last", "out")  # fmt: skip


def latest_runs(index: pd.DataFrame) -> pd.DataFrame:
    """The latest complete run of each model of ``index`` (see the module), one row a model,
    in the order of the models' first rows."""
    done = index[index["status"] == "complete"].sort_values("finished_at", kind="stable")
    latest = done.drop_duplicates("model", keep="last")
    order = {m: i for i, m in enumerate(dict.fromkeys(index["model"]))}
    return latest.sort_values("model", key=lambda s: s.map(order)).reset_index(drop=True)


def store_runs(store: str, latest: bool = False) -> pd.DataFrame:
    """``STORE/runs.parquet``, sorted by model then start time, with a boolean column
    ``latest`` (the model's latest complete run); ``latest=True``: those rows only.
    :class:`OutputError` if the store does not exist or has no index (a mistyped store, or
    nothing ran there); :class:`~embgeom_ray.errors.StorageError` if its object store does not
    answer or lacks its bucket. Reads only: a missing store is not created."""
    check_reachable(store, "store")
    if not exists(store):
        raise OutputError(
            f"the store {store} does not exist: a mistyped --store, or reanalyze has not run "
            "there yet"
        )
    if not exists(join(store, INDEX)):
        raise OutputError(
            f"{store} holds no {INDEX}: not a reanalyze store, or nothing has run there yet"
        )
    index = read_index(store)
    newest = set(latest_runs(index)["key"])
    index = index.assign(latest=index["key"].isin(newest))
    index = index.sort_values(["model", "started_at"], kind="stable", na_position="first")
    if latest:
        index = index[index["latest"]]
    return index.reset_index(drop=True)


def listing_lines(store: str) -> list[str]:
    """What ``--list`` prints: one row a run (``*`` marks each model's latest complete run;
    a failed run's error follows it), then the command that compares the latest runs."""
    runs = store_runs(store)
    if runs.empty:
        return [f"{store} holds no runs yet"]
    table = runs.assign(
        latest=runs["latest"].map({True: "*", False: ""}),
        revision=runs["revision"].str.replace("sha256:", "", regex=False).str[:12],
    )[list(LISTING_COLUMNS)]
    lines = table.to_string(index=False, na_rep="-", float_format="{:.4f}".format).splitlines()
    for row in runs.itertuples():
        if row.status == "failed" and isinstance(row.error, str):
            lines.append(f"failed: {row.model} -> {row.out}: {row.error}")
    newest = runs.loc[runs["latest"], "out"].tolist()
    corpora = sorted(set(runs.loc[runs["latest"], "corpus"].dropna()))
    if len(corpora) > 1:
        lines.append(f"note: the latest runs are over {len(corpora)} corpora: {corpora}")
    if len(newest) >= 2:
        lines.append("compare the latest runs: embgeom compare "
                     + " ".join(shlex.quote(o) for o in newest) + " --out CMP_DIR")  # fmt: skip
    return lines
