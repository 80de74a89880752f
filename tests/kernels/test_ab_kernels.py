"""The kernel A/B tool (benchmarks/ab_kernels.py) on CPU: how builds are named and loaded, and what it reports when
outputs differ. Its GPU runs are recorded in BENCHMARKS.md."""
import pathlib

import pytest
import torch

from support import benchmark_module

AB = benchmark_module("ab_kernels")
SRC = pathlib.Path(__file__).parents[2] / "src" / "sparse_mqa_kernels"


def test_builds_are_name_path_pairs_in_order(tmp_path):
    f = tmp_path / "k.py"
    f.write_text("")
    assert AB.parse_builds([f"base={f}", f"new={f}"]) == [("base", str(f)), ("new", str(f))]
    for bad, says in [(["base"], "name=path"), ([f"={f}"], "name=path"), (["x=/no/such.py"], "is not a file"),
                      ([f"a={f}", f"a={f}"], "must differ")]:
        with pytest.raises(SystemExit, match=says):
            AB.parse_builds(bad)


@pytest.mark.parametrize("module, entry", [("backward_ws.py", "build_program"), ("bwd_rows.py", "build_bound")])
def test_a_kernel_file_loads_beside_the_package(module, entry):
    """A copy of a kernel module loads as a submodule of sparse_mqa_kernels, so its relative imports resolve."""
    mod = AB.load(str(SRC / module), "t")
    assert mod.__name__ == "sparse_mqa_kernels._ab_t" and callable(getattr(mod, entry))


def test_compare_names_what_differs_and_in_how_many_rows():
    a = (torch.zeros(1, 4, 3), torch.zeros(1, 8, 2, dtype=torch.int32))
    b = (a[0].clone(), a[1].clone())
    assert AB.compare(a, b) == "equal"
    a[1][0, 2, 0] = -9
    b = (a[0].clone(), a[1].clone())
    b[0][0, 1, 2] = 1.0
    b[1][0, 5] = 7
    b[1][0, 6, 1] = -1
    assert AB.compare(a, b) == ("dq: 1 of 4 rows differ (by up to 1, max |first| 0); "
                                "sums: 2 of 8 rows differ (by up to 7, max |first| 9)")


def test_a_module_may_give_its_sums_another_encoding():
    """``canonical_sums`` maps a copy's integer output to int32 sums before any comparison; a module without one
    compares as written."""
    sums = torch.tensor([[[-3, 5, 2, 9]]], dtype=torch.int32)
    borrowed = sums.clone()
    borrowed[..., 1] -= 1  # what 64-bit adds of the pair leave: the low word's borrow in the high one

    class Pairs:
        @staticmethod
        def canonical_sums(acc):
            out = acc.clone()
            out[..., 1::2] += (acc[..., 0::2] < 0).to(acc.dtype)
            return out

    dq = torch.zeros(1, 1, 2)
    assert AB.compare((dq, sums), AB.canonical(Pairs, (dq, borrowed))) == "equal"
    assert AB.canonical(object(), (dq, borrowed))[1] is borrowed


def test_compile_only_builds_each_file_for_the_presets_variant(capsys):
    """``--compile-only`` builds every file for sm_90a (no GPU), as the GPU run would; here two copies of the tree's
    bound pass, which the compile tests build too (the same source: TileLang's cache serves it)."""
    pytest.importorskip("tilelang")
    path = str(SRC / "bwd_rows.py")
    assert AB.main(["bound", f"a={path}", f"b={path}", "--preset", "anchor", "--compile-only"]) == 0
    assert "[anchor] built a, b in " in capsys.readouterr().out  # (TileLang logs to stdout too)
    with pytest.raises(SystemExit, match="choose from"):
        AB.main(["bound", f"a={path}", "--preset", "nope", "--compile-only"])


def test_a_modules_pass_configs_reach_the_compiler(monkeypatch):
    """A copy's ``PASS_CONFIGS`` goes to ``tilelang.compile`` (how a copy switches off TileLang's automatic barriers);
    a module without one compiles with TileLang's defaults."""
    tilelang = pytest.importorskip("tilelang")
    seen = []
    monkeypatch.setattr(tilelang, "compile", lambda program, **kw: seen.append(kw.get("pass_configs")))

    class Copy:
        PASS_CONFIGS = {"tl.disable_thread_storage_sync": True}

        @staticmethod
        def build_bound(dqk, dv, stored=False):
            return (dqk, dv, stored)

    class Plain:
        build_bound = Copy.build_bound

    AB.build("bound", Copy, 576, 512, None)
    AB.build("bound", Plain, 576, 512, None)
    assert seen == [{"tl.disable_thread_storage_sync": True}, None]
