"""benchmarks/probe_native.py: a GRPO step's phases as repeatable calls, and perf's samples
summed into kinds of work (the summing tested on a report of perf's format; the sampling
itself needs Linux perf, which the probe asks for by name)."""

from __future__ import annotations

import probe_native as probe
import pytest

REPORT = """\
# Samples: 16K of event 'cpu-clock'
#
# Overhead  Shared Object         Symbol
# ........  ....................  ......
#
    13.11%  libtorch_cpu.so       [.] mkl_blas_avx512_sgemm_kernel_0_b0
     8.73%  libtorch_cpu.so       [.] mkl_blas_avx512_xsgemv
     8.40%  libtorch_cpu.so       [.] c10::function_ref<void (char**, long const*, long, long)>::callback_fn<at::native::AVX2::VectorizedLoop2d<at::native::AVX2::direct_copy_kernel(at::TensorIteratorBase&)::{lambda()#3}>
     4.00%  libtorch_cpu.so       [.] c10::function_ref<void (char**, long const*, long, long)>::callback_fn<at::native::AVX2::VectorizedLoop2d<at::native::(anonymous namespace)::mul_kernel(at::TensorIteratorBase&)::{lambda()#2}>
     3.35%  libpython3.11.so.1.0  [.] _PyEval_EvalFrameDefault
     2.00%  libtorch_cpu.so       [.] at::native::(anonymous namespace)::cpu_flash_attention<float, float, 32l, 512l, false>(at::Tensor const&)
     1.17%  libc.so.6             [.] _int_malloc
     0.85%  libtorch_cpu.so       [.] c10::impl::OperatorEntry::lookup
     0.30%  libtorch_cpu.so       [.] at::internal::serial_for_each
     0.80%  [JIT] tid 4242        [.] 0x00007f31c8a01200
     0.50%  [kernel.kallsyms]     [k] clear_page_erms
     0.10%  libgomp.so.1          [.] gomp_barrier_wait
"""


def test_a_perf_report_is_summed_into_kinds_of_work() -> None:
    rows = probe.parse_report(REPORT)
    assert len(rows) == 12 and rows[0] == (13.11, "libtorch_cpu.so", rows[0][2])
    summary = probe.summarise(rows, top=3)
    kinds = summary["kinds"]
    assert list(kinds) == list(probe.KINDS)
    assert kinds["matrix products"] == pytest.approx(13.11 + 0.80)  # MKL and oneDNN's JIT code
    assert kinds["matrix-vector products"] == pytest.approx(8.73)
    assert kinds["copies"] == pytest.approx(8.40)
    assert kinds["element-wise kernels and reductions"] == pytest.approx(4.00 + 0.30)
    assert kinds["attention kernels"] == pytest.approx(2.00)
    assert kinds["Python interpreter"] == pytest.approx(3.35)
    assert kinds["allocator"] == pytest.approx(1.17)
    assert kinds["dispatch, bindings, bookkeeping"] == pytest.approx(0.85)
    assert kinds["OS kernel"] == pytest.approx(0.50) and kinds["other"] == pytest.approx(0.10)
    assert sum(kinds.values()) == pytest.approx(sum(r[0] for r in rows))
    assert summary["largest_by_kind"]["copies"] == [
        "8.40 libtorch_cpu.so: direct_copy_kernel (AVX2)"
    ]
    assert [t["symbol"] for t in summary["top"]] == [
        "mkl_blas_avx512_sgemm_kernel_0_b0", "mkl_blas_avx512_xsgemv", "direct_copy_kernel (AVX2)",
    ]  # fmt: skip


def test_the_phases_run_again_and_leave_the_loop_as_it_was(tmp_path) -> None:
    from anchor_rl.trainer import loop

    before = (loop.score_logprobs, loop.ppo_update)
    small = ["rollout.prompts_per_step=2", "rollout.n=2", "rollout.max_new_tokens=8"]
    calls = probe.phases("random:tiny", small, tmp_path / "run")
    assert (loop.score_logprobs, loop.ppo_update) == before
    assert list(calls) == ["generate", "reference", "update"]
    assert len(calls["generate"]().group) == 2 * 2  # 2 prompts x 2 responses
    calls["reference"]()
    calls["update"]()


def test_without_perf_the_probe_says_what_it_needs(monkeypatch) -> None:
    monkeypatch.setattr(probe.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="needs Linux perf"):
        probe.main(["random:tiny"])
