"""`tokenmill bench` dispatch, `bench profile` on a tiny model (CPU), and the CPU-side parts of the CUDA-only
benchmarks (step-gaps' trace analysis, all-reduce's flags) with their refusal on a machine without the GPUs."""
from __future__ import annotations

import pytest

from tokenmill.benchmarks import all_reduce, step_gaps, workload_profile
from tokenmill.entrypoints.cli.main import BENCHMARKS, bench

needs_no_cuda = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without CUDA")


def test_bench_help_lists_every_benchmark_and_rejects_unknown_names(capsys):
    with pytest.raises(SystemExit) as e:
        bench(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for name, (_, help) in BENCHMARKS.items():
        assert name in out and help.split()[0] in out
    with pytest.raises(SystemExit) as e:
        bench(["no-such-bench"])
    assert e.value.code == 2 and "invalid choice" in capsys.readouterr().err


def test_bench_dispatches_and_reports_refused_values(tiny_model_factory, capsys):
    d = tiny_model_factory("llama")
    assert bench(["latency", "--model", d, "--batch-size", "1", "--input-len", "4", "--output-len", "3",
                  "--num-iters", "1", "--num-iters-warmup", "0", "--max-model-len", "64"]) == 0
    assert "decode:" in capsys.readouterr().out
    assert bench(["throughput", "--model", "qwen3-0.6b", "--top-p", "2", "--num-prompts", "1"]) == 2
    assert "tokenmill bench throughput:" in capsys.readouterr().err


def test_bench_serve_through_the_command(fake, capsys):
    common = ["serve", "--port", str(fake.port), "--num-prompts", "4", "--random-input-len", "8",
              "--random-output-len", "3", "--disable-tqdm"]
    assert bench(common) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert bench(common + ["--random-range-ratio", "1.5"]) == 1
    assert capsys.readouterr().err.startswith("tokenmill bench serve: ")


def test_profile_reports_phases_steps_and_ops(tiny_model_factory, tmp_path, capsys):
    d = tiny_model_factory("llama")
    out = tmp_path / "profile.json"
    res = workload_profile.main(["--model", d, "--num-prompts", "4", "--input-len", "10", "--output-len", "6",
                                 "--random-range-ratio", "0", "--max-model-len", "128", "--temperature", "0",
                                 "--cprofile", "5", "--kernels", "5", "--output-json", str(out)])
    assert res["total_output_tokens"] == 24 and res["output_tokens_per_second"] > 0
    assert {"schedule", "execute_model", "sample"} <= set(res["phases"])
    steps = {(r["kind"], r["max_requests"]): r["steps"] for r in res["steps"]}
    # Four 10-token prompts fit one step's budget: one prefill step (their first tokens), then five decode steps
    # of all four requests.
    assert steps == {("prefill", 4): 1, ("decode", 4): 5}
    assert res["kernels"]["top"] and res["kernels"]["op_seconds"] > 0
    printed = capsys.readouterr().out
    assert "steps by kind" in printed and "cProfile, top 5" in printed and "torch.profiler" in printed
    assert out.exists()
    with pytest.raises(SystemExit):
        workload_profile.main(["--model", d, "--cprofile", "-1", "--max-model-len", "128"])


def test_profile_step_buckets_restore_the_core():
    class Core:
        last_scheduled = None

        def step(self):
            return "out"
    core = Core()
    with workload_profile.StepBuckets(core) as b:
        assert core.step() == "out" and "step" in vars(core)
    assert "step" not in vars(core) and b.rows() == []


def test_triton_compiles_are_found_by_mtime(tmp_path):
    import os
    import time
    old = tmp_path / "a" / "old_kernel.json"
    old.parent.mkdir()
    old.write_text("{}")
    os.utime(old, (time.time() - 100, time.time() - 100))
    since = time.time() - 50
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "_race_stage1.json").write_text("{}")
    (tmp_path / "b" / "__grp___race_stage1.json").write_text("{}")
    assert workload_profile.files_written_since(str(tmp_path), since) == ["_race_stage1"]


def _trace(correlated: bool) -> list[dict]:
    """Three graph launches (host ts 0, 50, 100, 10 us each); each graph runs kernels k0, k1 for 30 us in all,
    graph g starting at 20 + 40 g; a 2 us copy sits in each gap."""
    ev = []
    for g in range(3):
        ev.append({"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 50 * g, "dur": 10,
                   "args": {"correlation": 100 + g}})
        start = 20 + 40 * g
        for i, (off, dur) in enumerate(((0, 10), (12, 18))):
            args = {"correlation": 100 + g} if correlated else {}
            ev.append({"cat": "kernel", "name": f"k{i}", "ts": start + off, "dur": dur, "args": args})
        ev.append({"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": start + 32, "dur": 2, "args": {}})
    return ev


@pytest.mark.parametrize("correlated", [True, False])
def test_step_gaps_analysis_of_a_trace(correlated):
    res = step_gaps.analyse(_trace(correlated))
    assert res["n_launches"] == 3 and res["grouping"] == ("correlation" if correlated else "marker kernel")
    rows = res["rows"]
    assert len(rows) == 2
    for g, r in enumerate(rows):
        assert (r["span"], r["busy"], r["kernels"], r["gap"], r["period"]) == (30, 28, 2, 10, 40)
        assert r["gap_ops"] == [("Memcpy HtoD", 2, 2)]
        # graph g ends at 50 + 40 g; the host's next launch call ended at 50 (g + 1) + 10
        assert r["lead"] == (50 + 40 * g) - (50 * (g + 1) + 10)
    s = step_gaps.summarize_rows(rows)
    assert s["host_late_steps"] == 2 and s["host_late_us_per_step"] == 15
    assert s["gap_ops"]["Memcpy HtoD"]["count"] == 2
    assert "host late" in step_gaps.format_summary(s)


@needs_no_cuda
def test_step_gaps_refuses_without_cuda_and_without_graphs(capsys):
    with pytest.raises(SystemExit) as e:
        step_gaps.main(["--model", "qwen3-0.6b"])
    assert e.value.code == 2 and "needs 1 CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        step_gaps.main(["--model", "qwen3-0.6b", "--enforce-eager"])
    assert e.value.code == 2 and "--enforce-eager" in capsys.readouterr().err


@needs_no_cuda
def test_all_reduce_flags_and_refusal_without_gpus(capsys):
    assert all_reduce.parse_sizes("8, 16,4096") == [8, 16, 4096]
    for bad in ("8,x", "0", ""):
        with pytest.raises(Exception, match="sizes|integers"):
            all_reduce.parse_sizes(bad)
    with pytest.raises(SystemExit) as e:
        all_reduce.main(["--world-size", "1"])
    assert e.value.code == 2 and "--world-size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        all_reduce.main(["--sizes-kb", "8,16"])
    assert e.value.code == 2 and "needs 2 CUDA GPUs" in capsys.readouterr().err
    rows = [{"kb": 8, "nccl_us": 7.5, "symm_us": 7.7, "max_abs_err": 0.0}]
    assert all_reduce.format_rows(rows).splitlines()[1].split() == ["8", "7.50", "7.70", "0"]
