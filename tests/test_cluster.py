"""Dask: --workers N and --scheduler ADDRESS give the same artifact as a single-process run."""

from __future__ import annotations

import numpy as np
import pytest
from unionsparse.compressor.artifact import Artifact

COMMON = ("--quiet", "--prune", "magnitude", "--quant", "w4a4", "--reorder", "dp")


def assert_same_arrays(a_path, b_path) -> None:
    a, b = Artifact(a_path), Artifact(b_path)
    assert a.layer_names == b.layer_names  # layer order in the index is the submission order
    for name in a.layer_names:
        ra, rb = a.read_layer(name).arrays(), b.read_layer(name).arrays()
        assert ra.keys() == rb.keys(), name
        for k in ra:
            assert ra[k].dtype == rb[k].dtype and np.array_equal(ra[k], rb[k]), (name, k)
    assert a.dense_names == b.dense_names
    for name in a.dense_names:
        assert np.array_equal(a.read_dense(name), b.read_dense(name)), name


@pytest.fixture(scope="module")
def single(tmp_path_factory, model_dirs):
    from unionsparse.compressor.cli import main

    out = tmp_path_factory.mktemp("single") / "one.zarr"
    with pytest.raises(SystemExit) as e:
        main(["compress", str(model_dirs["llama"]), "-o", str(out), *COMMON])
    assert e.value.code == 0
    return out


def test_local_cluster_two_workers_identical(single, tmp_path, model_dirs, run_cli):
    out = tmp_path / "dask.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--workers", "2")
    assert r.code == 0, r.err
    assert_same_arrays(single, out)
    # --workers is not part of the stored recipe
    assert Artifact(out).attrs["config"] == Artifact(single).attrs["config"]


@pytest.mark.slow
def test_existing_scheduler_identical(single, tmp_path, model_dirs, run_cli):
    from dask.distributed import LocalCluster
    from unionsparse.compressor.cluster import WORKER_ENV

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0",
                      env=WORKER_ENV) as cluster:
        out = tmp_path / "sched.zarr"
        address = cluster.scheduler_address
        r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--scheduler", address)
        assert r.code == 0, r.err
        assert_same_arrays(single, out)


def test_unreachable_scheduler_is_bad_input(tmp_path, model_dirs, run_cli):
    out = tmp_path / "x.zarr"
    r = run_cli("compress", model_dirs["llama"], "-o", out, *COMMON, "--scheduler", "tcp://127.0.0.1:9")
    assert r.code == 2
    lines = [ln for ln in r.err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "--scheduler" in lines[0] and "Traceback" not in r.err
    assert not out.exists() and not (tmp_path / "x.zarr.partial").exists()
