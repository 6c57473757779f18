"""Dask: --workers N and --scheduler ADDRESS give the same artifact as a single-process run."""

from __future__ import annotations

import pytest
from conftest import REFERENCE_FLAGS, assert_same_artifacts
from unionsparse.compressor.artifact.store import Artifact

COMMON = REFERENCE_FLAGS


def test_local_cluster_two_workers_identical(reference_artifact, tmp_path, model_dirs, run_cli):
    out = tmp_path / "dask.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--workers", "2")
    assert r.code == 0, r.err
    assert_same_artifacts(reference_artifact, out)
    # --workers is not part of the stored recipe
    assert Artifact(out).attrs["config"] == Artifact(reference_artifact).attrs["config"]


@pytest.mark.slow
def test_existing_scheduler_identical(reference_artifact, tmp_path, model_dirs, run_cli):
    from dask.distributed import LocalCluster
    from unionsparse.compressor.pipeline.executor import WORKER_ENV

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        out = tmp_path / "sched.zarr"
        address = cluster.scheduler_address
        r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--scheduler", address)
        assert r.code == 0, r.err
        assert_same_artifacts(reference_artifact, out)


def test_unreachable_scheduler_is_bad_input(tmp_path, model_dirs, run_cli):
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--scheduler", "tcp://127.0.0.1:9")
    assert r.code == 2
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--scheduler" in lines[0] and "Traceback" not in r.err
    assert not out.exists() and not (tmp_path / "x.zarr.partial").exists()
